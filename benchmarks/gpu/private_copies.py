"""Host time of a plain `Call`'s private copies on CUDA: 64 one-row pieces of a SmolLM2-wide
bfloat16 value (as at a decode step of 64 requests), copied four ways, and the kernels the two
multi-tensor ways launch (torch's profiler). `row_serving.private_copies` uses the fastest;
`user-edit` is what the benchmarks' own function (`value * 1.0`) costs for the same pieces.

    benchmarks/gpu/check.sh python3 benchmarks/gpu/private_copies.py

Its H100 result (the user's function and the fastest copies, per 64 pieces) is in
docs/cuda-graphs-design.md, "What it costs now".
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

REQUESTS, WIDTH = 64, 576
WARM, TIMED = 200, 2000


def main() -> None:
    pieces = list(torch.randn(REQUESTS, WIDTH, device="cuda", dtype=torch.bfloat16).split(1))

    def empty_then_foreach_copy() -> object:
        copies = [torch.empty_like(piece) for piece in pieces]
        torch._foreach_copy_(copies, pieces)
        return copies

    ways: dict[str, Callable[[], object]] = {
        "empty_like each + _foreach_copy_": empty_then_foreach_copy,
        "_foreach_clone": lambda: torch._foreach_clone(pieces),
        "clone each": lambda: [piece.clone() for piece in pieces],
        "user-edit (value * 1.0 each)": lambda: [piece * 1.0 for piece in pieces],
    }
    for _ in range(2):  # the second round is the one to read
        for name, way in ways.items():
            for _ in range(WARM):
                way()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(TIMED):
                way()
            host = (time.perf_counter() - start) / TIMED * 1e6
            torch.cuda.synchronize()
            print(f"{name}: {host:.1f} us of host time for {REQUESTS} pieces")
    for name in ("empty_like each + _foreach_copy_", "_foreach_clone"):
        with profile(activities=[ProfilerActivity.CUDA]) as recorded:
            ways[name]()
            torch.cuda.synchronize()
        kernels = [event.name for event in recorded.events() if event.device_type.name == "CUDA"]
        print(f"{name}: {len(kernels)} kernel(s): {kernels[0][:100] if kernels else ''}")


if __name__ == "__main__":
    main()
