"""How long the worker's store takes to collect graph-tap saves, without an engine.

`collect_apart_probe.py` put the worker's collection at 28-30 ms on the H200 for 64 requests
saving one Llama-1B layer's graph tap, where copying the same bytes to the host alone
(`collect_path_bench.py`) took 11: the rest is taking each request's rows out of the graph taps'
arena (`saves.arena`) and the store's own work. This fills a `SaveStore` as the engine's steps do
(prompts prefilled in chunks of `--budget` tokens, then one row per request per decode step, all
in one arena) and times `SaveStore.collect` alone, every result kept; `--profile` prints the
torch operators it ran and their counts (what a per-request loop multiplies).

Run with `python benchmarks/store_collect_bench.py` in the stack's environment, on a GPU (the
arena lives there, as in the engine) or on a CPU.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from vllm_runner.saves.arena import SaveArena
from vllm_runner.saves.store import SaveStore, ToCollect

LOCATION = ("model.layers.8.layer_output",)


def filled_store(prompts: list[int], generated: int, width: int, budget: int,
                 device: torch.device) -> tuple[SaveStore, list[ToCollect]]:
    """A store holding what one wave of requests with `prompts` tokens saves at one graph tap
    over their prefill (chunks of at most `budget` tokens a step) and `generated - 1` decode
    steps (the last token is sampled, never forwarded), and what collecting them asks for."""
    store = SaveStore()
    arena = SaveArena(width, budget, device, torch.bfloat16)

    def step(saved: list[tuple[str, int, int]]) -> None:  # (request, first position, rows)
        rows = sum(count for _, _, count in saved)
        block, row = arena.reserve(rows)
        arena.write(LOCATION, block, row,
                    [torch.randn(rows, width, device=device, dtype=torch.bfloat16)])
        entries, at = [], row
        for request, first, count in saved:
            entries.append((request, first, block, at, count))
            at += count
        store.save_pending(LOCATION, arena, entries)

    prefilled = [0] * len(prompts)
    while any(done < length for done, length in zip(prefilled, prompts, strict=True)):
        room, saved = budget, []
        for index, length in enumerate(prompts):
            count = min(length - prefilled[index], room)
            if count > 0:
                saved.append((f"request-{index}", prefilled[index], count))
                prefilled[index] += count
                room -= count
        step(saved)
    for position in range(generated - 1):
        step([(f"request-{index}", length + position, 1) for index, length in enumerate(prompts)])
    return store, [ToCollect(f"request-{index}", length + generated - 1, {LOCATION[0]: None})
                   for index, length in enumerate(prompts)]


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--generated", type=int, default=128)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=8192, help="prefill tokens a step")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    arguments = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sampler = random.Random(0)
    prompts = [sampler.randint(32, 256) for _ in range(arguments.requests)]
    kept, seconds = [], []
    # The first repeat warms the staging buffer up; with --profile, one more runs profiled
    # (the profiler's start costs seconds: it is not timed).
    for repeat in range(arguments.repeats + 1 + arguments.profile):
        store, requests = filled_store(prompts, arguments.generated, arguments.width,
                                       arguments.budget, device)
        synchronize()
        if repeat > arguments.repeats:
            with torch.profiler.profile() as profiler:
                kept.append(store.collect(requests))
                synchronize()
            print(profiler.key_averages().table(sort_by="count", row_limit=15))
            continue
        start = time.perf_counter()
        kept.append(store.collect(requests))
        synchronize()
        if repeat:
            seconds.append(time.perf_counter() - start)
    saved = sum(rows.numel() * rows.element_size() for found in kept[-1].values()
                for rows in found.values())
    assert all(found[LOCATION[0]].shape[1] == length + arguments.generated - 1
               for found, length in zip(kept[-1].values(), prompts, strict=True))
    print(f"{arguments.requests} requests, {saved / 1e6:.0f} MB saved at one graph tap on the "
          f"{device}: SaveStore.collect median {statistics.median(seconds) * 1e3:.1f} ms "
          f"(min {min(seconds) * 1e3:.1f}, max {max(seconds) * 1e3:.1f}) of {arguments.repeats}")


if __name__ == "__main__":
    main()
