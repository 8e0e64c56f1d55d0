"""Rules: how one logical value is laid out over the ranks of a tensor-parallel group.

A rule answers three questions about a value that each rank holds a piece of:

- `whole(piece, group)`: what is the whole value? At most one collective, and whether it runs
  depends only on the rule and the group's size, which every rank shares, never on a rank's data.
- `split(whole, rank, size)`: which piece of a whole does a given rank hold? Purely local.
- `whole_shape` / `piece_shape`: what shapes fit? These checks run before any collective and use
  only shapes, which are the same on every rank, so a bad value fails on every rank alike instead
  of leaving some ranks waiting in a collective.

The rules (exported together from `tpfragments`):

- `Replicated()`: every rank holds the whole value (a row-parallel output after its all-reduce).
- `Partial()`: each rank holds a partial sum; the whole is their sum (a row-parallel output whose
  all-reduce the engine defers).
- `Item(index, rule)`: the value is a tuple and `rule` applies to one item (vLLM's linear layers
  return `(output, bias)`); the other items pass through untouched.
- `Shard(dim, units=None)` and `Stacked(parts, dim)`, in `sharding.py`: values cut along one
  dimension, plainly (a column-parallel output), by heads that may be replicated over more
  ranks than there are heads (vLLM's KV heads), or as several values side by side, each cut on
  its own (a fused QKV projection holds `[q_r, k_r, v_r]`, a merged gate-up `[gate_r, up_r]`).

This module holds the base class, `Replicated`, `Partial` and `Item`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import Tensor

from .errors import PieceShapeError, WholeShapeError
from .group import Group

__all__ = ["Item", "Partial", "Replicated", "Rule"]

Shape = Sequence[int]


class Rule(ABC):
    """How a logical value is laid out over the ranks of a tensor-parallel group.

    Subclasses say which collective reassembles the value (`collective`), which shapes fit
    (`whole_shape`, `piece_shape`), how to reassemble (`_gather`) and how to cut a whole back
    (`split`, `resplit`). `Fragments` drives them once per visit; they can also be used directly.
    """

    #: The collective `whole` runs when the group has more than one rank, or None.
    collective: str | None = None

    def collectives(self, size: int) -> int:
        """How many collectives `whole` runs in a group of `size` ranks: 0 or 1.

        It depends only on the rule and `size`, which every rank shares, so every rank runs the
        same collectives in the same order.
        """
        return 0 if size == 1 or self.collective is None else 1

    def shares_storage(self, size: int) -> bool:
        """Whether the whole is the piece itself in a group of `size` ranks (no copy is made).

        Then in-place edits to the whole land in the engine's tensor at once, and handing the
        whole back costs nothing.
        """
        return False

    @abstractmethod
    def whole_shape(self, piece_shape: Shape, size: int, *, location: str | None = None
                    ) -> torch.Size:
        """The whole's shape for a piece of `piece_shape`; raises if the piece does not fit."""

    @abstractmethod
    def piece_shape(self, whole_shape: Shape, size: int, *, location: str | None = None
                    ) -> torch.Size:
        """Each rank's piece shape for a whole of `whole_shape`; raises if it does not fit."""

    def whole(self, piece: Tensor, group: Group, *, location: str | None = None) -> Tensor:
        """The whole value from this rank's `piece`, running at most one collective on `group`.

        Every rank of `group` must call this with a piece of the same shape. Unless the rule
        shares storage (see `shares_storage`), the whole is a new tensor made outside inference
        mode, so its version counter records in-place edits even when the caller runs under
        `torch.inference_mode()` as engines do.
        """
        whole, _ = self._gather(piece, group, location)
        return whole

    @abstractmethod
    def _gather(self, piece: Tensor, group: Group, location: str | None
                ) -> tuple[Tensor, Tensor | None]:
        """The whole, and a private reference `resplit` may compare an edit against (or None)."""

    @abstractmethod
    def split(self, whole: Tensor, rank: int, size: int, *, location: str | None = None
              ) -> Tensor:
        """The piece of `whole` that `rank` of a group of `size` ranks holds. Local, no collective.

        Given the pieces `split` makes for every rank, the engine's own later handling (nothing
        for shards, its all-reduce for `Partial`) yields `whole`.
        """

    def resplit(self, edited: Tensor, rank: int, size: int, *, piece: Tensor,
                reference: Tensor | None, location: str | None = None) -> Tensor:
        """This rank's new piece after an edit of the whole it was given.

        `piece` is the rank's original piece and `reference` what `_gather` kept. Rules whose
        split is exact slicing just split; `Partial` uses them to leave untouched elements alone.
        """
        return self.split(edited, rank, size, location=location)

    def pieces(self, whole: Tensor, size: int) -> list[Tensor]:
        """Every rank's piece of `whole`, in rank order: `split` for each rank of `size`."""
        return [self.split(whole, rank, size) for rank in range(size)]

    def take(self, value: object, location: str | None = None) -> Tensor:
        """The tensor this rule applies to inside `value` (the value itself for tensor rules)."""
        if not isinstance(value, Tensor):
            hint = ""
            if isinstance(value, tuple):
                hint = "; for an (output, bias) tuple wrap the rule: Item(0, rule)"
            raise PieceShapeError(
                f"expected a tensor, got {type(value).__name__}{hint}",
                location=location, rule=self,
            )
        return value

    def put(self, value: object, piece: Tensor) -> object:
        """`value` with its tensor replaced by `piece` (the piece itself for tensor rules)."""
        return piece

    def _key(self) -> tuple[object, ...]:
        return ()

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))


def _axis(dim: int, ndim: int, *, rule: Rule, location: str | None, role: str,
          shape: Shape) -> int:
    """`dim` as a non-negative axis of a tensor with `ndim` dimensions, or a clear error."""
    if -ndim <= dim < ndim:
        return dim % ndim
    error = PieceShapeError if role == "piece" else WholeShapeError
    raise error(f"the {role} has {ndim} dimensions, too few for dim {dim}",
                location=location, rule=rule, shapes={role: shape})


def _with(shape: Shape, axis: int, length: int) -> torch.Size:
    return torch.Size((*shape[:axis], length, *shape[axis + 1:]))


class Replicated(Rule):
    """Every rank holds the whole value; nothing is communicated and nothing is copied.

    The whole *is* the piece, so in-place edits land in the engine's tensor at once. The rule
    assumes what the engine guarantees (e.g. after an all-reduce): every rank holds the same
    bits. An edit must be the same on every rank, as user code that runs on every rank is.
    """

    def shares_storage(self, size: int) -> bool:
        return True

    def whole_shape(self, piece_shape: Shape, size: int, *, location: str | None = None
                    ) -> torch.Size:
        return torch.Size(piece_shape)

    def piece_shape(self, whole_shape: Shape, size: int, *, location: str | None = None
                    ) -> torch.Size:
        return torch.Size(whole_shape)

    def _gather(self, piece: Tensor, group: Group, location: str | None
                ) -> tuple[Tensor, Tensor | None]:
        return piece, None

    def split(self, whole: Tensor, rank: int, size: int, *, location: str | None = None
              ) -> Tensor:
        return whole

    def __repr__(self) -> str:
        return "Replicated()"


class Partial(Rule):
    """Each rank holds a partial sum; the whole is their sum, made by one all-reduce.

    This is a row-parallel linear's output when the engine defers its all-reduce
    (`reduce_results=False`) and a fused MoE's output when it skips its final all-reduce.

    Handing back, exactly:

    - An unedited visit returns every rank's original piece object, untouched. (Rewriting it as
      `whole / size` would change the engine's numbers even though nothing was edited.)
    - After an edit, each element the edit changed is handed back as the edited value on rank 0
      and zero on every other rank, so the engine's own all-reduce, a sum, yields exactly the
      edited value: adding zeros is exact in IEEE arithmetic (at most a `-0.0` comes back as
      `0.0`). Each element the edit left bit-for-bit unchanged keeps every rank's original
      partial, so the engine reduces it exactly as it would have without us; that sum may differ
      from the whole the user read by the rounding of one sum, because our all-reduce and the
      engine's may add the partials in a different order.
    - This relies on the all-reduce handing every rank the same bits (NCCL, gloo and vLLM's
      communicators do) and on the edit being the same on every rank. A lossy reduction
      (e.g. a quantized all-reduce) rounds edited values as it rounds any value.

    The whole costs one extra copy per visit: a private snapshot that tells edited elements from
    untouched ones even after an in-place edit.
    """

    collective = "all_reduce"

    def __repr__(self) -> str:
        return "Partial()"

    def shares_storage(self, size: int) -> bool:
        return size == 1

    def whole_shape(self, piece_shape: Shape, size: int, *, location: str | None = None
                    ) -> torch.Size:
        return torch.Size(piece_shape)

    def piece_shape(self, whole_shape: Shape, size: int, *, location: str | None = None
                    ) -> torch.Size:
        return torch.Size(whole_shape)

    def whole(self, piece: Tensor, group: Group, *, location: str | None = None) -> Tensor:
        if group.size == 1:
            return piece
        with torch.inference_mode(False):
            return group.all_reduce(piece.clone(memory_format=torch.contiguous_format))

    def _gather(self, piece: Tensor, group: Group, location: str | None
                ) -> tuple[Tensor, Tensor | None]:
        if group.size == 1:
            return piece, None
        with torch.inference_mode(False):
            reference = group.all_reduce(piece.clone(memory_format=torch.contiguous_format))
            return reference.clone(), reference

    def split(self, whole: Tensor, rank: int, size: int, *, location: str | None = None
              ) -> Tensor:
        _check_rank(rank, size)
        if rank == 0:
            return whole.clone(memory_format=torch.contiguous_format)
        return torch.zeros_like(whole, memory_format=torch.contiguous_format)

    def resplit(self, edited: Tensor, rank: int, size: int, *, piece: Tensor,
                reference: Tensor | None, location: str | None = None) -> Tensor:
        if reference is None or size == 1:
            return self.split(edited, rank, size, location=location)
        changed = _bits(edited) != _bits(reference)
        replacement = edited if rank == 0 else torch.zeros((), dtype=piece.dtype,
                                                           device=piece.device)
        return torch.where(changed, replacement, piece).contiguous()


class Item(Rule):
    """`rule` applied to item `index` of a tuple (or list); the other items pass through.

    vLLM's linear layers return `(output, bias)` (the bias is None unless `skip_bias_add`); the
    value a user means is the output. `take` picks it out, `put` rebuilds the tuple around a new
    piece, keeping the other items as the engine made them.
    """

    def __init__(self, index: int, rule: Rule) -> None:
        if isinstance(rule, Item):
            raise ValueError("Item(index, Item(...)) is not supported; name the tensor directly")
        self.index = index
        self.rule = rule
        self.collective = rule.collective

    def __repr__(self) -> str:
        return f"Item({self.index}, {self.rule!r})"

    def _key(self) -> tuple[object, ...]:
        return (self.index, self.rule)

    def collectives(self, size: int) -> int:
        return self.rule.collectives(size)

    def shares_storage(self, size: int) -> bool:
        return self.rule.shares_storage(size)

    def whole_shape(self, piece_shape: Shape, size: int, *, location: str | None = None
                    ) -> torch.Size:
        return self.rule.whole_shape(piece_shape, size, location=location)

    def piece_shape(self, whole_shape: Shape, size: int, *, location: str | None = None
                    ) -> torch.Size:
        return self.rule.piece_shape(whole_shape, size, location=location)

    def whole(self, piece: Tensor, group: Group, *, location: str | None = None) -> Tensor:
        return self.rule.whole(piece, group, location=location)

    def _gather(self, piece: Tensor, group: Group, location: str | None
                ) -> tuple[Tensor, Tensor | None]:
        return self.rule._gather(piece, group, location)

    def split(self, whole: Tensor, rank: int, size: int, *, location: str | None = None
              ) -> Tensor:
        return self.rule.split(whole, rank, size, location=location)

    def resplit(self, edited: Tensor, rank: int, size: int, *, piece: Tensor,
                reference: Tensor | None, location: str | None = None) -> Tensor:
        return self.rule.resplit(edited, rank, size, piece=piece, reference=reference,
                                 location=location)

    def take(self, value: object, location: str | None = None) -> Tensor:
        if not isinstance(value, (tuple, list)) or not -len(value) <= self.index < len(value):
            raise PieceShapeError(
                f"expected a tuple with an item {self.index}, got {type(value).__name__}"
                + (f" of length {len(value)}" if isinstance(value, (tuple, list)) else ""),
                location=location, rule=self,
            )
        return self.rule.take(value[self.index], location)

    def put(self, value: object, piece: Tensor) -> object:
        assert isinstance(value, (tuple, list))
        items = list(value)
        items[self.index] = piece
        if hasattr(value, "_fields"):  # a namedtuple takes its items as arguments
            return type(value)(*items)
        return type(value)(items)


def _check_rank(rank: int, size: int) -> None:
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a group of size {size}")


_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: Tensor) -> Tensor:
    """The tensor's bits as integers, so that comparing tells `-0.0` from `0.0` and a NaN
    equals itself: an element is unchanged only if its bits are."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.is_floating_point():
        return tensor.contiguous().view(_SAME_SIZE_INTEGER[tensor.element_size()])
    return tensor
