"""The sharded rules, `Shard` and `Stacked`: values reassembled by one all-gather.

A sharded value is cut along one dimension. `Part` describes one logical value along it (its
length, its units such as heads, and any padding the engine appends); a rule turns its parts
into a `_Plan` per group size — which rank holds which entries — computed once and reused, so a
visit costs one all-gather and one concatenation.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .errors import FragmentError, GroupSizeError, PieceShapeError, WholeShapeError
from .group import Group
from .rules import Rule, Shape, _axis, _check_rank, _with

__all__ = ["Part", "Shard", "Stacked"]


@dataclass(frozen=True)
class Part:
    """One logical value inside a `Stacked` layout.

    Args:
        size: its length along the stacked dimension in the whole (e.g. `heads * head_dim`).
        units: the indivisible blocks it is cut into, e.g. its heads. When a group has more
            ranks than units, each unit is held by `ranks // units` consecutive ranks (vLLM
            replicates KV heads this way); `None` means any even cut will do.
        padding: entries the engine appends after the `size` real ones before sharding (vLLM
            pads a vocabulary to a multiple of 64). The whole drops them; a split fills them
            with zeros.
    """

    size: int
    units: int | None = None
    padding: int = 0

    def __post_init__(self) -> None:
        if self.size < 0 or self.padding < 0:
            raise ValueError(f"{self!r}: size and padding must be non-negative")
        if self.units is not None:
            if self.units < 1:
                raise ValueError(f"{self!r}: units must be at least 1")
            if self.padded % self.units:
                raise ValueError(
                    f"{self!r}: {self.units} units do not divide the padded length {self.padded}"
                )

    @property
    def padded(self) -> int:
        """The part's length in the engine's layout, padding included."""
        return self.size + self.padding

    def __repr__(self) -> str:
        extras = "".join(
            f", {name}={value}" for name, value in (("units", self.units),
                                                    ("padding", self.padding or None))
            if value is not None
        )
        return f"Part({self.size}{extras})"


@dataclass(frozen=True)
class _PartLayout:
    """A `Part` laid out over a group: `chunks` chunks of `chunk` entries, each on `replicas`
    consecutive ranks (rank r holds chunk `r // replicas`)."""

    chunks: int
    chunk: int
    replicas: int


class _Indivisible(Exception):
    """Internal: a group size that does not divide a part; turned into `GroupSizeError`."""


def _lay_out(part: Part, size: int) -> _PartLayout:
    if part.units is None:
        if part.padded % size:
            raise _Indivisible(f"a group of {size} ranks does not divide length {part.padded}")
        return _PartLayout(size, part.padded // size, 1)
    if part.units >= size:
        if part.units % size:
            raise _Indivisible(f"a group of {size} ranks does not divide {part.units} units")
        return _PartLayout(size, part.padded // size, 1)
    if size % part.units:
        raise _Indivisible(
            f"{part.units} units cannot be replicated evenly over a group of {size} ranks"
        )
    return _PartLayout(part.units, part.padded // part.units, size // part.units)


class _Segment(NamedTuple):
    """Entries `start:start + length` of rank `holder`'s piece: one segment of the whole."""

    holder: int
    start: int
    length: int


class _Slot(NamedTuple):
    """`length` entries of a rank's piece: the whole's from `start`, or padding if `start` is -1."""

    start: int
    length: int


@dataclass(frozen=True)
class _Plan:
    """Where every entry of the sharded dimension lives, for one group size.

    `gather` lists, in the whole's order, `(holder rank, start in its piece, length)`: the
    segments to concatenate (one holder per replicated unit; padding left out). `split[r]`
    lists, in rank r's piece order, `(start in the whole, length)`, with start -1 for padding.
    Computed once per size, so a visit costs one concatenation, not a walk over the parts.
    """

    piece_length: int
    whole_length: int
    gather: tuple[_Segment, ...]
    split: tuple[tuple[_Slot, ...], ...]


class _Resolved(NamedTuple):
    """A value's shape checked against a rule for one group size: the sharded `axis`, the
    `plan`, and the shape of the other side (the whole for a piece, a piece for a whole)."""

    axis: int
    plan: _Plan
    shape: torch.Size


def _plan(parts: Sequence[Part], size: int) -> _Plan:
    gather: list[_Segment] = []
    split: list[list[_Slot]] = [[] for _ in range(size)]
    piece_offset = whole_offset = 0
    for part in parts:
        layout = _lay_out(part, size)
        for chunk in range(layout.chunks):
            # Only the real entries: the tail chunk(s) may hold padding, which the whole drops.
            length = min(layout.chunk, part.size - chunk * layout.chunk)
            if length > 0:
                gather.append(_Segment(chunk * layout.replicas, piece_offset, length))
        for rank in range(size):
            start = (rank // layout.replicas) * layout.chunk
            length = max(0, min(layout.chunk, part.size - start))
            if length:
                split[rank].append(_Slot(whole_offset + start, length))
            if length < layout.chunk:
                split[rank].append(_Slot(-1, layout.chunk - length))
        piece_offset += layout.chunk
        whole_offset += part.size
    return _Plan(piece_offset, whole_offset, tuple(gather), tuple(map(tuple, split)))


def _concatenate(segments: list[Tensor], axis: int, like: Tensor, shape: torch.Size) -> Tensor:
    """One new tensor from `segments` along `axis` (one kernel), or an empty one of `shape`."""
    if not segments:
        return like.new_empty(shape)
    if len(segments) == 1:
        return segments[0].clone(memory_format=torch.contiguous_format)
    return torch.cat(segments, dim=axis)


class _Gathered(Rule):
    """A rule whose whole is reassembled from every rank's piece by one all-gather."""

    collective = "all_gather"

    @abstractmethod
    def _resolve_piece(self, piece_shape: Shape, size: int, location: str | None
                       ) -> _Resolved:
        """The axis, plan and whole shape for a piece of `piece_shape`; raises if it does not
        fit."""

    @abstractmethod
    def _resolve_whole(self, whole_shape: Shape, size: int, location: str | None
                       ) -> _Resolved:
        """The axis, plan and piece shape for a whole of `whole_shape`; raises if it does not
        fit."""

    def whole_shape(self, piece_shape: Shape, size: int, *, location: str | None = None
                    ) -> torch.Size:
        return self._resolve_piece(piece_shape, size, location).shape

    def piece_shape(self, whole_shape: Shape, size: int, *, location: str | None = None
                    ) -> torch.Size:
        return self._resolve_whole(whole_shape, size, location).shape

    def _gather(self, piece: Tensor, group: Group, location: str | None
                ) -> tuple[Tensor, Tensor | None]:
        axis, plan, whole_shape = self._resolve_piece(piece.shape, group.size, location)
        if self.shares_storage(group.size):
            return piece, None
        # Outside inference mode, the whole gets a version counter that records edits.
        with torch.inference_mode(False):
            stacked = group.all_gather(piece.contiguous())
            return self._assemble(stacked, axis, plan, whole_shape), None

    def assemble(self, stacked: Tensor, *, location: str | None = None) -> Tensor:
        """The whole from every rank's piece, stacked `[size, *piece.shape]` in rank order.

        Local and pure; `whole` is one all-gather followed by this. Always a new tensor.
        """
        axis, plan, whole_shape = self._resolve_piece(stacked.shape[1:], stacked.shape[0],
                                                      location)
        return self._assemble(stacked, axis, plan, whole_shape)

    @staticmethod
    def _assemble(stacked: Tensor, axis: int, plan: _Plan, whole_shape: torch.Size) -> Tensor:
        segments = [stacked[holder].narrow(axis, start, length)
                    for holder, start, length in plan.gather]
        return _concatenate(segments, axis, stacked, whole_shape)

    def split(self, whole: Tensor, rank: int, size: int, *, location: str | None = None
              ) -> Tensor:
        _check_rank(rank, size)
        axis, plan, piece_shape = self._resolve_whole(whole.shape, size, location)
        segments = []
        for start, length in plan.split[rank]:
            if start >= 0:
                segments.append(whole.narrow(axis, start, length))
            else:
                segments.append(whole.new_zeros(_with(whole.shape, axis, length)))
        return _concatenate(segments, axis, whole, piece_shape)


class Stacked(_Gathered):
    """Several logical values side by side along `dim`, each sharded over the ranks on its own.

    Rank r holds `[chunk_r(part_0), chunk_r(part_1), ...]` along `dim`; the whole is
    `[part_0, part_1, ...]`. This is the layout of vLLM's fused projections: a rank of
    `QKVParallelLinear` holds `[q_r, k_r, v_r]` and one of `MergedColumnParallelLinear` holds
    `[gate_r, up_r]`. A plain all-gather along `dim` would interleave them rank by rank
    (`[q_0, k_0, v_0, q_1, k_1, v_1]`); this rule undoes that.

    Parts with fewer units than ranks (grouped-query attention with more ranks than KV heads)
    are held by several ranks each: the gather keeps one copy of each unit (from the first rank
    holding it) and the split hands every holder its copy. Padding (see `Part`) is dropped on
    gather and zero-filled on split.

    Args:
        parts: the logical values in order, as `Part`s or plain lengths.
        dim: the dimension they are stacked and sharded along.
    """

    def __init__(self, parts: Sequence[int | Part], dim: int = -1) -> None:
        if not parts:
            raise ValueError("Stacked needs at least one part")
        self.parts: tuple[Part, ...] = tuple(p if isinstance(p, Part) else Part(int(p))
                                             for p in parts)
        self.dim = dim
        self._plans: dict[int, _Plan] = {}

    def __repr__(self) -> str:
        shown = ", ".join(str(p.size) if p == Part(p.size) else repr(p) for p in self.parts)
        return f"Stacked(parts=[{shown}], dim={self.dim})"

    def _key(self) -> tuple[object, ...]:
        return (self.parts, self.dim)

    def shares_storage(self, size: int) -> bool:
        return size == 1 and all(p.padding == 0 for p in self.parts)

    def _plan(self, size: int, location: str | None, shapes: dict[str, Shape]) -> _Plan:
        plan = self._plans.get(size)
        if plan is None:
            try:
                plan = _plan(self.parts, size)
            except _Indivisible as reason:
                raise GroupSizeError(str(reason), location=location, rule=self,
                                     shapes=shapes) from None
            self._plans[size] = plan
        return plan

    def _resolve_piece(self, piece_shape: Shape, size: int, location: str | None
                       ) -> _Resolved:
        axis = _axis(self.dim, len(piece_shape), rule=self, location=location, role="piece",
                     shape=piece_shape)
        plan = self._plan(size, location, {"piece": piece_shape})
        if piece_shape[axis] != plan.piece_length:
            per_part = " + ".join(str(_lay_out(part, size).chunk) for part in self.parts)
            raise PieceShapeError(
                f"dim {self.dim} of the piece is {piece_shape[axis]} long, but with {size} ranks "
                f"each rank holds {per_part} = {plan.piece_length}",
                location=location, rule=self, shapes={"piece": piece_shape},
            )
        return _Resolved(axis, plan, _with(piece_shape, axis, plan.whole_length))

    def _resolve_whole(self, whole_shape: Shape, size: int, location: str | None
                       ) -> _Resolved:
        axis = _axis(self.dim, len(whole_shape), rule=self, location=location, role="whole",
                     shape=whole_shape)
        total = sum(part.size for part in self.parts)
        if whole_shape[axis] != total:
            raise WholeShapeError(
                f"dim {self.dim} of the whole is {whole_shape[axis]} long, but the parts add "
                f"up to {total}",
                location=location, rule=self, shapes={"whole": whole_shape},
            )
        plan = self._plan(size, location, {"whole": whole_shape})
        return _Resolved(axis, plan, _with(whole_shape, axis, plan.piece_length))


class Shard(_Gathered):
    """The whole cut into equal contiguous chunks along `dim`; rank r holds chunk r.

    This is a column-parallel linear's output, a row-parallel linear's input and an attention
    layer's per-rank heads. With `units` (e.g. the number of heads along `dim`) the cut respects
    unit boundaries, and when the group has more ranks than units each unit is held by
    `size // units` consecutive ranks: vLLM's layout of KV heads when `tp > num_kv_heads`.
    The gather then keeps one copy of each unit and the split re-replicates it.

    Args:
        dim: the sharded dimension.
        units: how many indivisible units `dim` holds in the whole, or None for any even cut.
    """

    def __init__(self, dim: int = -1, units: int | None = None) -> None:
        if units is not None and units < 1:
            raise ValueError(f"units must be at least 1, got {units}")
        self.dim = dim
        self.units = units
        # One single-part `Stacked` per whole length: the same plans, cached the same way.
        self._as_stacked: dict[int, Stacked] = {}

    def __repr__(self) -> str:
        units = "" if self.units is None else f", units={self.units}"
        return f"Shard(dim={self.dim}{units})"

    def _key(self) -> tuple[object, ...]:
        return (self.dim, self.units)

    def shares_storage(self, size: int) -> bool:
        return size == 1

    def _stacked(self, length: int, location: str | None, shapes: dict[str, Shape]
                 ) -> Stacked:
        stacked = self._as_stacked.get(length)
        if stacked is None:
            try:
                stacked = Stacked([Part(length, units=self.units)], dim=self.dim)
            except ValueError:
                error = WholeShapeError if "whole" in shapes else PieceShapeError
                raise error(f"{length} entries along dim {self.dim} are not a whole number of "
                            f"{self.units} units", location=location, rule=self,
                            shapes=shapes) from None
            if len(self._as_stacked) > 64:  # bounded: lengths vary little in practice
                self._as_stacked.clear()
            self._as_stacked[length] = stacked
        return stacked

    def _whole_length(self, piece_shape: Shape, size: int, location: str | None) -> int:
        axis = _axis(self.dim, len(piece_shape), rule=self, location=location, role="piece",
                     shape=piece_shape)
        held = piece_shape[axis]
        if self.units is None:
            return held * size
        if self.units >= size:
            if self.units % size:
                raise GroupSizeError(f"a group of {size} ranks does not divide {self.units} units",
                                     location=location, rule=self, shapes={"piece": piece_shape})
            return held * size
        # Fewer units than ranks: each rank holds one unit, so the whole holds `units` of them.
        if size % self.units:
            raise GroupSizeError(
                f"{self.units} units cannot be replicated evenly over a group of {size} ranks",
                location=location, rule=self, shapes={"piece": piece_shape})
        return held * self.units

    def _own(self, error: FragmentError) -> FragmentError:
        """An error found by the one-part `Stacked` this rule delegates to, as its own."""
        return type(error)(error.problem, location=error.location, rule=self,
                           shapes=error.shapes)

    def _resolve_piece(self, piece_shape: Shape, size: int, location: str | None
                       ) -> _Resolved:
        length = self._whole_length(piece_shape, size, location)
        stacked = self._stacked(length, location, {"piece": piece_shape})
        try:
            return stacked._resolve_piece(piece_shape, size, location)
        except FragmentError as error:
            raise self._own(error) from None

    def _resolve_whole(self, whole_shape: Shape, size: int, location: str | None
                       ) -> _Resolved:
        axis = _axis(self.dim, len(whole_shape), rule=self, location=location, role="whole",
                     shape=whole_shape)
        stacked = self._stacked(whole_shape[axis], location, {"whole": whole_shape})
        try:
            return stacked._resolve_whole(whole_shape, size, location)
        except FragmentError as error:
            raise self._own(error) from None
