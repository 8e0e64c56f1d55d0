"""Saves at graph taps over a run of decode steps, kept once a step instead of once a request.

A step served inside the graph (`graph_steps`) copies its saving requests' rows from the taps' rings
into the save arena, and the store then gives each request its rows (`PendingRows.add`): ~1 µs of
host time a request a step, and with the sorting and the runs of adjacent requests around it about
half of such a step's host work, on a GPU where the engine waits on the host. Decode steps with an
unchanged schedule (`repeated_schedule`; `GraphSteps.plan` then hands over the very same list of
saving rows) put every request at the same place in the step's rows, so a run of such steps keeps
one `(block, row)` a step in a `SharedRows` its requests are members of, and writes the same runs of
adjacent rows.

A step extends the run only when it is given the same list of rows, the run still takes steps
(none of its members' rows has been taken out, dropped or spilled: `SharedRows.open`) and every
member's positions follow on from its last step's (one comparison of arrays): a step missed, a
preempted request, or speculative tokens rejected make the step keep its rows request by request
(`keep_rows`) and start a new run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tokenspan import StepLayout

from vllm_runner.compiled.graph_steps import SavingRows
from vllm_runner.compiled.tap_saves import Placed, SaveRing, keep_rows
from vllm_runner.saves.arena import SharedRows
from vllm_runner.saves.store import SaveStore


@dataclass
class _Run:
    """A run of steps whose rows go into one `SharedRows`, and what each step repeats."""

    rows: list[tuple[str, int]]  # the plan's list: the same object at every step of the run
    shared: SharedRows
    locations: tuple[str, ...]
    copies: list[tuple[int, list[torch.Tensor]]]  # per run of adjacent rows: offset, ring rows
    total: int  # rows a step
    members: np.ndarray  # each member's index in the layout
    counts: np.ndarray  # each member's rows a step
    expected: np.ndarray  # each member's first position at the next step
    device_bytes: list[tuple[str, int]]  # each member's bytes a step on a device

    def follows(self, layout: StepLayout) -> bool:
        """Whether every member's rows this step start where its last step's ended."""
        firsts = np.asarray(layout.first_positions, dtype=np.int64)[self.members]
        return bool(np.array_equal(firsts, self.expected))

    def step(self, store: SaveStore) -> None:
        """Keep this step's rows: one reservation, one copy per run of adjacent rows."""
        arena = self.shared.arena
        block, row = arena.reserve(self.total)
        for offset, rings in self.copies:
            arena.write(self.locations, block, row + offset, rings)
        self.shared.add(block, row)
        self.expected += self.counts
        if self.device_bytes:
            store.save_shared_step(self.device_bytes)


class RepeatedSaves:
    """The runs of steps the graph steps' saves are kept in, by the plan's list of rows."""

    def __init__(self) -> None:
        self._runs: dict[int, _Run] = {}

    def keep(self, saves: SavingRows, layout: StepLayout, store: SaveStore) -> None:
        """Keep a graph step's saves (`GraphStep.saves`, on `layout`): extend each set of taps'
        run when the step repeats the last one, else keep them request by request and start a
        run for the next steps."""
        runs: dict[int, _Run] = {}
        for rings, rows in saves:
            run = self._runs.get(id(rows))
            if (run is not None and run.rows is rows and run.shared.open
                    and run.follows(layout)):
                run.step(store)
            else:
                starts, counts, firsts = layout.starts, layout.counts, layout.first_positions
                placed = keep_rows(rings, [(program_id, starts[row], counts[row], firsts[row])
                                           for program_id, row in rows], store)
                if placed is None:
                    continue
                run = _started(rows, rings, placed)
                if run is None:
                    continue
            runs[id(rows)] = run
        self._runs = runs  # a run its step did not extend takes no more steps


def _started(rows: list[tuple[str, int]], rings: Sequence[SaveRing], placed: Placed
             ) -> _Run | None:
    """A run whose first step is the one `keep_rows` just `placed` (`None` if a request saved
    no rows: it would have no place in the next steps)."""
    counts = [count for _, _, count, _ in placed.saving]
    if 0 in counts:
        return None
    arena = rings[0].arena
    shared = SharedRows(arena, placed.offsets, counts)
    for member, pending in enumerate(placed.pending):
        pending.join(shared, member)
    row_bytes = arena.device_row_bytes(len(rings))
    row_of = dict(rows)  # program id -> its request's index in the layout
    return _Run(
        rows=rows, shared=shared,
        locations=tuple(ring.location for ring in rings),
        copies=[(offset, [ring.ring[start:stop] for ring in rings])
                for start, stop, offset in placed.runs],
        total=sum(counts),
        members=np.array([row_of[program_id] for program_id, _, _, _ in placed.saving],
                         dtype=np.int64),
        counts=np.array(counts, dtype=np.int64),
        expected=np.array([first + count for _, _, count, first in placed.saving],
                          dtype=np.int64),
        device_bytes=[(program_id, count * row_bytes)
                      for program_id, _, count, _ in placed.saving] if row_bytes else [])
