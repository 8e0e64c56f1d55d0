"""Run a function on N real processes joined by a gloo process group, and collect what each returns.

Spawning costs seconds per process on the project's 2-core machines, so the tests spawn one
group per world size and run many checks inside it (see `rank_checks.py`), rather than one group
per check. A rank that raises takes the whole group down at once (the others are terminated
instead of waiting in a collective until gloo's timeout), and its traceback becomes the error.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

GLOO_TIMEOUT = timedelta(seconds=90)
# Generous: four processes on two cores, some importing vLLM, can take a while to start.
GROUP_TIMEOUT_S = 420


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _entry(rank: int, size: int, port: int, target: Callable[..., Any], args: tuple,
           results: Any, env: dict[str, str]) -> None:
    os.environ.update(env)
    try:
        import torch.distributed as dist

        if target.__dict__.get("needs_process_group", True):
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=size, timeout=GLOO_TIMEOUT)
        outcome = target(rank, size, port, *args)
        results.put((rank, "ok", outcome))
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(size: int, target: Callable[..., Any], *args: Any,
              env: dict[str, str] | None = None) -> list[Any]:
    """`target(rank, size, port, *args)` on `size` spawned processes; their results by rank.

    Unless `target.needs_process_group` is False, each process first joins a gloo process
    group (the default group), so `target` can build `Group.from_torch()`.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_entry, args=(rank, size, port, target, args, results, env or {}),
                        daemon=True)
        for rank in range(size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, Any] = {}
    try:
        while len(outcomes) < size:
            try:
                rank, status, outcome = results.get(timeout=GROUP_TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(
                    f"ranks {sorted(set(range(size)) - set(outcomes))} of {size} gave no result "
                    f"within {GROUP_TIMEOUT_S} s"
                ) from None
            if status == "error":
                raise AssertionError(f"rank {rank} of {size} failed:\n{outcome}")
            outcomes[rank] = outcome
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)
    return [outcomes[rank] for rank in range(size)]
