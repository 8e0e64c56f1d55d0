"""Where the time of collecting saves goes when the client runs apart from the engine core (vLLM's
default on a GPU): each stage of the path timed on its own, without an engine.

The compiled benchmark's *collecting* column (`compiled_bench.py --engine-core-apart`) times the
whole path as a user's `LLM` runs it: the worker moves the saves to the host (`to host`: through
shared memory, straight into each request's file), encodes them (`encode`: names the files, or
puts the bytes into the message), vLLM's engine core
puts the result into a message (`msgpack out`) and its client reads it back (`msgpack in`), and
the client decodes it (`decode`: maps the files, or copies out of the message). What the column
shows beyond the sum of these stages is the utility call's round trip through the engine core.

Run with `python benchmarks/collect_path_bench.py` in the stack's environment, on a GPU (the
saves start on the device, as they do there) or on a CPU (they start on the host: `to host` is
then nearly free). `--requests` saves of `--rows` x `--width` bf16 (by default one Llama-1B
layer's `layer_output` for a 272-token request: 1.1 MB), `--repeats` times, every result kept
(as a user keeps every output: fresh pages each time); prints the median of each stage, for the
saves through shared memory and inside the message.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult
from vllm_runner.saves import host_copies, wire

STAGES = ("to host", "encode", "msgpack out", "msgpack in", "decode")


def one_collection(saves: list[torch.Tensor], shared: bool, staging: torch.Tensor
                   ) -> tuple[dict[str, float], wire.Collected]:
    """The seconds of each stage of one collection of `saves`, and what the client got."""
    seconds: dict[str, float] = {}
    views = True  # the engine core's own worker: vLLM's default with one GPU and the core apart

    def timed(stage: str, work: Callable[[], Any]) -> Any:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = work()
        seconds[stage] = time.perf_counter() - start
        return result

    collected: wire.Collected = {f"request-{index}": {"error": None, "saved": {"layer": rows}}
                                 for index, rows in enumerate(saves)}
    files = wire.SharedFiles() if shared else None

    def to_host() -> None:  # as `SaveStore.collect` does: into the files, where there are some
        mover = host_copies.ToHost(lambda: staging)
        for key, result in collected.items():
            mover.add_all(result["saved"], files.places(key, result["saved"]) if files else None)
        mover.flush()

    timed("to host", to_host)
    data = timed("encode", lambda: wire.encode(collected, views=views, files=files))
    message = EngineCoreOutputs(utility_output=UtilityOutput(call_id=1,
                                                             result=UtilityResult(data)))
    frames = timed("msgpack out", lambda: [bytes(memoryview(frame)) for frame in  # type: ignore[arg-type]
                                           MsgpackEncoder().encode_into(message, bytearray())])
    received = timed("msgpack in", lambda: MsgpackDecoder(EngineCoreOutputs).decode(frames))
    decoded = timed("decode", lambda: wire.decode(received.utility_output.result.result))
    return seconds, decoded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rows", type=int, default=272)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    arguments = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    saves = [torch.randn(1, arguments.rows, arguments.width, dtype=torch.bfloat16,
                         device=device) for _ in range(arguments.requests)]
    total = sum(rows.numel() * rows.element_size() for rows in saves)
    staging = host_copies.staging_buffer()
    print(f"{arguments.requests} saves of {total / arguments.requests / 1e6:.2f} MB "
          f"({total / 1e6:.0f} MB) from the {device}, {host_copies.LANDING_THREADS} landing "
          f"threads; median of {arguments.repeats} collections, every result kept, in ms:")
    print(f"{'path':22}" + "".join(f"{stage:>12}" for stage in STAGES) + f"{'total':>10}")
    kept: list[wire.Collected] = []
    for shared in (True, False):
        timings: list[dict[str, float]] = []
        for _ in range(arguments.repeats):
            seconds, decoded = one_collection(saves, shared, staging)
            timings.append(seconds)
            kept.append(decoded)
        for index, rows in enumerate(saves):  # what came out is what went in
            assert torch.equal(kept[-1][f"request-{index}"]["saved"]["layer"], rows.cpu())
        medians = {stage: statistics.median(timing[stage] for timing in timings)
                   for stage in STAGES}
        path = "shared memory" if shared else "inside the message"
        print(f"{path:22}" + "".join(f"{medians[stage] * 1e3:12.1f}" for stage in STAGES)
              + f"{sum(medians.values()) * 1e3:10.1f}", flush=True)


if __name__ == "__main__":
    main()
