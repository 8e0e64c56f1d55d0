"""Where a benchmark's time goes: one workload under cProfile (with the garbage collector's
time), under torch's profiler (kernels, host ops, the device's busy share), or under torch's
profiler with Python stacks, summarized thread by thread (`timeline`). Shared by the
benchmarks that profile their arms (`compiled_bench.py --profile`, `vllm_runner_bench.py
--profile`, `step_host_work.py --profile`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator


def python_profile(workload: Callable[[], object]) -> str:
    """Where the host's time goes while `workload` runs (cProfile; our hooks and vLLM's runner
    both run in this process): the functions with the most time of their own, then the most
    time under them, then our packages' functions by the time under them. With a GPU, waits
    for the device show as the calls that wait. The garbage collector's time comes first:
    cProfile counts it as the own time of whichever function was running when a collection
    began."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    with collector_time() as collections:
        profiler.runcall(workload)
    report = io.StringIO()
    report.write(f"garbage collector: {collections['seconds']:.3f} s in "
                 f"{collections['count']} collections ({collections['oldest']} of the oldest "
                 "generation)\n")
    stats = pstats.Stats(profiler, stream=report)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    # Our own functions apart: in vLLM's listings above they fall below the cut.
    stats.sort_stats("cumulative").print_stats("vllm_runner|vllm_envoys|tokenspan", 40)
    return report.getvalue()


@contextlib.contextmanager
def collector_time() -> Iterator[dict[str, float]]:
    """How long Python's garbage collector ran inside the block, and how often."""
    import gc

    spent = {"seconds": 0.0, "count": 0, "oldest": 0}
    began = [0.0]

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
            return
        spent["seconds"] += time.perf_counter() - began[0]
        spent["count"] += 1
        spent["oldest"] += info["generation"] == 2

    gc.callbacks.append(note)
    try:
        yield spent
    finally:
        gc.callbacks.remove(note)


def device_profile(workload: Callable[[], object]) -> str:
    """What the device ran while `workload` ran (torch's profiler): kernels by device time, and
    host-side torch calls by their own time; the device's busy share of the wall time says
    whether the host or the device is the limit."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    start = time.perf_counter()
    with profile(activities=activities) as recorded:
        workload()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    averages = recorded.key_averages()
    device_us = sum(event.self_device_time_total for event in averages)
    return (f"wall {wall:.2f} s under the profiler; device busy {device_us / 1e6:.2f} s "
            f"({device_us / 1e6 / wall:.0%} of wall)\n\n"
            + averages.table(sort_by="self_device_time_total", row_limit=25,
                             max_name_column_width=70)
            + "\n" + averages.table(sort_by="self_cpu_time_total", row_limit=30,
                                     max_name_column_width=70))


#: What `timeline_profile` looks into: the CUDA-graph replay and the step around it.
TIMELINE_FOCUS = ("run_fullgraph", "execute_model", "sample_tokens")


def timeline_profile(workload: Callable[[], object]) -> str:
    """Where each call of `TIMELINE_FOCUS` spends its wall time, thread by thread (torch's
    profiler with Python stacks, summarized by `timeline.summarize`): for time cProfile bills
    to a call that neither its children nor its CUDA calls account for."""
    import json
    import os
    import tempfile

    import torch
    from timeline import summarize
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, with_stack=True) as recorded:
        workload()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    descriptor, path = tempfile.mkstemp(suffix=".json")
    os.close(descriptor)
    try:
        recorded.export_chrome_trace(path)
        with open(path) as trace:
            events = json.load(trace)["traceEvents"]
    finally:
        os.unlink(path)
    return summarize(events, TIMELINE_FOCUS)


PROFILERS: dict[str, Callable[[Callable[[], object]], str]] = {
    "python": python_profile, "device": device_profile, "timeline": timeline_profile}
