"""Freed heap memory given back to the system now and then (glibc's `malloc_trim`).

A worker makes and frees tensors of every size, request after request (saves, steering vectors,
the steps' own buffers), and glibc keeps what is freed in its arenas rather than returning it:
a long-running engine's resident memory climbs though nothing is alive. A soak of 10,000
requests against `vllm-interp serve` on a CPU saw the engine's grow 0.17 MiB a request, without
a Python object more at the end; in one process, 1,800 requests with programs took it from
2,941 to 3,107 MiB, and `malloc_trim(0)` then to 2,691 (a plain vLLM load grew too, a little
less). So the worker trims after a collection, at most every `TRIM_EVERY_S` seconds: a trim of
a few hundred MiB takes milliseconds. Where the C library is not glibc, nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

#: The least time between two trims.
TRIM_EVERY_S = 30.0


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


class HeapTrim:
    """Trims the heap when asked (`after_collection`), at most every `every_s` seconds."""

    def __init__(self, trim: Callable[[], object] | None = None, every_s: float = TRIM_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._trim, self._every_s, self._clock = trim, every_s, clock
        self._last = clock()

    def after_collection(self) -> bool:
        """Trim if the last trim is `every_s` old; whether it did."""
        if self._trim is None or self._clock() - self._last < self._every_s:
            return False
        self._trim()
        self._last = self._clock()
        return True


#: This process's (one worker a process).
HEAP = HeapTrim(glibc_trim())
