"""Saving inside the compiled model: a tap's value copied into a buffer in the graph (tier 3;
which ops and values are served this way: `in_graph`).

A `Save` needs no Python in the forward either: the tap's hook copies the whole value, every row
of the step, into a ring buffer of the tapped module (`ring[:rows] = value`), traced into the
graph like the rest of the model. The copy is private at once, so vLLM's later in-place kernels
cannot overwrite it. After the forward, the runtime takes the saving requests' rows from the
rings into the graph taps' `SaveArena` (one copy per run of adjacent requests and tap), where
they wait for collection as `PendingRows` of the save store; a ring is rewritten by the next
forward, and on a GPU that copy is ordered before it on the same stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
from torch import nn
from vllm_envoys import Value

from vllm_runner.ops.wants import Want, passed_over
from vllm_runner.saves.arena import PendingRows, SaveArena
from vllm_runner.saves.store import SaveStore

#: A saving request's rows of a step: (program id, first row, rows, first position).
SavedRows = tuple[str, int, int, int]


class SaveRing:
    """The ring buffer of one tapped value, and the copy the tap's hook makes into it."""

    def __init__(self, value: Value, width: int, rows: int, name: str, arena: SaveArena) -> None:
        """A `[rows, width]` buffer (`rows`: the most one forward runs) in `arena`'s device and
        dtype, registered on the value's module as `interp_save_<name>_ring` (not saved with
        it); saved rows are kept in `arena`."""
        self.location = value.location
        self._name = f"interp_save_{name}_ring"
        value.module.register_buffer(self._name, torch.zeros(
            rows, width, device=arena.device, dtype=arena.dtype), persistent=False)
        self.ring: torch.Tensor = getattr(value.module, self._name)
        self.arena = arena

    def apply(self, module: nn.Module, rows: torch.Tensor) -> None:
        """Copy the value's `rows` (`[tokens, hidden]`) into the ring, traced into the compiled
        graph; the buffer is read through `module`, so the compiler takes it as an input."""
        getattr(module, self._name)[:rows.shape[0]].copy_(rows)

    def take(self, groups: Iterable[Iterable[Want]], failed: Callable[[str], bool],
             value: Value, store: SaveStore) -> None:
        """Keep each saving request's rows of the last forward (a request's `Save`s there
        share one copy: from the first row one of them keeps to the last, `RowOp.selected_runs`, so
        a probe of the prompt's last token keeps one row, not the prompt), skipping programs
        that failed and steps the value is not served at."""
        kept: dict[str, tuple[Want, int, int]] = {}  # per program: its rows' offsets kept
        for want in (want for members in groups for want in members):
            op = want.op
            if not op.saves_the_value or passed_over(want, value, failed):
                continue
            span = want.span
            runs = op.saved_runs(span.first_position, len(span), want.step.prompt_length)
            if not runs:  # no row this step: an empty piece, so the name comes back (the
                # store keeps it only where the location has nothing yet)
                store.save(want.program_id, self.location, span.first_position,
                           self.ring.new_empty((1, 0, self.ring.shape[1])), 1)
                continue
            start, stop = runs[0][0], runs[-1][1]
            if (earlier := kept.get(want.program_id)) is not None:
                start, stop = min(start, earlier[1]), max(stop, earlier[2])
            kept[want.program_id] = (want, start, stop)
        keep_rows([self], [(want.program_id, want.span.start + start, stop - start,
                            want.span.first_position + start)
                           for want, start, stop in kept.values()], store)


class Placed(NamedTuple):
    """Where `keep_rows` put a step's saved rows, from the first row it reserved: each run of
    adjacent requests' slab rows `start:stop` at `offset` from it; the requests (by first row),
    each at `offsets[i]` from it, and their `PendingRows`."""

    runs: list[tuple[int, int, int]]  # (start, stop, offset)
    saving: list[SavedRows]
    offsets: list[int]
    pending: list[PendingRows]


def keep_rows(rings: Sequence[SaveRing], saving: list[SavedRows], store: SaveStore
              ) -> Placed | None:
    """Keep the rows `saving` names (one entry per request) of the last forward at every one of
    `rings` (their taps all saved them): into their shared arena, one copy per run of adjacent
    requests and ring, and into the store as pending rows, one per request for all the rings.
    Where they went (`None`: nobody saved)."""
    if not saving:
        return None
    arena = rings[0].arena
    saving.sort(key=lambda saved: saved[1])
    block, base = arena.reserve(sum(count for _, _, count, _ in saving))
    locations = tuple(ring.location for ring in rings)
    placed: list[tuple[str, int, int, int, int]] = []
    offsets: list[int] = []
    runs: list[tuple[int, int, int]] = []
    row = base
    for run in _runs(saving):
        start, stop = run[0][1], run[-1][1] + run[-1][2]
        arena.write(locations, block, row, [ring.ring[start:stop] for ring in rings])
        runs.append((start, stop, row - base))
        for program_id, first, count, first_position in run:
            offsets.append(row - base + first - start)
            placed.append((program_id, first_position, block, row + first - start, count))
        row += stop - start
    pending = store.save_pending(locations, arena, placed)
    return Placed(runs, saving, offsets, pending)


def _runs(saving: list[SavedRows]) -> list[list[SavedRows]]:
    """Saved rows (sorted by first row) in runs of adjacent ones."""
    runs: list[list[SavedRows]] = []
    for saved in saving:
        if runs and runs[-1][-1][1] + runs[-1][-1][2] == saved[1]:
            runs[-1].append(saved)
        else:
            runs.append([saved])
    return runs
