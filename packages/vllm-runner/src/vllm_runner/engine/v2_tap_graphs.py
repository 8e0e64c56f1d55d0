"""V2's full CUDA graphs captured a second time, broken at the taps (`compiled.breaks`), and
replayed for the steps whose programs need a tap's Python.

V2's `ModelCudaGraphManager` captures every full graph in `CudaGraphManager.capture` from a
factory of capture forwards, and replays one in `run_fullgraph`. `TapBrokenGraphs` sits between
the two classes (`break_at_taps` gives one manager the class with it), so it receives the same
factory: after V2's own capture it captures each full-graph descriptor again, into the same
memory pool, through the same forward (which copies the output into the manager's persistent
hidden states, where `run_fullgraph` reads it), and `run_fullgraph` replays that capture on the
steps the adapter marks (`tap_breaks_for`). Every other step replays V2's own graph, untouched.

Read in vLLM 0.33 (`vllm/v1/worker/gpu/cudagraph_utils.py`); 0.32's CPU wheel has the same
names but runs no V2 there.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from functools import cache
from typing import Any

import torch
from tqdm import tqdm
from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
from vllm.compilation.cudagraph_pool import capture_pool
from vllm.config import CUDAGraphMode
from vllm.distributed.parallel_state import graph_capture, is_global_first_rank
from vllm.model_executor.offloader.base import get_offloader
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

from vllm_runner.compiled import breaks
from vllm_runner.compiled.joins import JoinedGraph
from vllm_runner.compiled.replays import GraphPart, Part, TapPart, TapReplays
from vllm_runner.compiled.taps import parse_key

logger = logging.getLogger("vllm.interp")


class TapBrokenCapture(BreakableCUDAGraphCapture):
    """vLLM's breakable capture, found by the taps alone: it registers itself as this thread's
    active capture in `compiled.breaks.captures`, not where vLLM's breaks (attention's) look
    (`BreakableCUDAGraphCapture.current()`), so they run inside the graph. It keeps each
    segment's graph template (`keep_graph=True`) and which locations each tap serves, so that
    a step replays it stopping only at the taps it needs (`replay_for`, `compiled.replays`)."""

    def __init__(self, pool: Any | None = None) -> None:
        super().__init__(pool=pool)
        self.parts: list[Part] = []
        self._replays: TapReplays | None = None

    @classmethod
    def current(cls) -> Any:
        return getattr(breaks.captures, "active", None)

    def _begin_segment(self) -> None:
        """vLLM's own, with the segment's template kept (joined into others later)."""
        assert not self._capturing
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        if self.pool is not None:
            graph.capture_begin(pool=self.pool)
        else:
            graph.capture_begin()
        self._current_graph = graph
        self._capturing = True

    def _end_segment(self) -> None:
        """vLLM's own, the segment instantiated now (as a graph that keeps no template is at
        the end of its capture: no first replay pays for it) and kept as a part."""
        graph = self._current_graph if self._capturing else None
        super()._end_segment()
        if graph is not None:
            graph.instantiate()
            self.parts.append(GraphPart(graph))

    def add_tap(self, run: Callable[[], None], key: str) -> None:
        """A tap met during the capture (`compiled.breaks.break_at_tap`): a break, as vLLM's
        `add_eager` makes, kept as a part that names the locations it serves."""
        self.add_eager(run)
        self.parts.append(TapPart(run, parse_key(key)[0]))

    def replay_for(self, waited_at: Iterable[str]) -> bool:
        """Replay the capture stopping only at the taps that serve a location in `waited_at`
        (the segments between joined into one launch); whether some segments ran joined."""
        if self._replays is None:
            self._replays = TapReplays(self.parts, JoinedGraph)
        return self._replays.replay(waited_at)

    def __enter__(self) -> TapBrokenCapture:
        if self.current() is not None:
            raise RuntimeError("a capture broken at the taps is already running on this thread")
        breaks.captures.active = self
        self._begin_segment()
        return self

    def __exit__(self, *exception: object) -> None:
        try:
            self._end_segment()
        finally:
            breaks.captures.active = None


def capture_broken(forward: Callable[[], Any], pool: Any) -> TapBrokenCapture:
    """`forward` (V2's capture forward for one batch descriptor) captured into `pool`, broken at
    the taps only; a step replays it with `.replay_for(locations it waits at)`."""
    torch.cuda.synchronize()  # as `torch.cuda.graph` does before it captures
    with TapBrokenCapture(pool=pool) as capture:
        forward()
    return capture


class TapBrokenGraphs(CudaGraphManager):
    """A V2 graph manager that also keeps its full graphs broken at the taps."""

    interp_broken: dict[Any, Any]  # descriptor -> its capture broken at the taps
    interp_break_at_taps: bool  # this step replays the broken capture (`tap_breaks_for`)
    interp_replayed: Callable[[bool], None]  # told of each broken replay, joined or not
    interp_waited_at: Callable[[], Iterable[str]]  # where the step waits (`tap_breaks_for`)

    def capture(self, create_forward_fn: Any, *args: Any, **kwargs: Any) -> None:
        """V2's own capture, then every full-graph descriptor's again, broken at the taps. If
        that fails, the steps it was for run the piecewise graphs (logged): it is an addition
        to V2's graphs, which stand."""
        super().capture(create_forward_fn, *args, **kwargs)
        try:
            self._interp_capture_broken(create_forward_fn)
        except Exception:
            self.interp_broken.clear()
            logger.exception("vllm-runner: full graphs broken at the taps could not be "
                             "captured; steps with a tap's Python run the piecewise graphs")

    @torch.inference_mode()
    def _interp_capture_broken(self, create_forward_fn: Any) -> None:
        # V2's own list and sample (it profiles the first few full graphs and extrapolates),
        # so that the n-th descriptor's memory lands in V2's n-th sample; microbatched ones
        # (DBO) are left out: their steps keep the piecewise graphs.
        descriptors = list(self._capture_descs.get(CUDAGraphMode.FULL, []))
        if self._max_full_descs_to_capture is not None:
            descriptors = descriptors[: self._max_full_descs_to_capture]
        samples = self._capture_mem_samples
        started = time.perf_counter()
        with graph_capture(device=self.device):
            for index, descriptor in enumerate(tqdm(
                    descriptors, desc="Capturing CUDA graphs (FULL, broken at the taps)",
                    disable=not is_global_first_rank())):
                if getattr(descriptor, "num_ubatches", 1) != 1:
                    continue
                forward_fn = create_forward_fn(descriptor, warmup=False)

                def forward(run: Callable[[CUDAGraphMode], None] = forward_fn) -> None:
                    run(CUDAGraphMode.NONE)  # as V2 runs its own full graphs' capture
                    get_offloader().join_after_forward()

                get_offloader().sync_prev_onload()
                free_before = free_memory() if samples is not None else 0
                with capture_pool(self.pool, self.vllm_config) as pool:
                    self.interp_broken[descriptor] = capture_broken(forward, pool)
                if samples is not None and index < len(samples):
                    samples[index] += free_before - free_memory()
        logger.info("vllm-runner: %d full graphs captured again, broken at the taps, in %.1f s "
                    "(replayed where a step's programs need a tap's Python)",
                    len(self.interp_broken), time.perf_counter() - started)

    def run_fullgraph(self, desc: Any) -> Any:
        """Replay the full graph of `desc`: broken at the taps where the step asks for it."""
        broken = self.interp_broken.get(desc) if self.interp_break_at_taps else None
        if broken is None:
            return super().run_fullgraph(desc)
        get_offloader().sync_prev_onload()
        self.interp_replayed(broken.replay_for(self.interp_waited_at()))
        return None

    def release_graphs(self) -> None:
        """V2's own, and the broken captures with them (they hold the same stale pointers)."""
        super().release_graphs()
        self.interp_broken.clear()


def break_at_taps(manager: Any) -> None:
    """Give V2's graph manager `manager` (not yet captured) the broken captures: its class
    becomes one with `TapBrokenGraphs` between it and `CudaGraphManager`."""
    if isinstance(manager, TapBrokenGraphs):
        return
    manager_class: Any = type(manager)
    manager.__class__ = _with_breaks(manager_class)
    manager.interp_broken = {}
    manager.interp_break_at_taps = False
    manager.interp_replayed = _nobody
    manager.interp_waited_at = _nowhere


def _nobody(joined: bool) -> None:
    """Told of a broken replay outside `tap_breaks_for` (there is none: nothing marks one)."""


def _nowhere() -> tuple[str, ...]:
    """Where a step waits outside `tap_breaks_for` (there is no broken replay there)."""
    return ()


@cache
def _with_breaks(manager_class: type) -> type:
    if manager_class is CudaGraphManager:
        return TapBrokenGraphs
    return type(f"TapBroken{manager_class.__name__}", (manager_class, TapBrokenGraphs), {})


def has_broken(manager: Any, desc: Any) -> bool:
    """Whether `manager` replays `desc` broken at the taps when asked (`tap_breaks_for`)."""
    return isinstance(manager, TapBrokenGraphs) and desc in manager.interp_broken


@contextlib.contextmanager
def tap_breaks_for(manager: Any, replayed: Callable[[bool], None],
                   waited_at: Callable[[], Iterable[str]]
                   ) -> Iterator[Callable[[bool], None]]:
    """Within the block, `mark(True)` makes `manager`'s full-graph replays broken at the taps
    that serve a location in `waited_at()` (the runtime's `locations_waited_at`, asked as the
    graph is replayed, once the step is planned), and each such replay calls `replayed` with
    whether some of its segments ran joined (what counts them: a step
    marked can still run no full graph, where data-parallel ranks agree on none); after it,
    its replays are V2's own graphs again."""
    if not isinstance(manager, TapBrokenGraphs):  # nothing to break: marks change nothing
        yield lambda breaks: None
        return

    def mark(breaks: bool) -> None:
        manager.interp_break_at_taps = breaks

    manager.interp_replayed, manager.interp_waited_at = replayed, waited_at
    try:
        yield mark
    finally:
        manager.interp_break_at_taps = False
        manager.interp_replayed, manager.interp_waited_at = _nobody, _nowhere


def free_memory() -> int:
    """The device's free memory once its work is done (what V2's profiling samples measure)."""
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])
