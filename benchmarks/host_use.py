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
    #: The other threads that ran longest during the run: (name, seconds on a core), longest
    #: first (Linux's per-thread scheduler statistics; empty elsewhere).
    busiest_others: tuple[tuple[str, float], ...] = ()

    @property
    def other_threads_cpu(self) -> float:
        """CPU time of the process's other threads during the run."""
        return self.process_cpu - self.thread_cpu


class HostUseMeter:
    """Started before a run, read after it (`stop`), in the thread that runs it."""

    def __init__(self) -> None:
        # The threads' snapshot first: reading /proc for each of an engine's ~100 threads takes
        # milliseconds, which must not count as the run's.
        self._tid = threading.get_native_id()
        self._per_thread = _time_on_core_per_thread()
        self._wall = time.perf_counter()
        self._thread = time.thread_time()
        self._usage = resource.getrusage(resource.RUSAGE_SELF)

    def stop(self) -> HostUse:
        """The use since the meter was made."""
        wall = time.perf_counter() - self._wall
        thread_cpu = time.thread_time() - self._thread
        usage = resource.getrusage(resource.RUSAGE_SELF)
        before = self._usage
        now = _time_on_core_per_thread()
        return HostUse(
            wall=wall,
            thread_cpu=thread_cpu,
            process_cpu=(usage.ru_utime + usage.ru_stime) - (before.ru_utime + before.ru_stime),
            voluntary_switches=usage.ru_nvcsw - before.ru_nvcsw,
            involuntary_switches=usage.ru_nivcsw - before.ru_nivcsw,
            # Native threads included where /proc lists them (Linux), else Python's.
            threads=len(now) or threading.active_count(),
            max_rss_mib=usage.ru_maxrss * 1024 / MIB,  # ru_maxrss is in KiB on Linux
            busiest_others=self._busiest_others(now))

    def _busiest_others(self, now: dict[int, tuple[str, float]], count: int = 3
                        ) -> tuple[tuple[str, float], ...]:
        """The `count` threads other than the timed one that ran longest since the start."""
        ran = [(name, seconds - self._per_thread.get(tid, (name, 0.0))[1])
               for tid, (name, seconds) in now.items() if tid != self._tid]
        ran.sort(key=lambda named: named[1], reverse=True)
        return tuple(named for named in ran[:count] if named[1] > 0)


def _time_on_core_per_thread() -> dict[int, tuple[str, float]]:
    """Each thread of this process: its name (Python's where Python started it, else the
    kernel's) and the seconds it has run on a core (`/proc/self/task/<tid>/schedstat`,
    nanoseconds, where the CPU times of `stat` count in 10 ms ticks). Empty where /proc has no
    such files; a thread that ended is not in it."""
    python_names = {thread.native_id: thread.name for thread in threading.enumerate()}
    threads: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return threads
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm, \
                    open(f"/proc/self/task/{tid}/schedstat") as schedstat:
                name = python_names.get(int(tid)) or comm.read().strip()
                threads[int(tid)] = (name, int(schedstat.read().split()[0]) / 1e9)
        except (OSError, ValueError, IndexError):
            continue  # the thread ended, or the kernel keeps no statistics
    return threads


def median_row(uses: Sequence[HostUse]) -> str:
    """The medians of `uses` as the cells of `TABLE_HEADER`'s columns after the first two."""
    return (f"{median([use.wall for use in uses]):.3f} | "
            f"{median([use.thread_cpu for use in uses]):.3f} | "
            f"{median([use.other_threads_cpu for use in uses]):.3f} | "
            f"{median([use.involuntary_switches for use in uses]):.0f} | "
            f"{median([use.voluntary_switches for use in uses]):.0f} | "
            f"{median([use.threads for use in uses]):.0f} | "
            f"{max(use.max_rss_mib for use in uses):.0f} | "
            f"{_busiest_of_median(uses)}")


def _busiest_of_median(uses: Sequence[HostUse]) -> str:
    """The busiest other threads of the run whose other threads' CPU is the median's (a
    median of names means nothing), as `name ms, ...`."""
    ordered = sorted(uses, key=lambda use: use.other_threads_cpu)
    middle = ordered[(len(ordered) - 1) // 2]
    return ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in middle.busiest_others
                     ) or "—"


TABLE_HEADER = ("| arm | engine | wall s | timed thread CPU s | other threads CPU s | "
                "involuntary switches | voluntary switches | threads | peak RSS MiB | "
                "busiest other threads (a middle run) |\n"
                "|---|---|---|---|---|---|---|---|---|---|")
