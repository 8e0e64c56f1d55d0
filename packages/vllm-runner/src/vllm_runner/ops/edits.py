"""The ops that change a value on a request's own rows: `Add` (steering), `Set`, `Scale`,
`Zero`, `ProjectOut` (directional ablation) — each an `EditOp` — and `Skip` (a layer's output
replaced by its input)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vllm_runner.ops.base import GroupServer, Op, RowOp
from vllm_runner.ops.checks import (
    check_number,
    check_tensor,
    check_whole_numbers,
    non_finite,
    op_name,
)
from vllm_runner.ops.per_position import (
    first_row_position,
    named_positions,
    operand_at,
    rows_axis,
    uncovered,
)
from vllm_runner.ops.value_shape import ValueShape

if TYPE_CHECKING:
    from vllm_runner.runtime.row_serving import Visit


@dataclass(frozen=True)
class EditOp(RowOp):
    """An op that computes a new value from the value as read, on the rows it keeps."""

    together = True
    #: The field of a tensor that may hold one row per position (`Add.vector`, `Set.value`:
    #: `per_position`), or `None` for an op without one.
    OPERAND: ClassVar[str | None] = None

    @property
    def operand(self) -> torch.Tensor | None:
        """The op's tensor that may hold one row per position, if it has one."""
        return None if self.OPERAND is None else getattr(self, self.OPERAND)

    @property
    def operand_name(self) -> str:
        """How errors name the operand: `Set's value`."""
        return f"{type(self).__name__}'s {self.OPERAND}"

    def shares_rows(self) -> bool:
        """Edits are served together with `positions` and `steps` too: the rows they do not
        keep are written back as read (`selected_rows`); with `tokens`, request by request."""
        return self.tokens is None

    def serve_group(self, server: GroupServer) -> bool:
        """Served together as an edit."""
        return server.edit(self)

    def edited(self, current: torch.Tensor, layout: tuple[str, ...],
               operand: torch.Tensor | None = None) -> torch.Tensor:
        """The value after the edit, on every row; `layout` names the value's axes, `operand`
        stands for the op's tensor (`OPERAND`) where given: a per-position tensor's rows for
        the rows of `current`."""
        raise NotImplementedError(type(self).__name__)

    def same_on_every_row(self, value_dims: int, token_axis: int) -> bool:
        """Whether the edit is the same for every row of a value of `value_dims` axes (its
        tensor, if any, does not extend along the tokens axis): only then is editing many
        requests' rows at once the same as editing each request's (a per-position tensor is
        matched to each request's own positions: `per_position`)."""
        operand = self.operand
        return operand is None or rows_axis(operand, value_dims, token_axis) is None

    def position_misfit(self, prompt_length: int, location: str, layout: tuple[str, ...],
                        token_axis: int | None) -> str | None:
        """Why the op's per-position tensor can never serve a `positions=` entry on a prompt of
        `prompt_length` tokens at `location`, a value of axes `layout` (it has no row for it), or
        `None`:
        known before the request runs."""
        operand = self.operand
        if operand is None or token_axis is None or self.positions is None:
            return None
        first = first_row_position(location, prompt_length)
        missing = uncovered(operand, len(layout), token_axis, self.positions, prompt_length, first)
        if not missing:
            return None
        rows = operand.shape[rows_axis(operand, len(layout), token_axis) or 0]
        return (f"{self.kind} at {self.location}: its {self.OPERAND} has {rows} rows along "
                f"[{' '.join(layout)}]'s tokens axis, one per position, but positions names "
                f"{len(named_positions(self.positions, prompt_length) or ())} positions and "
                f"{missing} are not among {first}..{first + rows - 1}; give one row per "
                f"position named (in increasing order, as Save(positions=...) returns them), or "
                f"rows for every position from {first}")

    def serve(self, visit: Visit) -> None:
        """Edit the request's rows it keeps and write them back; a non-finite result fails the
        request and is not written (`Visit.write_if_finite`: the host does not wait for the
        device's answer). A step where the op keeps no row is not read at all (a prompt-only
        patch at a decode step), and a per-position tensor gives each row its own position's
        row (`per_position`)."""
        span, axis = visit.want.span, visit.token_axis
        prompt_length = visit.want.step.prompt_length
        keep = None
        positions = span.first_position + torch.arange(len(span))
        if axis is not None and self.filtered:  # `positions`, `steps`; `tokens` below
            keep = self.selected_rows(positions, torch.full_like(positions, prompt_length))
            if not bool(keep.any()):
                return
        current = visit.read()
        operand = self.operand
        if axis is not None:
            if (matching := self.token_rows(visit)) is not None:
                keep = matching if keep is None else matching & keep.to(matching.device)
            if operand is not None and (rows := rows_axis(operand, current.dim(), axis)) \
                    is not None:
                if "query" in visit.value.eproperty.layout:
                    raise ValueError(f"{self.operand_name} has {operand.shape[rows]} rows along "
                                     "the pattern's query axis: an attention pattern takes no "
                                     "value per position (its key axis grows with every "
                                     "step); give one that broadcasts over the queries, or "
                                     "edit it with a Call")
                # The axes beside the tokens axis are checked as given, naming its shape.
                _fitted(operand.narrow(rows, 0, 1), current.narrow(axis, 0, 1),
                        visit.value.eproperty.layout, self.operand_name,
                        (tuple(operand.shape), tuple(current.shape)))
                operand, covered = operand_at(operand, rows, positions, self.positions,
                                              prompt_length,
                                              first_row_position(visit.location, prompt_length))
                if not bool(covered.any()):
                    return  # no row of this step has a row of the tensor
                keep = covered if keep is None else keep & covered.to(keep.device)
        edited = self.edited(current, visit.value.eproperty.layout, operand)
        if keep is not None:
            edited = with_rows_kept(edited, current, keep, axis)  # type: ignore[arg-type]
        visit.write_if_finite(edited, f"the {self.kind}")



def with_rows_kept(edited: torch.Tensor, current: torch.Tensor, keep: torch.Tensor,
                   token_axis: int) -> torch.Tensor:
    """`edited` on the rows `keep` marks (one bool per row along `token_axis`), `current` (the
    value as read) on the others: what an edit with `positions` or `steps` writes back."""
    if bool(keep.all()):
        return edited
    shape = [-1 if axis == token_axis else 1 for axis in range(current.dim())]
    return torch.where(keep.to(current.device, non_blocking=True).view(shape), edited, current)


def _fitted(tensor: torch.Tensor, current: torch.Tensor, layout: tuple[str, ...],
            what: str, shown: tuple[tuple[int, ...], tuple[int, ...]] | None = None
            ) -> torch.Tensor:
    """`tensor` if it broadcasts over the value as read, else an error that says which shape
    would (the value's layout and this step's shape; `shown`: the shapes to name instead, the
    tensor's as given and the step's, where a piece of each is checked)."""
    try:
        fits = torch.broadcast_shapes(tuple(tensor.shape), tuple(current.shape)) == current.shape
    except RuntimeError:
        fits = False
    if not fits:  # e.g. a last axis that is not the value's
        given, step = shown or (tuple(tensor.shape), tuple(current.shape))
        per_position = ", ".join("positions" if name == "tokens" else str(size)
                                 for name, size in zip(layout, step, strict=False))
        raise ValueError(
            f"{what} has shape {given}, which does not broadcast over the value "
            f"[{' '.join(layout)}] (this step: {step}); e.g. give "
            f"[{step[-1]}] for a vector along its last axis"
            + (f", or [{per_position}] for one row per position" if "tokens" in layout else ""))
    return tensor


@dataclass(frozen=True)
class Add(EditOp):
    """Add `scale * vector` to the value at `location`, on this request's rows only (steering).

    `vector` broadcasts over the value's layout (e.g. `[hidden]` for `layer_output`). `positions`
    and `steps` limit where it is added, as for `Save`. A vector with one row per position
    (`[1, positions, hidden]`) adds row `p` at absolute position `p`, or, with `positions=`
    naming as many positions as it has rows, its rows at those positions in increasing order
    (`vllm_runner.ops.per_position`); positions it has no row for are left as they are.
    """

    kind = "add"
    OPERAND = "vector"
    TENSOR = "vector"

    vector: torch.Tensor = field(repr=False)
    scale: float = 1.0

    def __post_init__(self) -> None:
        check_tensor(self, "vector")
        check_number(self, "scale")
        super().__post_init__()
        if non_finite(self.vector.detach().float() * float(self.scale),
                      self.location == "logits"):
            raise ValueError(f"{op_name(self)}: scale * vector overflows float32 (scale="
                             f"{self.scale!r}); every value it is added to would be infinite")

    def data_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """`scale` as a float (numpy numbers do not travel)."""
        return {**fields, "scale": float(self.scale)}

    def edited(self, current: torch.Tensor, layout: tuple[str, ...],
               operand: torch.Tensor | None = None) -> torch.Tensor:
        """`current + scale * vector`."""
        vector = _fitted(self.vector if operand is None else operand, current, layout,
                         self.operand_name)
        return current + vector.to(current.device, current.dtype, non_blocking=True) * self.scale


@dataclass(frozen=True)
class Set(EditOp):
    """Replace the value at `location` with `value` (broadcast over its layout) on this request's
    rows, e.g. a patched activation taken from another run.

    A value with one row per position — a `Save`'s `[1, positions, hidden]` — is its exact
    inverse: row `p` goes to absolute position `p` (or, with `positions=` naming as many
    positions as it has rows, to those positions in increasing order), at whichever step that
    position runs, however vLLM chunks the prompt; positions it has no row for are left as they
    are (`vllm_runner.ops.per_position`)."""

    kind = "set"
    OPERAND = "value"
    TENSOR = "value"

    value: torch.Tensor = field(repr=False)

    def __post_init__(self) -> None:
        check_tensor(self, "value")
        super().__post_init__()

    def edited(self, current: torch.Tensor, layout: tuple[str, ...],
               operand: torch.Tensor | None = None) -> torch.Tensor:
        """`value`, broadcast over the rows."""
        value = _fitted(self.value if operand is None else operand, current, layout,
                        self.operand_name)
        return value.to(current.device, current.dtype, non_blocking=True).expand_as(current).clone()


@dataclass(frozen=True)
class Scale(EditOp):
    """Multiply the value at `location` by `factor` on this request's rows."""

    kind = "scale"

    factor: float

    def __post_init__(self) -> None:
        check_number(self, "factor")
        super().__post_init__()

    def data_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """`factor` as a float (numpy numbers do not travel)."""
        return {**fields, "factor": float(self.factor)}

    def edited(self, current: torch.Tensor, layout: tuple[str, ...],
               operand: torch.Tensor | None = None) -> torch.Tensor:
        """`current * factor`."""
        return current * self.factor


@dataclass(frozen=True)
class Zero(EditOp):
    """Zero the value at `location` on this request's rows — only the given `heads` for values
    with a heads axis (queries, keys, values, head outputs), e.g. head ablation."""

    kind = "zero"

    heads: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_whole_numbers(self, "heads", "head indices")

    def edited(self, current: torch.Tensor, layout: tuple[str, ...],
               operand: torch.Tensor | None = None) -> torch.Tensor:
        """Zeros, on every head or on `heads` only."""
        edited = current.clone()
        if self.heads is None:
            return edited.zero_()
        if "heads" not in layout and "kv_heads" not in layout:
            raise ValueError(f"Zero(heads=...) needs a value with a heads axis, not "
                             f"[{' '.join(layout)}]")
        axis = layout.index("heads" if "heads" in layout else "kv_heads")
        return edited.index_fill_(axis, torch.tensor(self.heads, dtype=torch.long,
                                                     device=current.device), 0.0)


@dataclass(frozen=True)
class ProjectOut(EditOp):
    """Remove the component along `direction` from the value at `location` (its last axis) on
    this request's rows: `x - (x·d̂) d̂`, e.g. directional ablation."""

    kind = "project_out"
    TENSOR = "direction"

    direction: torch.Tensor = field(repr=False)

    def __post_init__(self) -> None:
        check_tensor(self, "direction")
        super().__post_init__()
        if not bool(self.direction.detach().abs().sum() > 0):
            raise ValueError(f"{op_name(self)}: direction is a zero vector; there is no "
                             "component to remove")

    def tensor_misfit(self, given: tuple[int, ...], location: str, value: ValueShape
                      ) -> str | None:
        """A dot product along the value's last axis: one vector as long as it."""
        if value.token_axis is None or given == value.shape[-1:]:
            return None
        return (f"has shape {list(given)}; a direction for {location} {value.describe()} is one "
                f"vector along its last axis: give [{value.shape[-1]}]")

    def edited(self, current: torch.Tensor, layout: tuple[str, ...],
               operand: torch.Tensor | None = None) -> torch.Tensor:
        """`current` less its component along the unit direction (normalised in float32, as the
        graph's ablation does: in float16 a direction's norm can overflow)."""
        direction = self.direction.to(current.device, torch.float32, non_blocking=True)
        unit = (direction / direction.norm()).to(current.dtype)
        return current - (current @ unit).unsqueeze(-1) * unit


@dataclass(frozen=True, init=False, repr=False)
class Skip(Op):
    """Skip layer `layer` for this request only: its output becomes its input, on this request's
    rows (the layer still runs for every other request — safe on a shared engine)."""

    kind = "skip"
    INPUT: ClassVar[str] = "layer_input"
    OUTPUT: ClassVar[str] = "layer_output"

    def __init__(self, layer: int) -> None:
        object.__setattr__(self, "location", f"layers.{layer}")

    def __repr__(self) -> str:
        return f"Skip(layer={self.layer})"

    @property
    def layer(self) -> int:
        """The layer's index."""
        return int(self.location.rsplit(".", 1)[1])

    def patterns(self) -> tuple[str, ...]:
        """The layer's input (read) and output (replaced by the input)."""
        return (f"{self.location}.{self.INPUT}", f"{self.location}.{self.OUTPUT}")

    def serve(self, visit: Visit) -> None:
        """At the layer's input, keep the request's rows; at its output, write them back."""
        skipped = visit.services.skipped
        remembered = (visit.want.program_id, self.location)
        if visit.location.endswith(f".{self.INPUT}"):
            skipped[remembered] = visit.read()
        else:
            visit.write(skipped.pop(remembered))

    @classmethod
    def fields_from_data(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """The layer, from its location `layers.<i>`."""
        prefix, _, index = str(fields["location"]).partition(".")
        if prefix != "layers" or not index.lstrip("-").isdigit():
            raise ValueError(f"skip: location {fields['location']!r} is not layers.<i>")
        return {"layer": int(index)}
