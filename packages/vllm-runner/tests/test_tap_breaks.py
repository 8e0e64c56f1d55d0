"""Full CUDA graphs broken at the taps (`tap_breaks`, `engine.v2_tap_graphs`), without a GPU: the
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
from vllm_runner.compiled import breaks as tap_breaks
from vllm_runner.compiled import taps
from vllm_runner.engine import v2_tap_graphs as vllm_v2_tap_graphs
from vllm_runner.engine.v2_tap_graphs import (
    TapBrokenCapture,
    TapBrokenGraphs,
    break_at_taps,
    has_broken,
)


class FakeCapture:
    """vLLM's breakable capture as the tap op sees it: `add_eager` runs the body now and keeps
    it for `replay` (which replays the graph segments around it too, here none)."""

    def __init__(self) -> None:
        self.recorded: list[Any] = []
        self.keys: list[str] = []

    def add_eager(self, body):
        self.recorded.append(body)
        return body()

    def replay(self) -> None:
        for body in self.recorded:
            body()


class OurFakeCapture(FakeCapture):
    """Ours (`TapBrokenCapture`): a tap is kept with its key (`add_tap`), for the replays that
    stop only at the taps a step needs."""

    def add_tap(self, body, key: str) -> None:
        self.add_eager(body)
        self.keys.append(key)


class Server:
    """A runtime serving taps, recording what it was handed."""

    def __init__(self) -> None:
        self.served: list[tuple[str, Any]] = []

    def wants_tap(self, location: str) -> bool:
        return True

    def serve_tap(self, location: str, raw: Any) -> None:
        self.served.append((location, raw))


@pytest.fixture(params=["ours", "vllm's"])
def capturing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """A breakable capture active on this thread — ours (`TapBrokenCapture`) or vLLM's own
    (a user's `VLLM_USE_BREAKABLE_CUDAGRAPH=1`) — its stream capturing; references to tensors
    made by a recorder (vLLM's weak references need its CUDA extension)."""
    ours = request.param == "ours"
    capture = OurFakeCapture() if ours else FakeCapture()
    registry = tap_breaks.captures if ours else BreakableCUDAGraphCapture._tls
    monkeypatch.setattr(registry, "active", capture, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    capture.weak = []
    monkeypatch.setattr(tap_breaks, "weak_ref",
                        lambda tensor: capture.weak.append(tensor) or tensor)
    yield capture
    taps.serve_taps(None)


def test_a_tap_met_during_a_breakable_capture_ends_the_segment_and_runs_at_every_replay(
        capturing: FakeCapture) -> None:
    residual, hidden = torch.arange(4.0), torch.ones(4)
    server = Server()
    torch.ops.vllm_interp.tap([residual, hidden], "layers.0.layer_output|(T,T,)")
    assert len(capturing.recorded) == 1 and server.served == []  # nobody served at capture
    # Ours keeps the tap's key (its locations); vLLM's own capture has no place for it.
    assert capturing.keys == (["layers.0.layer_output|(T,T,)"]
                              if isinstance(capturing, OurFakeCapture) else [])
    # Each tensor held through a reference that does not keep the graph's memory alive.
    assert [id(tensor) for tensor in capturing.weak] == [id(residual), id(hidden)]
    taps.serve_taps(server)
    capturing.replay()
    capturing.replay()
    assert [location for location, _ in server.served] == ["layers.0.layer_output"] * 2
    for _, raw in server.served:  # the capture's own tensors, to be edited in place
        assert raw[0] is residual and raw[1] is hidden


def test_a_capture_broken_at_the_taps_is_not_one_that_vllms_breaks_see(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention and vLLM's other marked ops break where `BreakableCUDAGraphCapture.current()`
    names a capture: ours registers apart (for the taps alone), so they stay inside the
    graph; it ends its last segment and leaves the registry when its block ends."""
    monkeypatch.setattr(TapBrokenCapture, "_begin_segment", lambda self: None)
    ended: list[bool] = []
    monkeypatch.setattr(TapBrokenCapture, "_end_segment", lambda self: ended.append(True))
    with TapBrokenCapture() as ours:
        assert TapBrokenCapture.current() is ours is tap_breaks.captures.active
        assert BreakableCUDAGraphCapture.current() is None
        with pytest.raises(RuntimeError, match="already running"), TapBrokenCapture():
            pass
    assert ended == [True] and TapBrokenCapture.current() is None


def tap_served_now() -> Server:
    """One tap op call at `layers.1.layer_output` with a runtime serving: what it was handed."""
    server = Server()
    taps.serve_taps(server)
    try:
        torch.ops.vllm_interp.tap([torch.ones(2)], "layers.1.layer_output|T")
    finally:
        taps.serve_taps(None)
    return server


def test_a_tap_outside_a_capture_is_served_at_once() -> None:
    assert [location for location, _ in tap_served_now().served] == ["layers.1.layer_output"]
    assert tap_breaks.break_at_tap(lambda *_: None, [], "") is False


def test_a_tap_whose_stream_is_not_capturing_is_served_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture object is current but the stream records nothing (between its segments, or
    a forward run eagerly inside one): the tap runs now, and nothing is recorded."""
    capture = FakeCapture()
    monkeypatch.setattr(tap_breaks.captures, "active", capture, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert len(tap_served_now().served) == 1 and capture.recorded == []


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
    CUDA's capture machinery replaced by recorders, the device's free memory falling only while
    a broken capture runs (by 100 bytes a token of its descriptor)."""
    manager: Any = object.__new__(ModelCudaGraphManager)
    vars(manager).update(vars(V2Graphs(samples)))
    manager.forwards = []
    manager.free = 10_000

    def v2_capture(self, create_forward_fn, progress_bar_desc="") -> None:
        for desc in self._capture_descs[CUDAGraphMode.FULL]:  # V2's own: run plain
            create_forward_fn(desc, warmup=False)(CUDAGraphMode.NONE)

    monkeypatch.setattr(CudaGraphManager, "capture", v2_capture)
    monkeypatch.setattr(vllm_v2_tap_graphs, "graph_capture",
                        lambda device: contextlib.nullcontext())
    monkeypatch.setattr(vllm_v2_tap_graphs, "capture_pool",
                        lambda pool, config: contextlib.nullcontext(pool))
    monkeypatch.setattr(vllm_v2_tap_graphs, "free_memory", lambda: manager.free)

    def capture_broken(forward, pool):
        forward()
        tokens = manager.forwards[-1][0]
        manager.free -= 100 * tokens
        return SimpleNamespace(pool=pool, replay_for=lambda waited_at: manager.replayed.append(
            f"broken {tokens} waited at {list(waited_at)}") is None)  # joined

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
    # V2's own captures first, then each full descriptor again, its forward run as V2 runs its
    # own capture's (no graph in the forward context), into V2's pool; piecewise ones are not.
    assert manager.forwards == [(8, CUDAGraphMode.NONE), (4, CUDAGraphMode.NONE),
                                (8, CUDAGraphMode.NONE), (4, CUDAGraphMode.NONE)]
    assert set(manager.interp_broken) == {FULL_8, FULL_4}
    assert has_broken(manager, FULL_4) and not has_broken(manager, PIECES_8)
    assert manager.interp_broken[FULL_8].pool == "pool"


def test_a_replay_is_broken_at_the_taps_only_on_a_step_marked_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    manager = made(monkeypatch)
    v2_captures(manager)
    counted: list[str] = []
    manager.run_fullgraph(FULL_4)
    with vllm_v2_tap_graphs.tap_breaks_for(manager, lambda joined: counted.append(joined),
                                           lambda: ["b"]) as mark:
        manager.run_fullgraph(FULL_8)  # not marked yet: V2's own
        mark(True)
        broken = manager.run_fullgraph(FULL_4)
        mark(False)
        manager.run_fullgraph(FULL_4)
        mark(True)
    manager.run_fullgraph(FULL_4)  # after the block: V2's own again, whatever was marked
    # The broken replay asks the step's runtime which taps it needs (`compiled.replays`).
    assert manager.replayed == ["v2 4", "v2 8", "broken 4 waited at ['b']", "v2 4", "v2 4"]
    assert list(manager.interp_waited_at()) == []  # after the block: no step to ask
    assert counted == [True]  # each broken replay counted (joined, as it said), nothing else
    # V2's persistent hidden states, where the broken capture's forward copied its output.
    assert broken.data_ptr() == manager.hidden_states.data_ptr() and broken.shape == (4,)
    manager.release_graphs()  # V2 drops its graphs (their pointers went stale): ours too
    assert manager.interp_broken == {} and manager.graphs == {}


def test_v2s_profiling_counts_the_broken_captures_in_its_memory_samples(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """V2 profiles a sample of its full graphs and extrapolates; each broken capture's memory
    is added to its own descriptor's sample, so the extrapolation covers both sets."""
    samples = [1_000, 50]
    manager = made(monkeypatch, samples)
    manager._max_full_descs_to_capture = 1
    v2_captures(manager)
    assert set(manager.interp_broken) == {FULL_8}  # the sample only, as V2's own
    assert samples == [1_800, 50]
    samples = [1_000, 50]
    manager = made(monkeypatch, samples)
    manager._max_full_descs_to_capture = 2
    v2_captures(manager)
    assert samples == [1_800, 450]


def test_microbatched_descriptors_keep_the_pieces_and_the_samples_stay_aligned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """V2 sorts a microbatched (DBO) twin right after its descriptor and samples that list;
    the twin gets no broken capture, and the next descriptor's memory still lands in its own
    sample."""
    twin = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=8, num_reqs=8,
                                    uniform_token_count=1, max_query_len=1, num_ubatches=2)
    samples = [1_000, 60, 50]
    manager = made(monkeypatch, samples)
    manager._capture_descs[CUDAGraphMode.FULL] = [FULL_8, twin, FULL_4]
    v2_captures(manager)
    assert set(manager.interp_broken) == {FULL_8, FULL_4}
    assert samples == [1_800, 60, 450]


def test_a_failed_broken_capture_leaves_v2s_graphs_and_no_broken_one(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    manager = made(monkeypatch)
    calls = 0

    def fails_second(forward, pool):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("operation not permitted when stream is capturing")
        return SimpleNamespace(replay_for=lambda waited_at: None)

    monkeypatch.setattr(vllm_v2_tap_graphs, "capture_broken", fails_second)
    v2_captures(manager)
    assert manager.interp_broken == {} and not has_broken(manager, FULL_8)
    assert "could not be captured" in caplog.text


def test_a_manager_given_the_broken_captures_twice_keeps_its_captures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    manager = made(monkeypatch)
    v2_captures(manager)
    before = type(manager)
    break_at_taps(manager)
    assert type(manager) is before and set(manager.interp_broken) == {FULL_8, FULL_4}
