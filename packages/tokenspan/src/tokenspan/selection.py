"""`Selection`: the rows of many requests as one index, so an op over hundreds is a few kernels."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from itertools import pairwise, repeat
from typing import TYPE_CHECKING

import torch

from tokenspan.axis import require_token_axis
from tokenspan.errors import LayoutError, SpanShapeError

if TYPE_CHECKING:
    from tokenspan.layout import StepLayout

Key = Hashable

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
    """

    __slots__ = ("_by_device", "_owners", "_positions", "_runs", "counts", "keys", "layout",
                 "rows")

    def __init__(
        self, layout: StepLayout, keys: tuple[Key, ...], counts: tuple[int, ...], rows: torch.Tensor
    ) -> None:
        self.layout = layout
        self.keys = keys
        self.counts = counts
        self.rows = rows
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
        row_owners = layout._row_owners()
        # index_select / index_fill_ rather than advanced indexing: on a busy CPU the latter can
        # cost milliseconds where these take microseconds.
        wanted_whole = torch.zeros(len(layout), dtype=torch.bool)
        wanted_whole.index_fill_(0, torch.tensor(whole_requests, dtype=torch.long), True)
        selected = wanted_whole.index_select(0, row_owners)
        if position_lists:
            owners = torch.tensor(position_owners, dtype=torch.long)
            offset = _absolute_positions(position_lists, owners, layout) - layout._tensor(
                "first_positions", None).index_select(0, owners)
            present = (offset >= 0) & (offset < layout._tensor("counts", None).index_select(
                0, owners))
            rows = layout._tensor("starts", None).index_select(0, owners) + offset
            selected.index_fill_(0, rows.masked_select(present), True)
        rows = selected.nonzero().squeeze(1)

        if position_lists:
            per_request = torch.bincount(row_owners.index_select(0, rows), minlength=len(layout))
            chosen = per_request.nonzero().squeeze(1).tolist()
            counts = tuple(per_request.index_select(0, torch.tensor(chosen, dtype=torch.long))
                           .tolist())
        else:  # whole requests only: their counts are known without looking at rows
            all_counts = layout.counts
            chosen = [i for i in sorted(set(whole_requests)) if all_counts[i]]
            counts = tuple(map(all_counts.__getitem__, chosen))
        selection = cls(layout, tuple(map(layout.keys.__getitem__, chosen)), counts, rows)
        if device is not None:
            selection.rows_on(device)
        return selection

    @property
    def positions(self) -> torch.Tensor:
        """The absolute position of each selected row (int64, on the host)."""
        if self._positions is None:
            self._positions = self.layout._row_positions().index_select(0, self.rows)
        return self._positions

    @property
    def owners(self) -> torch.Tensor:
        """For each selected row, the index into `keys` of its request (int64, on the host)."""
        if self._owners is None:
            self._owners = torch.repeat_interleave(
                torch.arange(len(self.keys)), torch.tensor(self.counts, dtype=torch.long),
                output_size=len(self.rows),
            )
        return self._owners

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"Selection({len(self.keys)} requests, {len(self)} rows)"

    def _on(self, name: str, device: torch.device) -> torch.Tensor:
        """A selection tensor (`rows` or `owners`) on `device`, copied there at most once."""
        tensor = getattr(self, name)
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
        return self._on("rows", torch.device(device))

    def _selected_shape(self, whole: torch.Tensor, axis: int) -> tuple[int, ...]:
        shape = list(whole.shape)
        shape[axis] = len(self)
        return tuple(shape)

    @property
    def runs(self) -> list[tuple[int, int]]:
        """The selected rows as maximal `(start, stop)` runs of consecutive rows, in order.

        Neighbouring requests merge: selecting every request of a step is a single run.
        """
        if self._runs is None:
            if len(self.rows) == 0:
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
        return len(runs) == 1 or (device.type == "cpu" and len(self.rows) >= RUN_ROWS * len(runs))

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
        return dict(zip(self.keys, torch.split(gathered, self.counts, dim=axis), strict=True))

    def per_row(self, per_request: torch.Tensor) -> torch.Tensor:
        """Expand `[len(keys), ...]` values, one per selected request, to one per selected row."""
        if per_request.shape[0] != len(self.keys):
            raise SpanShapeError(
                f"expected one value per selected request ({len(self.keys)}), got a tensor of "
                f"shape {tuple(per_request.shape)}"
            )
        return per_request.index_select(0, self._on("owners", per_request.device))

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
    index_of = layout._index
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
