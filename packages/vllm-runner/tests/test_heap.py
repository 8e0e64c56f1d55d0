"""The worker's heap trims (`engine.heap`): glibc's `malloc_trim` found and run, at most every
`every_s` seconds (a collection too soon sets one for later), and giving back what a process
freed."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import psutil
from vllm_runner.engine.heap import HeapTrim, glibc_trim


def test_trims_come_at_most_every_interval_and_a_collection_too_soon_sets_one() -> None:
    now = [100.0]
    trims: list[float] = []
    timers: list[tuple[float, Callable[[], object]]] = []
    heap = HeapTrim(lambda: trims.append(now[0]), every_s=30.0, clock=lambda: now[0],
                    later=lambda delay, call: timers.append((delay, call)))
    assert not heap.after_collection() and trims == []
    now[0] += 29.0
    assert not heap.after_collection()
    assert [delay for delay, _ in timers] == [30.0]  # one timer, however many collections
    now[0] += 1.0
    assert heap.after_collection() and trims == [130.0]
    # The timer set at the start fires now: a trim, and the interval counts from it.
    timers[0][1]()
    assert trims == [130.0, 130.0]
    now[0] += 10.0
    assert not heap.after_collection() and trims == [130.0, 130.0]
    assert [delay for delay, _ in timers] == [30.0, 20.0]
    # Nothing more comes (the engine idle): the last collection's trim still comes.
    now[0] += 20.0
    timers[1][1]()
    assert trims == [130.0, 130.0, 160.0]
    assert not HeapTrim(None, every_s=0.0).after_collection()  # no glibc: nothing to do


def test_a_deferred_trim_runs_on_its_own_thread() -> None:
    done = threading.Event()
    heap = HeapTrim(done.set, every_s=0.2)
    assert not heap.after_collection()
    assert done.wait(5.0)


def test_glibcs_trim_gives_back_what_was_freed() -> None:
    trim = glibc_trim()
    assert trim is not None  # this machine's Python runs on glibc
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    process = psutil.Process()
    # Many small blocks (below mmap's threshold: from the heap), touched, then all but the
    # last freed: glibc keeps the freed heap pages until a trim.
    blocks = [libc.malloc(4096) for _ in range(40_000)]
    for block in blocks:
        ctypes.memset(block, 1, 4096)
    for block in blocks[:-1]:
        libc.free(block)
    before = process.memory_info().rss
    trim()
    assert before - process.memory_info().rss > 100 * 2**20  # of the ~160 MiB freed
    libc.free(blocks[-1])
