"""Full CUDA graphs broken at the taps (`tap_breaks`, `vllm_v2_tap_graphs`), without a GPU: the
tap op ends a capture's segment and is recorded for replay; V2's graph manager captures its
full graphs a second time, broken, through V2's own capture forwards, and replays them only on
the steps marked. On a GPU the compiled suite runs them for real (`test_compiled`: the decode
step of a request traced at taps counts one `tap_breaks` forward and its values equal the eager
engine's and transformers')."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import (
    BatchExecutionDescriptor,
    CudaGraphManager,
    ModelCudaGraphManager,
)
from vllm_runner import tap_breaks, taps, vllm_v2_tap_graphs
from vllm_runner.vllm_v2_tap_graphs import TapBrokenGraphs, break_at_taps, has_broken


class FakeCapture:
    """vLLM's breakable capture as the tap op sees it: `add_eager` runs the body now and keeps
    it for `replay` (which replays the graph segments around it too, here none)."""

    def __init__(self) -> None:
        self.recorded: list[Any] = []

    def add_eager(self, body):
        self.recorded.append(body)
        return body()

    def replay(self) -> None:
        for body in self.recorded:
            body()


class Server:
    """A runtime serving taps, recording what it was handed."""

    def __init__(self) -> None:
        self.served: list[tuple[str, Any]] = []

    def wants_tap(self, location: str) -> bool:
        return True

    def serve_tap(self, location: str, raw: Any) -> None:
        self.served.append((location, raw))


@pytest.fixture
def capturing(monkeypatch: pytest.MonkeyPatch):
    """A breakable capture active on this thread, its stream capturing; references to tensors
    kept as they are (vLLM's weak references need its CUDA extension)."""
    capture = FakeCapture()
    monkeypatch.setattr(BreakableCUDAGraphCapture._tls, "active", capture, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(tap_breaks, "weak_ref_tensor", lambda tensor: tensor)
    yield capture
    taps.serve_taps(None)


def test_a_tap_met_during_a_breakable_capture_ends_the_segment_and_runs_at_every_replay(
        capturing: FakeCapture) -> None:
    value = torch.arange(4.0)
    server = Server()
    torch.ops.vllm_interp.tap([value], "layers.0.layer_output|T")
    assert len(capturing.recorded) == 1 and server.served == []  # nobody served at capture
    taps.serve_taps(server)
    capturing.replay()
    capturing.replay()
    assert [location for location, _ in server.served] == ["layers.0.layer_output"] * 2
    assert all(raw is value for _, raw in server.served)  # the capture's own tensor, in place


def test_a_tap_outside_a_capture_is_served_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    server = Server()
    taps.serve_taps(server)
    try:
        torch.ops.vllm_interp.tap([torch.ones(2)], "layers.1.layer_output|T")
    finally:
        taps.serve_taps(None)
    assert [location for location, _ in server.served] == ["layers.1.layer_output"]
    assert tap_breaks.break_at_tap(lambda *_: None, [], "") is False


def descriptor(mode: CUDAGraphMode, tokens: int) -> BatchExecutionDescriptor:
    return BatchExecutionDescriptor(cg_mode=mode, num_tokens=tokens, num_reqs=tokens,
                                    uniform_token_count=1, max_query_len=1)


FULL_4, FULL_8 = descriptor(CUDAGraphMode.FULL, 4), descriptor(CUDAGraphMode.FULL, 8)
PIECES_8 = descriptor(CUDAGraphMode.PIECEWISE, 8)


class V2Graphs:
    """Just enough of V2's `ModelCudaGraphManager` state to capture and replay without a GPU:
    its base's capture records what it captured, its graphs record their replays."""

    def __init__(self, samples: list[int] | None = None) -> None:
        self._capture_descs = {CUDAGraphMode.PIECEWISE: [PIECES_8],
                               CUDAGraphMode.FULL: [FULL_8, FULL_4]}
        self._max_full_descs_to_capture = None
        self._capture_mem_samples = samples
        self.device = torch.device("cpu")
        self.pool, self.vllm_config = "pool", SimpleNamespace()
        self.replayed: list[Any] = []
        self.graphs = {FULL_8: SimpleNamespace(replay=lambda: self.replayed.append("v2 8")),
                       FULL_4: SimpleNamespace(replay=lambda: self.replayed.append("v2 4"))}
        self.is_last_pp_rank, self.use_aux_hidden_state_outputs = True, False
        self.hidden_states = torch.arange(8.0)
        self.breakable_cg_runner = None


def made(monkeypatch: pytest.MonkeyPatch, samples: list[int] | None = None) -> Any:
    """A `ModelCudaGraphManager` made without vLLM's constructor, given the broken captures;
    CUDA's capture machinery replaced by recorders."""
    manager: Any = object.__new__(ModelCudaGraphManager)
    vars(manager).update(vars(V2Graphs(samples)))
    manager.forwards = []

    def v2_capture(self, create_forward_fn, progress_bar_desc="") -> None:
        for desc in self._capture_descs[CUDAGraphMode.FULL]:  # V2's own: run plain
            create_forward_fn(desc, warmup=False)(CUDAGraphMode.NONE)

    monkeypatch.setattr(CudaGraphManager, "capture", v2_capture)
    monkeypatch.setattr(vllm_v2_tap_graphs, "graph_capture",
                        lambda device: contextlib.nullcontext())
    monkeypatch.setattr(vllm_v2_tap_graphs, "capture_pool",
                        lambda pool, config: contextlib.nullcontext(pool))
    free = iter(range(10_000, 0, -100))
    monkeypatch.setattr(vllm_v2_tap_graphs, "free_memory", lambda: next(free))

    def capture_broken(forward, pool):
        forward()
        tokens = manager.forwards[-1][0]
        return SimpleNamespace(replay=lambda: manager.replayed.append(f"broken {tokens}"),
                               pool=pool)

    monkeypatch.setattr(vllm_v2_tap_graphs, "capture_broken", capture_broken)
    break_at_taps(manager)
    return manager


def v2_captures(manager: Any) -> None:
    """What `ModelCudaGraphManager.capture` calls once it has made its factory of capture
    forwards: the next class's `capture` in the manager's order."""
    super(ModelCudaGraphManager, manager).capture(forwards_of(manager))


def forwards_of(manager: Any):
    def create_forward_fn(desc, warmup):
        assert warmup is False  # V2 warmed every descriptor up already
        return lambda mode: manager.forwards.append((desc.num_tokens, mode))
    return create_forward_fn


def test_v2s_full_graphs_are_captured_again_broken_through_its_own_capture_forwards(
        monkeypatch: pytest.MonkeyPatch) -> None:
    manager = made(monkeypatch)
    assert type(manager).__mro__[1:4] == (ModelCudaGraphManager, TapBrokenGraphs,
                                          CudaGraphManager)
    v2_captures(manager)
    # V2's own captures first, then each full descriptor again, run as a full graph's forward
    # (attention's own breaks stand aside), into V2's pool; piecewise descriptors are not.
    assert manager.forwards == [(8, CUDAGraphMode.NONE), (4, CUDAGraphMode.NONE),
                                (8, CUDAGraphMode.FULL), (4, CUDAGraphMode.FULL)]
    assert set(manager.interp_broken) == {FULL_8, FULL_4}
    assert has_broken(manager, FULL_4) and not has_broken(manager, PIECES_8)
    assert manager.interp_broken[FULL_8].pool == "pool"


def test_a_replay_is_broken_at_the_taps_only_on_a_step_marked_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    manager = made(monkeypatch)
    v2_captures(manager)
    plain = manager.run_fullgraph(FULL_4)
    with vllm_v2_tap_graphs.tap_breaks_for(manager) as mark:
        mark(True)
        broken = manager.run_fullgraph(FULL_4)
    after = manager.run_fullgraph(FULL_4)
    assert manager.replayed == ["v2 4", "broken 4", "v2 4"]
    # Both return V2's persistent hidden states (the broken forward copied its output there).
    assert plain.data_ptr() == broken.data_ptr() == after.data_ptr()
    assert broken.shape == (4,)
    assert manager.interp_break_at_taps is False
    manager.release_graphs()  # V2 drops its graphs (their pointers went stale): ours too
    assert manager.interp_broken == {} and manager.graphs == {}


def test_v2s_profiling_counts_the_broken_captures_in_its_memory_samples(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """V2 profiles a sample of its full graphs and extrapolates; each broken capture's memory
    is added to its descriptor's sample, so the extrapolation covers both sets."""
    samples = [1_000, 50]
    manager = made(monkeypatch, samples)
    manager._max_full_descs_to_capture = 1
    v2_captures(manager)
    assert set(manager.interp_broken) == {FULL_8}  # the sample only, as V2's own
    assert samples == [1_100, 50]


def test_a_manager_given_the_broken_captures_twice_keeps_one_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    manager = made(monkeypatch)
    before = type(manager)
    break_at_taps(manager)
    assert type(manager) is before and manager.interp_broken == {}
