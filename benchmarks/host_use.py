"""What a process spends of its host during a timed run: CPU time of the thread that ran it and
of the whole process, context switches, threads and peak memory.

Made for telling apart why one engine's process runs the same host work slower than another's
(issue [K]: our engine's steps without programs ran 4-6% under vLLM's default engine on H100s
with as many kernels, the same device time and the same torch calls): CPU time of threads
other than the one timed would show a background thread taking the interpreter from the
engine's loop, involuntary switches the OS taking its core away, and neither a slower core or
memory.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

MIB = 1 << 20


@dataclass(frozen=True)
class HostUse:
    """One run's use of the host by the process that ran it (seconds, counts, MiB)."""

    wall: float
    thread_cpu: float  # the thread that ran the work (the engine's loop, in process)
    process_cpu: float  # every thread of the process, user and system
    voluntary_switches: int  # the process waited (I/O, locks, the device)
    involuntary_switches: int  # the OS took a core away from it
    threads: int  # at the end of the run
    max_rss_mib: float  # the process's peak resident memory so far

    @property
    def other_threads_cpu(self) -> float:
        """CPU time of the process's other threads during the run."""
        return self.process_cpu - self.thread_cpu


class HostUseMeter:
    """Started before a run, read after it (`stop`), in the thread that runs it."""

    def __init__(self) -> None:
        self._wall = time.perf_counter()
        self._thread = time.thread_time()
        self._usage = resource.getrusage(resource.RUSAGE_SELF)

    def stop(self) -> HostUse:
        """The use since the meter was made."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        before = self._usage
        return HostUse(
            wall=time.perf_counter() - self._wall,
            thread_cpu=time.thread_time() - self._thread,
            process_cpu=(usage.ru_utime + usage.ru_stime) - (before.ru_utime + before.ru_stime),
            voluntary_switches=usage.ru_nvcsw - before.ru_nvcsw,
            involuntary_switches=usage.ru_nivcsw - before.ru_nivcsw,
            threads=_thread_count(),
            max_rss_mib=usage.ru_maxrss * 1024 / MIB)  # ru_maxrss is in KiB on Linux


def _thread_count() -> int:
    """The process's threads, native ones included where /proc says (Linux), else Python's."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def median_row(uses: Sequence[HostUse]) -> str:
    """The medians of `uses` as the cells of `TABLE_HEADER`'s columns after the first two."""
    return (f"{median([use.wall for use in uses]):.3f} | "
            f"{median([use.thread_cpu for use in uses]):.3f} | "
            f"{median([use.other_threads_cpu for use in uses]):.3f} | "
            f"{median([use.involuntary_switches for use in uses]):.0f} | "
            f"{median([use.voluntary_switches for use in uses]):.0f} | "
            f"{median([use.threads for use in uses]):.0f} | "
            f"{max(use.max_rss_mib for use in uses):.0f}")


TABLE_HEADER = ("| arm | engine | wall s | timed thread CPU s | other threads CPU s | "
                "involuntary switches | voluntary switches | threads | peak RSS MiB |\n"
                "|---|---|---|---|---|---|---|---|---|")
