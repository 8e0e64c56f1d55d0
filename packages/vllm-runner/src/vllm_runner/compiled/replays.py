"""Replays of a capture broken at the taps that stop only at the taps a step needs.

A full graph broken at every tap (`compiled.breaks`) replays as graph, tap, graph, tap, ...: on the
SmolLM2 shape with every layer a tap that is 31 graph launches and 30 taps' Python a step,
however few taps the step's programs use (a `Call` at one layer pays for all 30). Here the
graph segments between the taps a step needs are joined into one CUDA graph (`compiled.joins`:
each segment a child of a new graph, made once per set of needed taps and kept), and the taps
nobody waits at this step are left out: their Python would find nobody and return. The work
on the device is the same kernels in the same order on the same memory; only the host's
launches change.

Nothing here needs CUDA: the joining is given (`join`), so the plans are tested on any machine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

logger = logging.getLogger("vllm.interp")

_told = False  # whether a failure to join was logged with its error in this process

#: At most this many sets of needed taps get joined graphs, per capture (each set costs one
#: graph's instantiation and its memory on the device); further sets replay the segments one
#: by one, leaving out the taps they do not need.
JOINED_SETS_PER_CAPTURE = 16


@dataclasses.dataclass(frozen=True)
class GraphPart:
    """A captured graph segment: `graph` is a `torch.cuda.CUDAGraph` captured with
    `keep_graph=True` (its template can be joined into others)."""

    graph: Any


@dataclasses.dataclass(frozen=True)
class TapPart:
    """A tap's Python between two segments: `run` serves it, `locations` are the locations it
    serves (`taps.parse_key`)."""

    run: Callable[[], None]
    locations: tuple[str, ...]


Part = GraphPart | TapPart
#: Joins graph segments into one launch (`compiled.joins.JoinedGraph`).
Join = Callable[[Sequence[Any]], Callable[[], None]]
#: One launch of a replay, and for joined segments what runs instead if the launch fails (the
#: segments one by one).
Launch = tuple[Callable[[], None], Callable[[], None] | None]


def replay_plan(parts: Sequence[Part], needed: frozenset[int]) -> list[tuple[int, ...]]:
    """The launches of a replay that stops only at the taps whose indices (into `parts`) are in
    `needed`: each entry is either one needed tap's index or the indices of the graph segments
    run as one launch (every segment in order, between the needed taps)."""
    plan: list[tuple[int, ...]] = []
    graphs: list[int] = []
    for index, part in enumerate(parts):
        if isinstance(part, GraphPart):
            graphs.append(index)
        elif index in needed:
            if graphs:
                plan.append(tuple(graphs))
                graphs = []
            plan.append((index,))
    if graphs:
        plan.append(tuple(graphs))
    return plan


class TapReplays:
    """A broken capture's replays by the taps a step needs, joined graphs made on first use."""

    def __init__(self, parts: Sequence[Part], join: Join,
                 joined_sets: int = JOINED_SETS_PER_CAPTURE) -> None:
        self.parts = list(parts)
        self._join = join
        self._joined_sets = joined_sets
        self._taps_at: dict[str, list[int]] = {}  # location -> the taps that serve it
        for index, part in enumerate(self.parts):
            if isinstance(part, TapPart):
                for location in part.locations:
                    self._taps_at.setdefault(location, []).append(index)
        self._launches: dict[frozenset[int], list[Launch]] = {}
        self._joining_failed = False

    def needed(self, waited_at: Iterable[str]) -> frozenset[int]:
        """The taps a step needs: those that serve a location a request waits at."""
        taps_at = self._taps_at
        return frozenset(index for location in waited_at for index in taps_at.get(location, ()))

    def replay(self, waited_at: Iterable[str]) -> bool:
        """Replay the whole capture, running only the taps that serve a location in `waited_at`
        (the runtime's `locations_waited_at`, read once the step is planned); whether some of
        its segments ran joined (`llm.forwards()["tap_breaks_joined"]`)."""
        needed = self.needed(waited_at)
        launches = self._launches.get(needed)
        if launches is None:
            launches = self._made(needed)
        joined = False
        for launch, instead in launches:
            if instead is None:
                launch()
            elif self._joining_failed:  # an earlier launch of this replay failed
                instead()
            else:
                try:
                    launch()
                    joined = True
                except Exception:  # nothing was launched: the segments run one by one instead
                    self._stop_joining("launched")
                    instead()
        return joined

    def _made(self, needed: frozenset[int]) -> list[Launch]:
        """The launches for `needed`: joined graphs, kept, while joining works and the capture
        has fewer than its limit of sets; else each segment on its own (not kept: building it
        is a walk over the parts)."""
        plan = replay_plan(self.parts, needed)
        if self._joining_failed or len(self._launches) >= self._joined_sets:
            return self._launches_of(plan, None)
        try:
            launches = self._launches_of(plan, self._join)
        except Exception:
            self._stop_joining("made")
            return self._launches_of(plan, None)
        self._launches[needed] = launches
        return launches

    def _stop_joining(self, what: str) -> None:
        """Joined graphs failed (to be `what`): join no more for this capture, and say so with
        the error the first time in the process (every capture of the engine would fail
        alike); later ones in a line."""
        global _told
        if _told:
            logger.warning("vllm-runner: joined graph segments could not be %s (again)", what)
        else:
            logger.exception("vllm-runner: joined graph segments could not be %s; the steps "
                             "that stop at a few taps replay every segment on its own", what)
            _told = True
        self._joining_failed = True
        self._launches.clear()

    def _launches_of(self, plan: list[tuple[int, ...]], join: Join | None) -> list[Launch]:
        """`plan`'s launches, segments joined by `join` (each join with its segments one by one
        to run instead, should it fail), or one by one where there is no `join`."""
        launches: list[Launch] = []
        for indices in plan:
            first = self.parts[indices[0]]
            if isinstance(first, TapPart):
                launches.append((first.run, None))
            elif len(indices) == 1:
                launches.append((first.graph.replay, None))
            else:
                graphs = [self.parts[index].graph  # type: ignore[union-attr]
                          for index in indices]
                one_by_one = self._one_by_one(graphs)
                launches.append((one_by_one, None) if join is None
                                else (join(graphs), one_by_one))
        return launches

    @staticmethod
    def _one_by_one(graphs: Sequence[Any]) -> Callable[[], None]:
        replays = [graph.replay for graph in graphs]

        def replay() -> None:
            for each in replays:
                each()
        return replay
