"""Freed heap memory given back to the system now and then (glibc's `malloc_trim`).

A worker makes and frees tensors of every size, request after request (saves, steering vectors,
the steps' own buffers), and glibc keeps what is freed in its arenas rather than returning it:
a long-running engine's resident memory climbs though nothing is alive. A soak of 10,000
requests against `vllm-interp serve` on a CPU saw the engine's grow 0.17 MiB a request, without
a Python object more at the end; in one process, 1,800 requests with programs took it from
2,941 to 3,107 MiB, and `malloc_trim(0)` then to 2,691 (a plain vLLM load grew too, a little
less). So the worker trims after a collection, at most every `TRIM_EVERY_S` seconds: a trim
that gives back 300 MiB takes ~20 ms, and what piles up between trims is what the engine's
memory swings by (30 s let a 1,000-request soak swing ~300 MiB). A collection that comes
sooner sets a trim for when the interval is up, on a timer thread: the last collections before
the engine goes idle would otherwise keep what they freed until the next load (a soak's memory
jumped 234 MiB at its end).
Where the C library is not glibc, nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable

#: The least time between two trims.
TRIM_EVERY_S = 10.0


def glibc_trim() -> Callable[[], object] | None:
    """`malloc_trim(0)` of this process's C library, or `None` where it has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


def _daemon_timer(delay_s: float, call: Callable[[], object]) -> None:
    """`call` after `delay_s` seconds on a daemon thread (one that never holds up an exit)."""
    timer = threading.Timer(delay_s, call)
    timer.daemon = True
    timer.start()


class HeapTrim:
    """Trims the heap after a collection (`after_collection`), at most every `every_s` seconds;
    one that comes too soon is done when the interval is up, by `later` (a timer thread)."""

    def __init__(self, trim: Callable[[], object] | None = None, every_s: float = TRIM_EVERY_S,
                 clock: Callable[[], float] = time.monotonic,
                 later: Callable[[float, Callable[[], object]], object] = _daemon_timer) -> None:
        self._trim, self._every_s, self._clock, self._later = trim, every_s, clock, later
        self._last = clock()
        self._set = False  # a deferred trim is waiting
        self._lock = threading.Lock()

    def after_collection(self) -> bool:
        """Trim now if the last trim is `every_s` old, else set one for then; whether it did."""
        if self._trim is None:
            return False
        with self._lock:
            wait_s = self._every_s - (self._clock() - self._last)
            if wait_s <= 0:
                self._trim_now()
                return True
            if not self._set:
                self._set = True
                self._later(wait_s, self._deferred)
            return False

    def _deferred(self) -> None:
        with self._lock:
            self._set = False
            self._trim_now()

    def _trim_now(self) -> None:
        assert self._trim is not None
        self._trim()
        self._last = self._clock()


#: This process's (one worker a process).
HEAP = HeapTrim(glibc_trim())
