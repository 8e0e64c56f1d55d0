"""Replays of a capture broken at the taps that stop only at the taps a step needs
(`compiled.replays`, `TapBrokenCapture.replay_for`), without a GPU: graph segments are recorders,
the joining of segments a recorder of what it joined. The oracle is the replay vLLM's
breakable capture makes (every segment, every tap's Python, each tap serving only where a
location is wanted): a step's replay must do the same work in the same order. On a GPU
`test_compiled` replays joined graphs for real (a step tapped at one location of three) and
checks its values against the eager engine and transformers."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm_runner.compiled import breaks as tap_breaks
from vllm_runner.compiled import replays as tap_replays
from vllm_runner.compiled import taps
from vllm_runner.compiled.replays import GraphPart, Part, TapPart, TapReplays, replay_plan
from vllm_runner.engine import v2_tap_graphs as vllm_v2_tap_graphs
from vllm_runner.engine.v2_tap_graphs import TapBrokenCapture

LOCATIONS = [f"layers.{index}.layer_output" for index in range(4)] + ["layers.1.mlp_neurons"]


class Segment:
    """A captured graph segment that records its replays."""

    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events

    def replay(self) -> None:
        self.events.append(self.name)


def captured(tap_locations: Sequence[tuple[str, ...]], events: list[str],
             wanted: Callable[[], set[str]], called: list[int] | None = None) -> list[Part]:
    """A capture as vLLM's breakable capture leaves it: a segment, then per tap the tap and a
    segment; each tap serves (records itself) where one of its locations is wanted now, and
    notes in `called` that its Python ran at all."""
    parts: list[Part] = [GraphPart(Segment("g0", events))]
    for index, locations in enumerate(tap_locations, start=1):
        def run(locations: tuple[str, ...] = locations, index: int = index) -> None:
            if called is not None:
                called.append(index)
            if wanted() & set(locations):
                events.append(f"t{index}")
        parts += [TapPart(run, locations), GraphPart(Segment(f"g{index}", events))]
    return parts


def every_part(parts: Sequence[Part]) -> None:
    """vLLM's replay: every segment and every tap, in order."""
    for part in parts:
        part.run() if isinstance(part, TapPart) else part.graph.replay()


class Joins:
    """The joining of segments into one launch, recorded: a joined launch replays its
    segments in order (what the joined CUDA graph does on the device)."""

    def __init__(self) -> None:
        self.made: list[tuple[str, ...]] = []

    def __call__(self, graphs: Sequence[Any]) -> Callable[[], None]:
        self.made.append(tuple(graph.name for graph in graphs))

        def launch() -> None:
            for graph in graphs:
                graph.replay()
        return launch


tap_sets = st.lists(st.sets(st.sampled_from(LOCATIONS), min_size=1, max_size=2).map(
    lambda found: tuple(sorted(found))), max_size=6)


@settings(max_examples=200, deadline=None)
@given(tap_sets, st.sets(st.integers(0, 12)))
def test_a_plan_runs_every_segment_in_order_and_only_the_taps_needed(
        tap_locations: list[tuple[str, ...]], needed_guess: set[int]) -> None:
    parts = captured(tap_locations, [], set)
    needed = frozenset(index for index in needed_guess if index < len(parts)
                       and isinstance(parts[index], TapPart))
    plan = replay_plan(parts, needed)
    flat = [index for launch in plan for index in launch]
    assert flat == [index for index, part in enumerate(parts)
                    if isinstance(part, GraphPart) or index in needed]
    for launch in plan:  # a tap alone, or segments only
        kinds = {type(parts[index]) for index in launch}
        assert kinds == {GraphPart} or (kinds == {TapPart} and len(launch) == 1)
    for before, after in itertools.pairwise(plan):  # segments joined as far as they go
        assert isinstance(parts[before[0]], TapPart) or isinstance(parts[after[0]], TapPart)


@settings(max_examples=150, deadline=None)
@given(tap_sets, st.lists(st.sets(st.sampled_from(LOCATIONS)), min_size=1, max_size=6),
       st.integers(0, 3))
def test_each_steps_replay_does_what_vllms_replay_of_every_part_does(
        tap_locations: list[tuple[str, ...]], steps: list[set[str]], limit: int) -> None:
    """Steps wanting different locations, one capture: the same segments and served taps in
    the same order as replaying every part; segments joined once per set of needed taps, up
    to the capture's limit of sets (then one by one, still the same work)."""
    now: set[str] = set()
    ours: list[str] = []
    replays = TapReplays(captured(tap_locations, ours, lambda: now), joins := Joins(),
                         joined_sets=limit)
    oracle: list[str] = []
    every = captured(tap_locations, oracle, lambda: now)
    for wanted in steps:
        now.clear()
        now.update(wanted)
        ours.clear()
        oracle.clear()
        replays.replay(now)
        every_part(every)
        assert ours == oracle
    needed_sets = {replays.needed(wanted) for wanted in steps}
    assert len(joins.made) <= sum(len(replay_plan(replays.parts, needed)) for needed in
                                  needed_sets)  # never one set joined twice
    assert len(replays._launches) <= limit


def test_the_taps_nobody_waits_at_are_left_out_and_the_segments_between_joined_once() -> None:
    events: list[str] = []
    called: list[int] = []
    now = {"layers.1.layer_output"}
    replays = TapReplays(captured([("layers.0.layer_output",), ("layers.1.layer_output",),
                                   ("layers.2.layer_output",)], events, lambda: now, called),
                         joins := Joins())
    assert replays.replay(now) and replays.replay(now)  # joined, both times
    assert events == ["g0", "g1", "t2", "g2", "g3"] * 2
    assert called == [2, 2]  # taps 1 and 3 not even called
    assert joins.made == [("g0", "g1"), ("g2", "g3")]  # made at the first replay, kept
    events.clear()
    replays.replay([])  # nothing wanted: the whole graph, one launch
    assert events == ["g0", "g1", "g2", "g3"] and joins.made[-1] == ("g0", "g1", "g2", "g3")


def test_segments_that_cannot_be_joined_replay_one_by_one_and_joining_stops(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The join fails: this capture's steps replay segment by segment from then on; the error
    is logged with its traceback once in the process (every capture would fail alike), then in
    a line per capture."""
    monkeypatch.setattr(tap_replays, "_told", False)
    events: list[str] = []
    now = {"layers.0.layer_output"}
    tries: list[int] = []

    def fails(graphs: Sequence[Any]) -> Callable[[], None]:
        tries.append(len(graphs))
        raise RuntimeError("cudaGraphAddChildGraphNode failed")

    replays = TapReplays(captured([("layers.0.layer_output",), ("layers.1.layer_output",)],
                                  events, lambda: now), fails)
    with caplog.at_level(logging.WARNING, logger="vllm.interp"):
        replays.replay(now)
        replays.replay([])
        another = TapReplays(replays.parts, fails)
        another.replay(now)
    assert events == ["g0", "t1", "g1", "g2", "g0", "g1", "g2", "g0", "t1", "g1", "g2"]
    assert tries == [2, 2]  # tried once a capture, never again
    assert [record.levelname for record in caplog.records] == ["ERROR", "WARNING"]
    assert "could not be made" in caplog.records[0].getMessage()
    assert caplog.records[0].exc_info is not None and caplog.records[1].exc_info is None


def test_a_joined_launch_that_fails_runs_its_segments_one_by_one_and_joining_stops(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch that raises launched nothing (CUDA returns its error before enqueuing): its
    segments run one by one in its place, once, and no joined graph is launched again."""
    monkeypatch.setattr(tap_replays, "_told", False)
    events: list[str] = []
    now = {"layers.1.layer_output"}
    joins = Joins()

    def fails_at_launch(graphs: Sequence[Any]) -> Callable[[], None]:
        joins(graphs)

        def launch() -> None:
            raise RuntimeError("cudaGraphLaunch failed: cudaErrorInvalidValue")
        return launch

    replays = TapReplays(captured([("layers.0.layer_output",), ("layers.1.layer_output",),
                                   ("layers.2.layer_output",)], events, lambda: now),
                         fails_at_launch)
    with caplog.at_level(logging.ERROR, logger="vllm.interp"):
        assert not replays.replay(now)  # nothing ran joined
        assert not replays.replay(now)
    assert events == ["g0", "g1", "t2", "g2", "g3"] * 2
    assert joins.made == [("g0", "g1"), ("g2", "g3")]  # made once, then no more
    assert caplog.text.count("could not be launched") == 1


# ------------------------------------------------------------------ our capture's parts


class FakeGraph:
    """`torch.cuda.CUDAGraph` as the capture uses it, recording its life."""

    made: ClassVar[list[FakeGraph]] = []

    def __init__(self, keep_graph: bool = False) -> None:
        self.keep_graph, self.pool, self.ended, self.instantiated = keep_graph, None, False, False
        self.events: list[str] = []
        FakeGraph.made.append(self)

    def capture_begin(self, pool: Any = None) -> None:
        self.pool = pool

    def capture_end(self) -> None:
        self.ended = True

    def instantiate(self) -> None:
        self.instantiated = True

    def replay(self) -> None:
        self.events.append(f"g{FakeGraph.made.index(self)}")


def test_our_capture_keeps_each_segments_template_and_which_locations_each_tap_serves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tap ops met while our capture records: each ends a segment (kept, its template too,
    instantiated at once) and is kept with the locations its key names; a step's replay runs
    the segments joined around the taps it needs, and each tap serves the runtime."""
    FakeGraph.made = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    from vllm_runner.compiled import breaks
    monkeypatch.setattr(breaks, "weak_ref", lambda tensor: tensor)
    hidden, neurons = torch.ones(2), torch.zeros(3)
    with TapBrokenCapture(pool="pool") as capture:
        torch.ops.vllm_interp.tap([hidden], "layers.0.layer_output|T")
        torch.ops.vllm_interp.tap([neurons], "layers.1.mlp_neurons;layers.1.mlp_input|T")
    assert tap_breaks.captures.active is None
    assert [type(part).__name__ for part in capture.parts] == [
        "GraphPart", "TapPart", "GraphPart", "TapPart", "GraphPart"]
    assert [part.locations for part in capture.parts if isinstance(part, TapPart)] == [
        ("layers.0.layer_output",), ("layers.1.mlp_neurons", "layers.1.mlp_input")]
    assert all(graph.keep_graph and graph.ended and graph.instantiated and graph.pool == "pool"
               for graph in FakeGraph.made) and len(FakeGraph.made) == 3
    events: list[str] = []
    for graph in FakeGraph.made:
        graph.events = events
    joins = Joins()
    monkeypatch.setattr(vllm_v2_tap_graphs, "JoinedGraph", joins)
    joins_names = {id(graph): f"g{index}" for index, graph in enumerate(FakeGraph.made)}
    for graph in FakeGraph.made:
        graph.name = joins_names[id(graph)]
    served: list[tuple[str, Any]] = []

    class Server:
        def wants_tap(self, location: str) -> bool:
            return location == "layers.1.mlp_input"

        def locations_waited_at(self) -> list[str]:
            return ["layers.1.mlp_input"]

        def serve_tap(self, location: str, raw: Any) -> None:
            served.append((location, raw))

    taps.serve_taps(server := Server())
    try:
        capture.replay_for(server.locations_waited_at())
    finally:
        taps.serve_taps(None)
    assert events == ["g0", "g1", "g2"] and joins.made == [("g0", "g1")]
    assert served == [("layers.1.mlp_input", neurons)]


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="joins CUDA graphs: runs in the GPU suite (benchmarks/gpu/check.sh)")
def test_on_a_gpu_joined_segments_compute_what_replaying_every_segment_computes() -> None:
    """Real CUDA graphs: a capture broken at four taps (the last two with no kernel between),
    replayed for steps waiting at different taps — the same values at the end and at each tap
    run as replaying every segment and tap, through joined graphs (none failed)."""
    from vllm_runner.compiled.joins import JoinedGraph

    value = torch.zeros(256, device="cuda")
    seen: list[tuple[str, float]] = []

    def tap(name: str) -> Callable[[], None]:
        return lambda: seen.append((name, float(value[0])))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up, as before any capture
        value.add_(1).mul_(2).add_(3).mul_(5).sub_(1)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.stream(stream), TapBrokenCapture(
            pool=torch.cuda.graph_pool_handle()) as capture:
        value.add_(1)
        capture.add_tap(tap("a"), "a|T")
        value.mul_(2)
        capture.add_tap(tap("b"), "b;b2|T")
        value.add_(3)
        value.mul_(5)
        capture.add_tap(tap("c"), "c|T")
        capture.add_tap(tap("d"), "d|T")  # an empty segment before it
        value.sub_(1)
    torch.cuda.current_stream().wait_stream(stream)
    at_each_tap = {"a": 1.0, "b": 2.0, "c": 25.0, "d": 25.0}
    for waited_at in ([], ["b2"], ["a", "c"], ["d"], ["a", "b", "c", "d"], ["b2"]):
        seen.clear()
        value.zero_()
        assert capture.replay_for(waited_at) is (waited_at != ["a", "b", "c", "d"])  # joined
        torch.cuda.synchronize()
        assert torch.equal(value, torch.full_like(value, 24.0)), waited_at
        expected = [name for name in "abcd" if {name, f"{name}2"} & set(waited_at)]
        assert seen == [(name, at_each_tap[name]) for name in expected], waited_at
    replays = capture._replays
    assert replays is not None and not replays._joining_failed
    assert any(isinstance(launch, JoinedGraph)
               for launches in replays._launches.values() for launch, _ in launches)
