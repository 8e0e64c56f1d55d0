"""`StepLayout`: which rows of one step's token slab belong to which request."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

import torch

from tokenspan.axis import require_token_axis
from tokenspan.errors import LayoutError
from tokenspan.selection import Selection
from tokenspan.span import Key, Span

#: The per-request columns of a layout that `StepLayout.tensor` serves as int64 tensors.
Column = Literal["starts", "counts", "first_positions"]


def _ints(values: Any, what: str) -> list[int]:
    """Plain ints from a list, tuple, numpy array or tensor (engines hand over all of these).

    Floats are refused rather than truncated: a fractional row count is a caller's bug.
    """
    if hasattr(values, "tolist"):  # tensors and numpy arrays, without importing numpy
        integral = _integral(getattr(values, "dtype", None))
        values = values.tolist()
        if integral:  # plain ints already: no check per value (engines call this every step)
            return values  # type: ignore[no-any-return]
    try:
        return [operator.index(v) for v in values]
    except TypeError as error:
        raise LayoutError(f"{what} must be a sequence of integers, got {values!r}") from error


def _integral(dtype: Any) -> bool:
    """Whether a numpy or torch dtype holds integers (not booleans): its `tolist` gives ints."""
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return getattr(dtype, "kind", None) in ("i", "u")


class StepLayout:
    """The request order and row ranges of one step's flat token slab.

    An engine with continuous batching runs the tokens of many requests as one slab of rows,
    request after request, possibly followed by padding rows (CUDA graphs pad to a bucket size).
    A layout records, for each request key in slab order, its rows and the absolute position of
    its first row. It is validated on construction: spans are contiguous from row 0, in order,
    disjoint, of non-negative length, and end within the padded total. Errors name the offending
    request, because a row given to the wrong request is a silently wrong result downstream.

    Build it from what the engine has: `from_counts` (tokens per request), `from_offsets`
    (cumulative offsets such as vLLM's `query_start_loc`) or `from_spans` (explicit row ranges).
    """

    __slots__ = ("_counts", "_device_cache", "_first_positions", "_index", "_index_view",
                 "_keys", "_padded_total", "_starts", "_total")

    def __init__(
        self,
        keys: Sequence[Key],
        starts: Sequence[int],
        counts: Sequence[int],
        first_positions: Sequence[int],
        padded_total: int | None,
    ) -> None:
        """Store an already-validated layout; use the `from_*` constructors instead."""
        self._keys = tuple(keys)
        self._starts = tuple(starts)
        self._counts = tuple(counts)
        self._first_positions = tuple(first_positions)
        self._total = self._starts[-1] + self._counts[-1] if self._keys else 0
        self._padded_total = self._total if padded_total is None else int(padded_total)
        self._index = dict(zip(self._keys, range(len(self._keys)), strict=True))
        self._index_view = MappingProxyType(self._index)
        self._device_cache: dict[tuple[str, str], torch.Tensor] = {}

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_counts(
        cls,
        keys: Sequence[Key],
        counts: Sequence[int] | Any,
        first_positions: Sequence[int] | Any | None = None,
        padded_total: int | None = None,
    ) -> StepLayout:
        """A layout from each request's token count this step, requests back to back from row 0.

        `first_positions[i]` is the absolute position of request i's first row this step (its
        tokens already computed); it defaults to 0 for every request, i.e. a whole prompt.
        `padded_total` is the slab's row count including trailing padding (default: no padding).
        """
        keys = tuple(keys)
        counts = _ints(counts, "counts")
        _check_lengths(keys, counts, "counts")
        for i, count in enumerate(counts):
            if count < 0:
                raise LayoutError(
                    f"request {keys[i]!r} (index {i}) has a negative token count ({count}); "
                    "counts must be >= 0"
                )
        starts, running = [], 0
        for count in counts:
            starts.append(running)
            running += count
        return cls._validated(keys, starts, counts, first_positions, padded_total)

    @classmethod
    def from_offsets(
        cls,
        keys: Sequence[Key],
        offsets: Sequence[int] | Any,
        first_positions: Sequence[int] | Any | None = None,
        padded_total: int | None = None,
    ) -> StepLayout:
        """A layout from cumulative row offsets: request i owns rows `offsets[i]:offsets[i+1]`.

        `offsets` has one more entry than `keys` and starts at 0, like vLLM's `query_start_loc`
        (pass its first `num_reqs + 1` entries: the rest is padding).
        """
        keys = tuple(keys)
        offsets = _ints(offsets, "offsets")
        if len(offsets) != len(keys) + 1:
            raise LayoutError(
                f"offsets must have one entry more than keys: got {len(keys)} keys and "
                f"{len(offsets)} offsets"
            )
        if offsets[0] != 0:
            raise LayoutError(
                f"offsets must start at 0, got {offsets[0]}: rows 0:{offsets[0]} would belong "
                "to no request (a gap)"
            )
        # Engines call this every step: one pass for the counts, the culprit looked for only
        # when one is negative.
        counts = list(map(operator.sub, offsets[1:], offsets))
        if counts and min(counts) < 0:
            i = next(i for i, count in enumerate(counts) if count < 0)
            raise LayoutError(
                f"request {keys[i]!r} (index {i}) has a negative token count ({counts[i]}): its "
                f"offsets go from {offsets[i]} down to {offsets[i + 1]}"
            )
        return cls._validated(keys, offsets[:-1], counts, first_positions, padded_total)

    @classmethod
    def from_spans(
        cls,
        keys: Sequence[Key],
        spans: Sequence[Span | tuple[int, int] | tuple[int, int, int]],
        padded_total: int | None = None,
    ) -> StepLayout:
        """A layout from explicit spans (or `(start, stop[, first_position])` tuples), in order.

        This is the constructor that can be handed an inconsistent picture, so it names which
        request overlaps, leaves a gap before it, or comes out of order.
        """
        keys = tuple(keys)
        given = [span if isinstance(span, Span) else Span(*span) for span in spans]
        _check_lengths(keys, given, "spans")
        previous: tuple[Key, Span] | None = None
        for i, (key, span) in enumerate(zip(keys, given, strict=True)):
            if previous is None:
                if span.start != 0:
                    raise LayoutError(
                        f"request {key!r} (index 0) starts at row {span.start}: rows "
                        f"0:{span.start} belong to no request (a gap); the first span must "
                        "start at row 0"
                    )
            else:
                prev_key, prev = previous
                if span.start < prev.start:
                    raise LayoutError(
                        f"request {key!r} (index {i}) starts at row {span.start}, before the "
                        f"previous request {prev_key!r} (row {prev.start}): spans must be given "
                        "in row order"
                    )
                if span.start < prev.stop:
                    raise LayoutError(
                        f"request {key!r} (index {i}, rows {span.start}:{span.stop}) overlaps "
                        f"request {prev_key!r} (rows {prev.start}:{prev.stop}) by "
                        f"{prev.stop - span.start} rows"
                    )
                if span.start > prev.stop:
                    raise LayoutError(
                        f"request {key!r} (index {i}) starts at row {span.start} but the "
                        f"previous request {prev_key!r} ends at row {prev.stop}: rows "
                        f"{prev.stop}:{span.start} belong to no request (a gap)"
                    )
            previous = (key, span)
        return cls._validated(
            keys,
            [span.start for span in given],
            [len(span) for span in given],
            [span.first_position for span in given],
            padded_total,
        )

    @classmethod
    def _validated(
        cls,
        keys: tuple[Key, ...],
        starts: Sequence[int],
        counts: Sequence[int],
        first_positions: Sequence[int] | Any | None,
        padded_total: int | None,
    ) -> StepLayout:
        if len(set(keys)) != len(keys):
            seen: set[Key] = set()
            for key in keys:
                if key in seen:
                    raise LayoutError(f"request {key!r} appears more than once in the layout")
                seen.add(key)
        if first_positions is None:
            positions = [0] * len(keys)
        else:
            positions = _ints(first_positions, "first_positions")
            _check_lengths(keys, positions, "first_positions")
            if positions and min(positions) < 0:
                i = next(i for i, position in enumerate(positions) if position < 0)
                raise LayoutError(
                    f"request {keys[i]!r} (index {i}) has a negative first position "
                    f"({positions[i]})"
                )
        total = starts[-1] + counts[-1] if keys else 0
        if padded_total is not None and padded_total < total:
            culprit = next(i for i in range(len(keys)) if starts[i] + counts[i] > padded_total)
            raise LayoutError(
                f"request {keys[culprit]!r} (index {culprit}) ends at row "
                f"{starts[culprit] + counts[culprit]}, beyond the padded total of "
                f"{padded_total} rows"
            )
        return cls(keys, starts, counts, positions, padded_total)

    # ------------------------------------------------------------------ lookups

    @property
    def keys(self) -> tuple[Key, ...]:
        """Request keys in slab order."""
        return self._keys

    @property
    def counts(self) -> tuple[int, ...]:
        """Rows each request owns this step, in slab order."""
        return self._counts

    @property
    def starts(self) -> tuple[int, ...]:
        """First row of each request, in slab order."""
        return self._starts

    @property
    def first_positions(self) -> tuple[int, ...]:
        """Absolute position of each request's first row, in slab order."""
        return self._first_positions

    @property
    def total(self) -> int:
        """Rows that belong to some request (padding excluded)."""
        return self._total

    @property
    def padded_total(self) -> int:
        """Rows in the slab including trailing padding; equal to `total` when unpadded."""
        return self._padded_total

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[Key]:
        return iter(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    @property
    def index_map(self) -> Mapping[Key, int]:
        """Each request key's index in slab order, as a read-only mapping.

        For bulk lookups (`map(layout.index_map.get, keys)` skips absent keys with `None`);
        `index` is the one-key lookup that names the known keys when one is absent.
        """
        return self._index_view

    def index(self, key: Key) -> int:
        """The request's place in slab order; `KeyError` naming known keys if absent."""
        try:
            return self._index[key]
        except KeyError:
            known = ", ".join(repr(k) for k in self._keys[:8])
            more = f" and {len(self._keys) - 8} more" if len(self._keys) > 8 else ""
            raise KeyError(
                f"request {key!r} is not in this step's layout (requests: {known or 'none'}"
                f"{more})"
            ) from None

    def __getitem__(self, key: Key) -> Span:
        i = self.index(key)
        start = self._starts[i]
        return Span(start, start + self._counts[i], self._first_positions[i])

    def items(self) -> Iterator[tuple[Key, Span]]:
        """`(key, span)` pairs in slab order."""
        for key in self._keys:
            yield key, self[key]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepLayout):
            return NotImplemented
        return (self._keys, self._starts, self._counts, self._first_positions,
                self._padded_total) == (other._keys, other._starts, other._counts,
                                        other._first_positions, other._padded_total)

    def __hash__(self) -> int:
        return hash((self._keys, self._counts, self._first_positions, self._padded_total))

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{key!r}: {start}:{start + count}@{first}"
            for key, start, count, first in zip(
                self._keys[:6], self._starts[:6], self._counts[:6], self._first_positions[:6],
                strict=True,
            )
        )
        more = f", ... {len(self._keys) - 6} more" if len(self._keys) > 6 else ""
        return f"StepLayout({{{shown}{more}}}, total={self._total}, padded={self._padded_total})"

    # ------------------------------------------------------------------ vectorised views
    #
    # `tensor`, `row_owners` and `row_positions` hand out the layout's own cached tensors, built
    # once per layout (and device): treat them as read-only. `request_indices` and `positions`
    # are the same values as fresh copies, for callers that keep or modify them.

    def tensor(self, name: Column, device: torch.device | str | None = None) -> torch.Tensor:
        """A per-request column (`"starts"`, `"counts"` or `"first_positions"`) as an int64
        tensor of `len(self)` entries on `device` (default: the host), cached per device.

        The tensor is the layout's own: do not modify it.
        """
        device_key = str(torch.device(device) if device is not None else torch.device("cpu"))
        cache_key = (name, device_key)
        cached = self._device_cache.get(cache_key)
        if cached is None:
            columns = {"starts": self._starts, "counts": self._counts,
                       "first_positions": self._first_positions}
            # (non-blocking: a plain copy to a GPU waits for everything queued there first)
            cached = torch.tensor(columns[name], dtype=torch.long).to(device_key,
                                                                     non_blocking=True)
            self._device_cache[cache_key] = cached
        return cached

    def row_owners(self) -> torch.Tensor:
        """For each of the `total` rows, the slab-order index of its request (int64, host).

        Built once per layout and shared: do not modify it (`request_indices` gives a copy).
        """
        cached = self._device_cache.get(("row_owners", "cpu"))
        if cached is None:
            counts = self.tensor("counts")
            cached = torch.repeat_interleave(torch.arange(len(self)), counts,
                                             output_size=self._total)
            self._device_cache[("row_owners", "cpu")] = cached
        return cached

    def row_positions(self) -> torch.Tensor:
        """The absolute position of each of the `total` rows (int64, host).

        Built once per layout and shared: do not modify it (`positions` gives a copy).
        """
        cached = self._device_cache.get(("row_positions", "cpu"))
        if cached is None:
            shift = self.tensor("first_positions") - self.tensor("starts")
            cached = torch.arange(self._total) + shift.index_select(0, self.row_owners())
            self._device_cache[("row_positions", "cpu")] = cached
        return cached

    def request_indices(self, device: torch.device | str | None = None) -> torch.Tensor:
        """For each of the `total` rows, the slab-order index of the request that owns it."""
        return self.row_owners().to(device, copy=True, non_blocking=True)

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The absolute position of each of the `total` rows (padding excluded), one kernel pass."""
        return self.row_positions().to(device, copy=True, non_blocking=True)

    def split(self, value: torch.Tensor, axis: int | None = None) -> dict[Key, torch.Tensor]:
        """Cut a slab into per-request views along its token axis, in one call (padding dropped).

        The views share storage with `value`: in-place edits land in the slab.
        """
        axis = require_token_axis(value, self, axis)
        real = value.narrow(axis, 0, self._total)
        return dict(zip(self._keys, torch.split(real, list(self._counts), dim=axis),
                        strict=True))

    def select(
        self,
        wanted: Iterable[Key] | Mapping[Key, Iterable[int] | None] | None = None,
        device: torch.device | str | None = None,
    ) -> Selection:
        """Rows of many requests at once, as one index: see `tokenspan.Selection`.

        `wanted` is an iterable of keys (all their rows), or a mapping from key to the absolute
        positions wanted (`None` for all rows); positions not in this step are left out, so the
        same mapping can be used at every step. `None` selects every request.
        """
        return Selection.build(self, wanted, device)


def _check_lengths(keys: Sequence[Key], values: Sequence[Any], what: str) -> None:
    if len(values) != len(keys):
        raise LayoutError(f"got {len(keys)} keys but {len(values)} {what}; they must pair up")
