"""`Selection`: the rows of many requests as one index, so an op over hundreds is a few kernels."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from tokenspan.axis import require_token_axis
from tokenspan.errors import LayoutError, SpanShapeError

if TYPE_CHECKING:
    from tokenspan.layout import StepLayout

Key = Hashable


class Selection:
    """Chosen rows of chosen requests in one step, grouped by request in slab order.

    Built by `StepLayout.select`. Instead of a Python loop over requests (one narrow, one
    kernel each), an op applied to every selected row is one `index_select`, `index_copy_` or
    `index_add_` on the slab. Index tensors are built once on the host and copied to a device
    at most once per device.

    Attributes: `keys` (selected requests present this step, in slab order), `counts` (rows
    selected per key), `rows` (int64 slab rows, ascending), `positions` (absolute position of
    each selected row), `owners` (index into `keys` of each selected row).
    """

    __slots__ = ("_by_device", "counts", "keys", "layout", "owners", "positions", "rows")

    def __init__(
        self,
        layout: StepLayout,
        keys: tuple[Key, ...],
        counts: tuple[int, ...],
        rows: torch.Tensor,
        positions: torch.Tensor,
        owners: torch.Tensor,
    ) -> None:
        self.layout = layout
        self.keys = keys
        self.counts = counts
        self.rows = rows
        self.positions = positions
        self.owners = owners
        self._by_device: dict[tuple[str, str], torch.Tensor] = {}

    @classmethod
    def build(
        cls,
        layout: StepLayout,
        wanted: Iterable[Key] | Mapping[Key, Iterable[int] | None] | None,
        device: torch.device | str | None = None,
    ) -> Selection:
        """Select rows; see `StepLayout.select` for what `wanted` may be."""
        if wanted is None:
            wanted = layout.keys
        if not isinstance(wanted, Mapping):
            wanted = dict.fromkeys(wanted)
        request_of_row = layout.request_indices()
        whole_requests = torch.zeros(len(layout), dtype=torch.bool)
        position_lists: list[int] = []
        position_owners: list[int] = []
        for key, positions in wanted.items():
            if key not in layout:
                continue  # not scheduled this step: nothing of it to select
            index = layout.index(key)
            if positions is None:
                whole_requests[index] = True
                continue
            positions = [int(p) for p in positions]
            if positions and min(positions) < 0:
                raise LayoutError(
                    f"request {key!r}: positions must be absolute (>= 0), got {min(positions)}; "
                    "resolve positions counted from the end against the prompt length first"
                )
            position_lists.extend(positions)
            position_owners.extend([index] * len(positions))
        selected = whole_requests[request_of_row]
        if position_lists:
            wanted_positions = torch.tensor(position_lists, dtype=torch.long)
            owners = torch.tensor(position_owners, dtype=torch.long)
            first = layout._tensor("first_positions", None)[owners]
            offset = wanted_positions - first
            present = (offset >= 0) & (offset < layout._tensor("counts", None)[owners])
            rows = layout._tensor("starts", None)[owners] + offset
            selected[rows[present]] = True
        rows = selected.nonzero().squeeze(1)
        request_index = request_of_row[rows]
        per_request = torch.bincount(request_index, minlength=len(layout))
        chosen = per_request.nonzero().squeeze(1)
        keys = tuple(layout.keys[i] for i in chosen.tolist())
        counts = tuple(per_request[chosen].tolist())
        owner_in_selection = torch.repeat_interleave(
            torch.arange(len(keys)), per_request[chosen], output_size=len(rows)
        )
        selection = cls(layout, keys, counts, rows, layout.positions()[rows], owner_in_selection)
        if device is not None:
            selection.rows_on(device)
        return selection

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"Selection({len(self.keys)} requests, {len(self)} rows)"

    def _on(self, name: str, device: torch.device) -> torch.Tensor:
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

    def gather(self, whole: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        """A new tensor of the selected rows (every request's, back to back), in one kernel."""
        axis = require_token_axis(whole, self.layout, axis)
        return whole.index_select(axis, self.rows_on(whole.device))

    def split(self, gathered: torch.Tensor, axis: int = 0) -> dict[Key, torch.Tensor]:
        """Cut a gathered tensor (or any `[rows, ...]` result) into per-request views."""
        return dict(zip(self.keys, torch.split(gathered, self.counts, dim=axis)))

    def per_row(self, per_request: torch.Tensor) -> torch.Tensor:
        """Expand `[len(keys), ...]` values, one per selected request, to one per selected row."""
        if per_request.shape[0] != len(self.keys):
            raise SpanShapeError(
                f"expected one value per selected request ({len(self.keys)}), got a tensor of "
                f"shape {tuple(per_request.shape)}"
            )
        return per_request.index_select(0, self._on("owners", per_request.device))

    def scatter(self, whole: torch.Tensor, part: torch.Tensor, axis: int | None = None) -> None:
        """Write `part` (shaped like `gather`'s result) into the selected rows, in one kernel."""
        axis = require_token_axis(whole, self.layout, axis)
        expected = self._selected_shape(whole, axis)
        if tuple(part.shape) != expected:
            raise SpanShapeError(
                f"expected shape {expected} for {len(self)} selected rows of "
                f"{len(self.keys)} requests, got {tuple(part.shape)}"
            )
        whole.index_copy_(axis, self.rows_on(whole.device), part.to(whole.dtype))

    def add(self, whole: torch.Tensor, delta: torch.Tensor, axis: int | None = None) -> None:
        """Add `delta` to the selected rows in one kernel.

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
        whole.index_add_(axis, self.rows_on(whole.device), delta)
