"""How fast saves cross from a GPU into host tensors of their own, by the number of threads that
write them (`vllm_runner.saves.host_copies.LANDING_THREADS`).

Run with `python benchmarks/host_copy_bench.py` on a machine with a GPU (the stack's environment):
for each thread count, `--requests` device tensors of `--rows` x `--width` bf16 (by default one
Llama-1B layer's `layer_output` for a 272-token request: 1.1 MB) go through `host_copies.ToHost`
as the save store's collection sends them, `--repeats` times. *Kept*: each repeat's results stay
alive, so every copy lands in fresh pages (a user keeping every output); *freed*: each repeat's
results are dropped first, so the allocator may hand the same pages back. Prints the best time of
each and the rate, then where one kept collection's time goes (cProfile) at one thread and at the
most; with no GPU the copies stay on the host and nothing is measured.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import torch
from vllm_runner.saves import host_copies


def collect_once(saves: list[torch.Tensor], staging: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """`saves` moved to the host as the store's collection moves a generate's saves."""
    found = [{"layer": rows} for rows in saves]
    mover = host_copies.ToHost(lambda: staging)
    for saved in found:
        mover.add_all(saved)
    mover.flush()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rows", type=int, default=272)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", default="1,2,4,8")
    arguments = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no GPU: saves already on the host are not copied")
    saves = [torch.randn(1, arguments.rows, arguments.width, device="cuda",
                         dtype=torch.bfloat16) for _ in range(arguments.requests)]
    total = sum(rows.numel() * rows.element_size() for rows in saves)
    staging = host_copies.staging_buffer()
    huge_pages = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"{arguments.requests} saves of {total / arguments.requests / 1e6:.2f} MB "
          f"({total / 1e6:.0f} MB); host has {host_copies.LANDING_THREADS} landing threads by "
          f"default; transparent huge pages: "
          f"{huge_pages.read_text().strip() if huge_pages.exists() else 'unknown'}")
    counts = list(map(int, arguments.threads.split(",")))
    for threads in counts:
        host_copies.LANDING_THREADS = threads
        host_copies.LANDING_POOLS.forget()
        for mode in ("kept", "freed"):
            kept: list[object] = []
            best = float("inf")
            for _ in range(arguments.repeats):
                torch.cuda.synchronize()
                start = time.perf_counter()
                found = collect_once(saves, staging)
                best = min(best, time.perf_counter() - start)
                if mode == "kept":
                    kept.append(found)
                del found
            checked = collect_once(saves, staging)
            assert all(torch.equal(found["layer"], rows.cpu())
                       for found, rows in zip(checked, saves, strict=True))
            print(f"threads {threads}, {mode:5}: best {best * 1e3:6.1f} ms, "
                  f"{total / best / 1e9:5.1f} GB/s", flush=True)
    profiled: list[object] = []
    for threads in (min(counts), max(counts)):
        host_copies.LANDING_THREADS = threads
        host_copies.LANDING_POOLS.forget()
        profiler = cProfile.Profile()
        profiler.enable()
        profiled.append(collect_once(saves, staging))
        profiler.disable()
        print(f"\none kept collection, {threads} threads:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
