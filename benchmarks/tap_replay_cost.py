"""What a replay of a full CUDA graph broken at the taps costs the host, by how it is replayed.

A step whose programs need a tap's Python replays a capture broken at every tap
(`engine.v2_tap_graphs`): with every layer a tap that is one launch per segment and every tap's
Python. `compiled.replays` runs only the taps a step needs and joins the segments between them into
one launch (`compiled.joins`). This times, on a toy forward of `--layers` layers (a few small
kernels each, SmolLM2's width, 64 rows) captured the way the engine captures it:

- `one graph`: the same forward as one plain CUDA graph (what vLLM's own full graph costs);
- `every tap`: the broken capture replayed segment by segment, every tap's Python run (the
  replay before `compiled.replays`, and still the one for a step that needs every tap);
- `one tap`: a step that needs the middle layer's tap alone (two joined launches and one tap);
- `no tap`: a step that needs none of them (one joined launch).

For each, the host's microseconds to enqueue a replay (the mean over `--replays` replays
without waiting; what a host-bound engine pays a step) and the wall microseconds a replay
takes once the device finishes it too. The values after every way of replaying are checked
equal to the plain graph's. Needs a GPU:

    benchmarks/gpu/check.sh python3 benchmarks/tap_replay_cost.py [--layers 30] [--replays 200]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any


def main() -> None:
    """Capture the toy forward each way, time its replays, print a table."""
    import torch
    from vllm_runner.engine.v2_tap_graphs import TapBrokenCapture

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--width", type=int, default=576)
    parser.add_argument("--rows", type=int, default=64)
    arguments = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tap_replay_cost.py times CUDA graphs: run it on a GPU "
                         "(benchmarks/gpu/check.sh python3 benchmarks/tap_replay_cost.py)")
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(arguments.width, arguments.width, device="cuda",
                           generator=generator) / arguments.width ** 0.5
               for _ in range(arguments.layers)]
    start = torch.randn(arguments.rows, arguments.width, device="cuda", generator=generator)
    hidden = start.clone()
    served: list[int] = []

    def layer(index: int) -> None:
        hidden.copy_(torch.tanh(hidden @ weights[index]) + hidden)

    def tap(index: int) -> Callable[[], None]:
        return lambda: served.append(index)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.stream(stream):
        for index in range(arguments.layers):  # warm-up: cuBLAS picks its kernels
            layer(index)
        plain = torch.cuda.CUDAGraph()
        with torch.cuda.graph(plain, pool=pool, stream=stream):
            for index in range(arguments.layers):
                layer(index)
        with TapBrokenCapture(pool=pool) as broken:
            for index in range(arguments.layers):
                layer(index)
                broken.add_tap(tap(index), f"layers.{index}.layer_output|T")
    torch.cuda.current_stream().wait_stream(stream)
    middle = f"layers.{arguments.layers // 2}.layer_output"
    ways: dict[str, Callable[[], None]] = {
        "one graph": plain.replay,
        "every tap": broken.replay,
        "one tap": lambda: broken.replay_for([middle]),
        "no tap": lambda: broken.replay_for([]),
    }
    expected = _replayed(plain.replay, hidden, start)
    print(f"{arguments.layers} layers, {arguments.rows} rows of {arguments.width}; "
          f"{arguments.replays} replays each; {torch.cuda.get_device_name()}")
    print("| replay | host µs a replay (enqueue) | wall µs a replay | taps run |")
    print("|---|---|---|---|")
    for name, replay in ways.items():
        served.clear()
        result = _replayed(replay, hidden, start)
        if not torch.equal(result, expected):
            raise SystemExit(f"{name}: the values differ from the plain graph's")
        taps_run = len(served)
        replay()  # joined graphs are made at a set's first replay: not timed
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(arguments.replays):
            replay()
        enqueued = time.perf_counter()
        torch.cuda.synchronize()
        ended = time.perf_counter()
        print(f"| {name} | {(enqueued - began) / arguments.replays * 1e6:.1f} | "
              f"{(ended - began) / arguments.replays * 1e6:.1f} | {taps_run} |")


def _replayed(replay: Callable[[], None], hidden: Any, start: Any) -> Any:
    """The toy's output after one replay from `start`."""
    import torch

    hidden.copy_(start)
    replay()
    torch.cuda.synchronize()
    return hidden.clone()


if __name__ == "__main__":
    main()
