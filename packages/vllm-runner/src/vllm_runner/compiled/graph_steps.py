"""Steps whose programs all run inside the graph: planned per program, not per request.

The general plan (`step_plan`) makes a `Want` per request per op, for the taps' Python to serve row
by row. At several µs a request a step that was most of what steering or saving at a graph tap cost,
against a GPU decode step of a small model of a few ms. When every program of a step acts only at
graph taps, with only work the graph does (`in_graph`) and no position filter on an `Add`, the step
needs no wants: what each program does at each graph tap is worked out once (`GraphWork`), and per
request the step needs only its steering slot and the rows it saves, as plain numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tokenspan import StepLayout
from vllm_envoys import Value

from vllm_runner.compiled.in_graph import InGraphRows, in_graph_ops
from vllm_runner.compiled.tap_edits import RowTable
from vllm_runner.compiled.tap_saves import SaveRing
from vllm_runner.ops import Add, Op, ProjectOut
from vllm_runner.ops.program import Program
from vllm_runner.ops.wants import ScheduledRequest


@dataclass(frozen=True)
class GraphWork:
    """One program's work at one graph tap: its `ProjectOut` (none, or one), its `Add`s (summed
    into one vector for each of its rows; none: no steering) and whether it saves there."""

    adds: tuple[Add, ...]
    saves: bool
    ablations: tuple[ProjectOut, ...] = ()


@dataclass(frozen=True)
class Steering:
    """One table of one graph tap this step (its steering, or its ablated directions): the
    distinct vectors, each row's slot among them."""

    table: RowTable
    vectors: tuple[torch.Tensor, ...]
    index: np.ndarray


#: Per set of taps saved at together, the saving requests' program ids and rows in the step.
SavingRows = list[tuple[list[SaveRing], list[tuple[str, int]]]]


@dataclass(frozen=True)
class GraphStep:
    """A step's work at the graph taps: the steering to write before the forward, and after
    it, per set of taps the same requests saved at (every layer's, often), their rows in
    `layout` (`repeated_saves` keeps them; the same lists at every step of a repeated
    schedule)."""

    steering: list[Steering]
    saves: SavingRows
    layout: StepLayout


class GraphSteps:
    """Plans the steps whose programs all run inside the graph (`plan`)."""

    LIMIT = 1024  # programs whose work is kept before the cache starts again

    def __init__(self, in_graph: Mapping[str, InGraphRows],
                 locations_of: Callable[[Op], list[str]], values: Mapping[str, Value]) -> None:
        self._in_graph = in_graph
        self._locations_of = locations_of
        self._values = values
        self._work: dict[str, dict[str, GraphWork] | None] = {}  # by digest
        # The last plan, for the next step with the very same requests and rows (`plan`).
        self._last: tuple[Sequence[ScheduledRequest], tuple[int, ...], list[Steering],
                          SavingRows] | None = None

    def work(self, program: Program) -> dict[str, GraphWork] | None:
        """What `program` does at each graph tap, or `None` if some of its work needs the
        taps' Python or the plain module tree (cached by digest: one digest, one set of ops)."""
        if program.digest in self._work:
            return self._work[program.digest]
        if len(self._work) >= self.LIMIT:
            self._work.clear()
        found = self._work[program.digest] = self._worked_out(program)
        return found

    def _worked_out(self, program: Program) -> dict[str, GraphWork] | None:
        at: dict[str, list[Op]] = {}
        for op in program.ops:
            for location in self._locations_of(op):
                if location not in self._in_graph:
                    return None  # another tap, a sampled-row value, or no tap at all
                at.setdefault(location, []).append(op)
        work = {}
        for location, ops in at.items():
            # A value whose availability may depend on the step is checked request by request
            # by the general plan's serving (`ops.wants.passed_over`).
            if self._values[location].eproperty.unavailable is not None:
                return None
            split = in_graph_ops(ops, self._in_graph[location].width)
            if split is None:
                return None
            adds, ablations = split.adds, split.ablations
            if any(op.position_filter(1) is not None for op in (*adds, *ablations)):
                return None  # an edit at some positions only: the general plan's index
            if any(op.positions is not None for op in split.saves):
                return None  # the general plan keeps only the rows it names (`SaveRing.take`)
            work[location] = GraphWork(adds, bool(split.saves), ablations)
        return work

    def plan(self, layout: StepLayout, requests: Sequence[ScheduledRequest]
             ) -> GraphStep | None:
        """Each graph tap's work this step, if every request's program runs inside the graph
        alone; else `None` (the general plan serves the step).

        A step given the very list of requests the last one was (`repeated_schedule`: the same
        requests in the same order) with the same row counts — a run of decode steps — has the
        same steering and the same saving rows (the very same lists); only their positions move
        on."""
        last = self._last
        if last is not None and requests is last[0] and layout.counts == last[1]:
            steering, saving = last[2], last[3]
        else:
            planned = self._planned(layout, requests)
            if planned is None:
                return None
            steering, saving = planned
            self._last = (requests, layout.counts, steering, saving)
        return GraphStep(steering, saving, layout)

    def _planned(self, layout: StepLayout, requests: Sequence[ScheduledRequest]
                 ) -> tuple[list[Steering], SavingRows] | None:
        """`plan`'s steering and saving rows; `None` if some program's work needs more than
        the graph."""
        works: dict[str, dict[str, GraphWork]] = {}
        for request in requests:
            digest = request.program.digest
            if digest not in works:
                found = self.work(request.program)
                if found is None:
                    return None
                works[digest] = found
        index_of = layout.index_map
        places = [(request.program.digest, request.program.program_id,
                   index_of[request.request_id]) for request in requests]
        steering = []
        rings: dict[frozenset[str], list[SaveRing]] = {}  # by the programs saving there
        for location, rows in self._in_graph.items():
            at = {digest: work[location] for digest, work in works.items() if location in work}
            if not at:
                continue
            ablated = {digest: work.ablations for digest, work in at.items()}
            added = {digest: work.adds for digest, work in at.items()}
            for table, ops in ((rows.ablate, ablated), (rows.steer, added)):
                if (filled := self._table(table, ops, places, layout)) is not None:
                    steering.append(filled)
            if saving := frozenset(digest for digest, work in at.items() if work.saves):
                rings.setdefault(saving, []).append(rows.saves)
        return steering, [
            (taps, [(program_id, row) for digest, program_id, row in places if digest in saving])
            for saving, taps in rings.items()]

    @staticmethod
    def _table(table: RowTable, ops: Mapping[str, tuple[Op, ...]],
               places: list[tuple[str, str, int]], layout: StepLayout) -> Steering | None:
        """The distinct vectors of one table of a graph tap (from each program's `ops` there)
        and every row's slot (0: none); `None` if no program has such ops there."""
        by_digest = {digest: table.vectors.vector(found)
                     for digest, found in ops.items() if found}
        if not by_digest:
            return None
        vectors = tuple({id(vector): vector for vector in by_digest.values()}.values())
        slot_of = {id(vector): slot for slot, vector in enumerate(vectors, start=1)}
        digest_slot = {digest: slot_of[id(vector)] for digest, vector in by_digest.items()}
        slots = np.zeros(len(layout), dtype=np.int64)
        for digest, _, row in places:
            slots[row] = digest_slot.get(digest, 0)
        return Steering(table, vectors, np.repeat(slots, layout.counts))
