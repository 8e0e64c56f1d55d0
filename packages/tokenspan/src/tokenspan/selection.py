"""`Selection`: the rows of many requests as one index, so an op over hundreds is a few kernels."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from itertools import pairwise, repeat
from typing import TYPE_CHECKING

import torch

from tokenspan.axis import require_token_axis
from tokenspan.errors import LayoutError, SpanError, SpanShapeError
from tokenspan.runs import RunRead, maximal_runs, plan_reads
from tokenspan.span import Key

if TYPE_CHECKING:  # annotations only: layout imports this module, not the other way round
    from tokenspan.layout import StepLayout

# On CPU, runs of at least this many rows on average are sliced run by run (see `_by_runs`).
RUN_ROWS = 16


class Selection:
    """Chosen rows of chosen requests in one step, grouped by request in slab order.

    Built by `StepLayout.select`. Instead of a Python loop over requests (one narrow, one
    kernel each), an op applied to every selected row is one `index_select`, `index_copy_` or
    `index_add_` on the slab — or, where the rows form long runs on CPU, one slice per run
    (neighbouring requests merge into one run). Index tensors are built once on the host and
    copied to a device at most once per device.

    Attributes: `keys` (selected requests present this step, in slab order), `counts` (rows
    selected per key), `rows` (int64 slab rows, ascending), `positions` (absolute position of
    each selected row), `owners` (index into `keys` of each selected row).

    A selection of whole requests (`layout.select(keys)`) makes no tensor until one is used:
    its `runs` and `reads()` come from the layout's starts and counts alone.
    """

    __slots__ = ("_by_device", "_indices", "_owners", "_positions", "_rows", "_runs", "_size",
                 "counts", "keys", "layout")

    def __init__(
        self,
        layout: StepLayout,
        keys: tuple[Key, ...],
        counts: tuple[int, ...],
        rows: torch.Tensor | None,
        *,
        indices: tuple[int, ...] | None = None,
    ) -> None:
        """Store a selection; use `StepLayout.select` instead.

        `rows` is `None` for a selection of whole requests (made from the layout on first use);
        `indices` are the keys' places in slab order, when the caller already has them.
        """
        self.layout = layout
        self.keys = keys
        self.counts = counts
        self._rows = rows
        self._size = sum(counts)
        self._indices = indices
        self._positions: torch.Tensor | None = None
        self._owners: torch.Tensor | None = None
        self._runs: list[tuple[int, int]] | None = None
        self._by_device: dict[tuple[str, str], torch.Tensor] = {}

    @classmethod
    def build(
        cls,
        layout: StepLayout,
        wanted: Iterable[Key] | Mapping[Key, Iterable[int] | None] | None,
        device: torch.device | str | None = None,
    ) -> Selection:
        """Select rows; see `StepLayout.select` for what `wanted` may be."""
        whole_requests, position_lists, position_owners = _parse_wanted(layout, wanted)
        if not position_lists:
            # Whole requests only: their counts are known without looking at rows, and the rows
            # tensor waits until something needs it (`reads()` and `runs` do not).
            all_counts = layout.counts
            chosen = tuple(i for i in sorted(set(whole_requests)) if all_counts[i])
            selection = cls(layout, tuple(map(layout.keys.__getitem__, chosen)),
                            tuple(map(all_counts.__getitem__, chosen)), None, indices=chosen)
        else:
            rows = _selected_rows(layout, whole_requests, position_lists, position_owners)
            per_request = torch.bincount(layout.row_owners().index_select(0, rows),
                                         minlength=len(layout))
            found = per_request.nonzero().squeeze(1).tolist()
            counts = tuple(per_request.index_select(0, torch.tensor(found, dtype=torch.long))
                           .tolist())
            selection = cls(layout, tuple(map(layout.keys.__getitem__, found)), counts, rows,
                            indices=tuple(found))
        if device is not None:
            selection.rows_on(device)
        return selection

    @property
    def rows(self) -> torch.Tensor:
        """The selected slab rows (int64, ascending, on the host)."""
        if self._rows is None:
            self._rows = _selected_rows(self.layout, list(self._request_indices()), [], [])
        return self._rows

    def _request_indices(self) -> tuple[int, ...]:
        """Each selected key's index in the layout's slab order."""
        if self._indices is None:
            self._indices = tuple(map(self.layout.index, self.keys))
        return self._indices

    @property
    def positions(self) -> torch.Tensor:
        """The absolute position of each selected row (int64, on the host)."""
        if self._positions is None:
            self._positions = self.layout.row_positions().index_select(0, self.rows)
        return self._positions

    @property
    def owners(self) -> torch.Tensor:
        """For each selected row, the index into `keys` of its request (int64, on the host)."""
        if self._owners is None:
            self._owners = torch.repeat_interleave(
                torch.arange(len(self.keys)), torch.tensor(self.counts, dtype=torch.long),
                output_size=self._size,
            )
        return self._owners

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"Selection({len(self.keys)} requests, {len(self)} rows)"

    def _on(self, name: str, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A selection tensor (`rows` or `owners`, named by `name`) on `device`, copied there at
        most once."""
        if device.type == "cpu":
            return tensor
        cache_key = (name, str(device))
        cached = self._by_device.get(cache_key)
        if cached is None:
            cached = tensor.to(device, non_blocking=True)
            self._by_device[cache_key] = cached
        return cached

    def rows_on(self, device: torch.device | str) -> torch.Tensor:
        """The row index on `device` (copied there once, then reused)."""
        return self._on("rows", self.rows, torch.device(device))

    @property
    def runs(self) -> list[tuple[int, int]]:
        """The selected rows as maximal `(start, stop)` runs of consecutive rows, in order.

        Neighbouring requests merge: selecting every request of a step is a single run.
        """
        if self._runs is None:
            if self._rows is None:  # whole requests: from the layout's starts and counts
                self._runs = maximal_runs(self._starts(), self.counts)
            elif len(self._rows) == 0:
                self._runs = []
            else:
                breaks = ((self.rows[1:] - self.rows[:-1]) != 1).nonzero().squeeze(1) + 1
                edges = [0, *breaks.tolist(), len(self.rows)]
                starts = self.rows.index_select(0, torch.tensor(edges[:-1])).tolist()
                lengths = [stop - begin for begin, stop in pairwise(edges)]
                self._runs = [(start, start + n) for start, n in zip(starts, lengths, strict=True)]
        return self._runs

    def _by_runs(self, device: torch.device) -> bool:
        """Whether slicing run by run beats one indexed kernel for this selection.

        One run is always a slice. On CPU, torch's index_add_/index_copy_ are much slower per
        byte than slice copies (measured: 5x for 32-row runs of 4096 floats, see
        docs/benchmarks/tokenspan.md), so long runs are sliced there; on GPUs one kernel beats a
        launch per run.
        """
        runs = self.runs
        if not runs:
            return False
        return len(runs) == 1 or (device.type == "cpu" and len(self) >= RUN_ROWS * len(runs))

    def reads(self) -> list[RunRead]:
        """Where to read a value once for every selected request, and how to cut each read.

        One `RunRead` per maximal run of adjacent selected rows (neighbouring requests merge),
        in slab order — or, when there are several runs and the selection holds at least half
        of the step's `layout.total` rows, a single read over the whole step, `Span(0, total)`:
        one copy of at most twice what is kept beats many small ones. Read the value over each
        `read.span`, then `read.pieces(value, axis)` gives `read.keys`' rows as views.

        For selections of whole requests (`layout.select(keys)`, or a mapping whose requests
        are selected with all their rows): a request with only some of its rows selected raises
        `SpanError`, since its rows would not be one piece. Requests with no rows this step are
        not selected, so they are in no read. Built from the layout's starts and counts, without
        tensors.
        """
        if self._rows is not None:  # built from positions: check that each request is whole
            layout_counts = self.layout.counts
            for key, count, index in zip(self.keys, self.counts, self._request_indices(),
                                         strict=True):
                if count != layout_counts[index]:
                    raise SpanError(
                        f"reads() plans reads of whole requests, but this selection holds "
                        f"{count} of the {layout_counts[index]} rows of request {key!r}; select "
                        "whole requests (layout.select(keys)), or use gather and split for "
                        "chosen positions"
                    )
        return plan_reads(self.keys, self._starts(), self.counts, self.layout.total)

    def _starts(self) -> list[int]:
        """Each selected request's first row in the slab (the layout's, not the selection's)."""
        starts = self.layout.starts
        return [starts[i] for i in self._request_indices()]

    def _selected_shape(self, whole: torch.Tensor, axis: int) -> tuple[int, ...]:
        shape = list(whole.shape)
        shape[axis] = len(self)
        return tuple(shape)

    def gather(self, whole: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        """A new tensor of the selected rows (every request's, back to back)."""
        axis = require_token_axis(whole, self.layout, axis)
        if self._by_runs(whole.device):
            pieces = [whole.narrow(axis, start, stop - start) for start, stop in self.runs]
            return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim=axis)
        return whole.index_select(axis, self.rows_on(whole.device))

    def split(self, gathered: torch.Tensor, axis: int = 0) -> dict[Key, torch.Tensor]:
        """Cut a gathered tensor (or any `[rows, ...]` result) into per-request views."""
        return dict(zip(self.keys, torch.split(gathered, list(self.counts), dim=axis),
                        strict=True))

    def per_row(self, per_request: torch.Tensor) -> torch.Tensor:
        """Expand `[len(keys), ...]` values, one per selected request, to one per selected row."""
        if per_request.shape[0] != len(self.keys):
            raise SpanShapeError(
                f"expected one value per selected request ({len(self.keys)}), got a tensor of "
                f"shape {tuple(per_request.shape)}"
            )
        return per_request.index_select(0, self._on("owners", self.owners, per_request.device))

    def scatter(self, whole: torch.Tensor, part: torch.Tensor, axis: int | None = None) -> None:
        """Write `part` (shaped like `gather`'s result) into the selected rows.

        The shape is checked before anything is written.
        """
        axis = require_token_axis(whole, self.layout, axis)
        expected = self._selected_shape(whole, axis)
        if tuple(part.shape) != expected:
            raise SpanShapeError(
                f"expected shape {expected} for {len(self)} selected rows of "
                f"{len(self.keys)} requests, got {tuple(part.shape)}"
            )
        part = part.to(whole.dtype)
        if self._by_runs(whole.device):
            self._each_run(whole, part, axis, torch.Tensor.copy_)
        else:
            whole.index_copy_(axis, self.rows_on(whole.device), part)

    def add(self, whole: torch.Tensor, delta: torch.Tensor, axis: int | None = None) -> None:
        """Add `delta` to the selected rows.

        `delta` is anything that broadcasts to the selected rows' shape: one vector for every
        row (`[hidden]`), or one per row (`[rows, hidden]`, e.g. from `per_row`).
        """
        axis = require_token_axis(whole, self.layout, axis)
        expected = self._selected_shape(whole, axis)
        try:
            delta = delta.to(whole.dtype).expand(expected)
        except RuntimeError as error:
            raise SpanShapeError(
                f"cannot broadcast a delta of shape {tuple(delta.shape)} to the {len(self)} "
                f"selected rows {expected}"
            ) from error
        if self._by_runs(whole.device):
            self._each_run(whole, delta, axis, torch.Tensor.add_)
        else:
            whole.index_add_(axis, self.rows_on(whole.device), delta)

    def _each_run(self, whole: torch.Tensor, part: torch.Tensor, axis: int,
                  apply: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
        offset = 0
        for start, stop in self.runs:
            apply(whole.narrow(axis, start, stop - start), part.narrow(axis, offset, stop - start))
            offset += stop - start


def _parse_wanted(
    layout: StepLayout, wanted: Iterable[Key] | Mapping[Key, Iterable[int] | None] | None
) -> tuple[list[int], list[int], list[int]]:
    """Split a selection request into whole requests and `(position, request)` pairs.

    Plain Python (C-level loops where possible), so the tensor work that follows is a fixed
    handful of kernels however many requests there are. Keys absent from the step are skipped.
    """
    index_of = layout.index_map
    if wanted is None:
        return list(range(len(layout))), [], []
    if not isinstance(wanted, Mapping):
        return [i for i in map(index_of.get, wanted) if i is not None], [], []
    whole_requests: list[int] = []
    position_lists: list[int] = []
    position_owners: list[int] = []
    for key, positions in wanted.items():
        index = index_of.get(key)
        if index is None:
            continue  # not scheduled this step: nothing of it to select
        if positions is None:
            whole_requests.append(index)
            continue
        before = len(position_lists)
        position_lists.extend(positions)
        position_owners.extend(repeat(index, len(position_lists) - before))
    return whole_requests, position_lists, position_owners


def _selected_rows(
    layout: StepLayout, whole_requests: list[int], position_lists: list[int],
    position_owners: list[int],
) -> torch.Tensor:
    """The selected slab rows, ascending: every row of `whole_requests` (slab-order indices) and
    the rows of the wanted positions present this step, one int64 tensor."""
    # index_select / index_fill_ rather than advanced indexing: on a busy CPU the latter can
    # cost milliseconds where these take microseconds.
    wanted_whole = torch.zeros(len(layout), dtype=torch.bool)
    wanted_whole.index_fill_(0, torch.tensor(whole_requests, dtype=torch.long), True)
    selected = wanted_whole.index_select(0, layout.row_owners())
    if position_lists:
        owners = torch.tensor(position_owners, dtype=torch.long)
        offset = _absolute_positions(position_lists, owners, layout) - layout.tensor(
            "first_positions").index_select(0, owners)
        present = (offset >= 0) & (offset < layout.tensor("counts").index_select(0, owners))
        rows = layout.tensor("starts").index_select(0, owners) + offset
        selected.index_fill_(0, rows.masked_select(present), True)
    return selected.nonzero().squeeze(1)


def _absolute_positions(
    positions: list[int], owners: torch.Tensor, layout: StepLayout
) -> torch.Tensor:
    """Wanted positions as one int64 tensor, refusing fractions and negatives by request."""
    tensor = torch.tensor(positions)
    if tensor.is_floating_point() or tensor.dtype == torch.bool:
        raise LayoutError(f"positions must be integers, got {tensor.dtype} values")
    negative = (tensor < 0).nonzero()
    if len(negative):
        first = int(negative[0])
        key = layout.keys[int(owners[first])]
        raise LayoutError(
            f"request {key!r}: positions must be absolute (>= 0), got {positions[first]}; "
            "resolve positions counted from the end against the prompt length first"
        )
    return tensor.long()
