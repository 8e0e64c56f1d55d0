"""Where a function's wall time goes, thread by thread, from a torch profiler trace.

cProfile said that vLLM's `run_fullgraph` (one CUDA-graph replay) took 1.4 ms a call in the
default engine and 1.6-2.1 ms in ours, where torch's profiler timed the `cudaGraphLaunch` inside
it at ~0.25 ms (H200, 2026-12-05): most of the call is neither the launch nor Python that
cProfile sees. A trace recorded with Python stacks (`with_stack=True`) holds every Python call
and CUDA runtime call as an interval on its thread; this module nests them, and for each call of
a *focus* function reports what its direct children took and what is left unaccounted (time the
thread spent outside any recorded call: waiting for the GIL, or in C code nothing records), and
what the other threads were running meanwhile (a thread holding the GIL makes the focus thread
wait when it returns from C code that released it).

    summary = summarize(trace_events, focus=("run_fullgraph",))

`trace_events` are the chrome trace's `traceEvents` (torch's `export_chrome_trace`).
"""

from __future__ import annotations

import bisect
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # an object's address in a C function's name


@dataclass
class Interval:
    """One complete event of the trace: `name` on thread `tid`, from `start` for `duration` µs;
    its direct children once nested (`nest`)."""

    name: str
    tid: str
    start: float
    duration: float
    children: list[Interval] = field(default_factory=list)
    top: bool = True  # no parent on its thread

    @property
    def end(self) -> float:
        """Where it ends, in µs."""
        return self.start + self.duration


def intervals(trace_events: Iterable[dict[str, Any]]) -> list[Interval]:
    """The trace's complete (`"ph": "X"`) host events; device kernels (on streams, not host
    threads) are left out."""
    found = []
    for event in trace_events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation",
                                "Trace"):  # "Trace": the profiler's own span
            continue
        found.append(Interval(str(event.get("name", "")), str(event.get("tid", "")),
                              float(event["ts"]), float(event["dur"])))
    return found


def nest(events: Sequence[Interval]) -> dict[str, list[Interval]]:
    """Each thread's events, each given its direct children (the events of its thread inside
    it); per thread the events in order of start."""
    by_thread: dict[str, list[Interval]] = defaultdict(list)
    for event in events:
        by_thread[event.tid].append(event)
    for thread in by_thread.values():
        thread.sort(key=lambda event: (event.start, -event.duration))
        open_events: list[Interval] = []
        for event in thread:
            while open_events and open_events[-1].end <= event.start:
                open_events.pop()
            if open_events and event.end <= open_events[-1].end + 0.01:
                open_events[-1].children.append(event)
                event.top = False
            open_events.append(event)
    return dict(by_thread)


def _short(name: str) -> str:
    """A Python event's function and file (`path/file.py(12): function` → `function
    (file.py:12)`); other names as they are."""
    if "): " in name and "(" in name:
        place, function = name.split("): ", 1)
        path, line = place.rsplit("(", 1)
        return f"{function} ({path.rsplit('/', 1)[-1]}:{line})"
    return _ADDRESS.sub("", name)


def _outermost(calls: list[Interval]) -> list[Interval]:
    """`calls` less those inside another of them on their thread (an override calling the
    method it overrides, of the same name)."""
    kept: list[Interval] = []
    for call in sorted(calls, key=lambda call: (call.tid, call.start, -call.duration)):
        if kept and kept[-1].tid == call.tid and call.end <= kept[-1].end + 0.01:
            continue
        kept.append(call)
    return kept


def _own_time(event: Interval) -> list[tuple[float, float]]:
    """The stretches of `event` none of its children covers (its own time)."""
    stretches = []
    at = event.start
    for child in sorted(event.children, key=lambda child: child.start):
        if child.start > at:
            stretches.append((at, child.start))
        at = max(at, child.end)
    if event.end > at:
        stretches.append((at, event.end))
    return stretches


def _overlap_with(windows: list[tuple[float, float]], start: float, end: float) -> float:
    """How much of `start:end` lies inside `windows` (sorted, disjoint)."""
    spent = 0.0
    index = max(0, bisect.bisect_right(windows, (start, float("inf"))) - 1)
    while index < len(windows) and windows[index][0] < end:
        first, last = windows[index]
        spent += max(0.0, min(last, end) - max(first, start))
        index += 1
    return spent


def _tree(calls: list[Interval], total: float, depth: int, shown_share: float,
          indent: str = "  ") -> list[str]:
    """`calls`' children merged by name, largest first, each with its own children below it
    down to `depth` levels, those under `shown_share` of `total` left out; at each level the
    time no child accounts for (the thread outside any recorded call: for a C function that
    released the GIL, waiting to take it back is in there)."""
    by_name: dict[str, list[Interval]] = defaultdict(list)
    for call in calls:
        for child in call.children:
            by_name[_short(child.name)].append(child)
    spent_by_name = {name: sum(child.duration for child in children)
                     for name, children in by_name.items()}
    lines = []
    for name, spent in sorted(spent_by_name.items(), key=lambda item: -item[1]):
        if spent < shown_share * total:
            break
        count = len(by_name[name])
        lines.append(f"{indent}{spent / 1e3:9.1f} ms {spent / total:6.1%}  {name} ({count}x)")
        if depth > 1:
            lines += _tree(by_name[name], total, depth - 1, shown_share, indent + "    ")
    own = sum(call.duration for call in calls) - sum(spent_by_name.values())
    if own >= shown_share * total and by_name:
        lines.append(f"{indent}{own / 1e3:9.1f} ms {own / total:6.1%}  (no child)")
    return lines


def summarize(trace_events: Iterable[dict[str, Any]], focus: Sequence[str], depth: int = 4,
              shown_share: float = 0.02, others_shown: int = 6) -> str:
    """For each name of `focus` (a substring of an event's name): how many calls, their median
    and total µs, what they spent it in (`_tree`: children by name, `depth` levels deep, those
    of at least `shown_share` of the total), the time no child accounts for, and the
    other threads' events by how much of their own time (not their children's) fell inside the
    calls. Then each thread's top-level time: which thread was busy, and with what."""
    events = intervals(trace_events)
    threads = nest(events)
    lines: list[str] = []
    for wanted in focus:
        calls = _outermost([event for event in events if wanted in event.name])
        if not calls:
            lines.append(f"{wanted}: no call in the trace\n")
            continue
        durations = [call.duration for call in calls]
        total = sum(durations)
        lines.append(f"{_short(calls[0].name)}: {len(calls)} calls, median "
                     f"{statistics.median(durations):.0f} µs, total {total / 1e3:.1f} ms")
        lines += _tree(calls, total, depth, shown_share)
        focus_tid = calls[0].tid
        windows = sorted((call.start, call.end) for call in calls)
        for tid, thread in sorted(threads.items()):
            if tid == focus_tid:
                continue
            overlapping: dict[str, float] = defaultdict(float)
            for event in thread:
                for start, end in _own_time(event):
                    if spent := _overlap_with(windows, start, end):
                        overlapping[_short(event.name)] += spent
            busy = sum(overlapping.values())
            if busy <= 0:
                continue
            lines.append(f"  thread {tid}: {busy / 1e3:.1f} ms of its own time during these "
                         "calls, in:")
            for name, spent in sorted(overlapping.items(),
                                      key=lambda item: -item[1])[:others_shown]:
                lines.append(f"    {spent / 1e3:9.1f} ms  {name}")
        lines.append("")
    lines.append("threads (top-level events):")
    for tid, thread in sorted(threads.items()):
        tops: dict[str, float] = defaultdict(float)
        for event in thread:
            if event.top:
                tops[_short(event.name)] += event.duration
        busy = sum(tops.values())
        lines.append(f"  thread {tid}: {busy / 1e3:.1f} ms in {len(thread)} events")
        for name, spent in sorted(tops.items(), key=lambda item: -item[1])[:others_shown]:
            lines.append(f"    {spent / 1e3:9.1f} ms  {name}")
    return "\n".join(lines) + "\n"
