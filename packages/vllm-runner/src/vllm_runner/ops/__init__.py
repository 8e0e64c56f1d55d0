"""Operations a request's program runs on its own rows: what users put in `interventions`.

Each op is a small value object. The client turns it into plain data (`to_data`) that travels
in `SamplingParams.extra_args`; a worker turns the data back into the same class
(`op_from_data`) and the op does its own work there: where it acts (`patterns`), whether many
requests running it share one read (`together`), how it saves or edits (`serve`, `edited`) and
what it leaves in the saves (`saved_names`). A new op is one class here and its tests.
"""

from __future__ import annotations

import dataclasses
import pickle
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from numbers import Integral
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from tokenspan import READ_MODES, ReadMode, Selection, Span, lend

from vllm_runner.ops.checks import (
    STEPS,
    Steps,
    check_number,
    check_result_name,
    check_tensor,
    check_where,
    check_whole_numbers,
    non_finite,
    op_name,
    refuse_non_finite,
)
from vllm_runner.ops.data import (
    TAG,
    field_from_data,
    field_to_data,
    tensor_from_data,
    tensor_to_data,
)
from vllm_runner.ops.per_position import (
    first_row_position,
    named_positions,
    operand_at,
    rows_axis,
    uncovered,
)
from vllm_runner.ops.value_shape import ValueShape, broadcast_misfit

if TYPE_CHECKING:
    from vllm_runner.runtime.serving import Visit

# `tensor_to_data`/`tensor_from_data` were defined here before `ops.data`; kept importable.
__all__ = ["STEPS", "Add", "Call", "CallContext", "Lens", "Op", "Probe", "ProjectOut", "Save",
           "Scale", "Set", "Skip", "Steps", "Zero", "op_from_data", "tensor_from_data",
           "tensor_to_data"]

KeepPosition = Callable[[int], bool]


class GroupServer(Protocol):
    """How the worker serves many requests running one op with one read (and one write) per run
    of their rows (`runtime.serving.serve_together`): a method per kind of op that can be, each
    returning whether it served them (`False`: they are served one by one). An op picks its
    method (`Op.serve_group`)."""

    def save(self, op: Save) -> bool: ...

    def lens(self, op: Lens) -> bool: ...

    def edit(self, op: EditOp) -> bool: ...

    def call(self, op: Call) -> bool: ...


@dataclass(frozen=True)
class Op:
    """What every op is: a kind on the wire and its behaviour in the worker (defaults here)."""

    #: The op's name in its plain data (`{"op": kind, ...}`).
    kind: ClassVar[str] = ""
    #: Whether it may change a value the engine keeps (its requests' KV blocks are zeroed
    #: before anyone else gets them: `kv_blocks`); Save and Lens only read.
    edits: ClassVar[bool] = True
    #: Whether requests running this very op can be served with one read (and one write) per
    #: run of their rows instead of one per request (`serving.serve_together`).
    together: ClassVar[bool] = False
    #: Whether the op saves the value itself (its rows as read: `Save`), whose bytes the server
    #: bounds before the request runs (`saved_rows`).
    saves_the_value: ClassVar[bool] = False
    #: The field of the tensor the op brings (an edit's vector, a probe's weight), checked
    #: against the value's shape before the request runs (`tensor_misfit`), or `None`.
    TENSOR: ClassVar[str | None] = None
    #: Whether the worker adds the op itself (never sent by a client: the edited attention a
    #: pattern edit writes, `runtime.pattern_edits`); the checks of a request's own ops skip it.
    added_by_the_worker: ClassVar[bool] = False

    location: str

    def patterns(self) -> tuple[str, ...]:
        """The location patterns the op acts at (resolved by the worker)."""
        return (self.location,)

    def saved_names(self, location: str) -> tuple[str, ...]:
        """The keys of `outputs[i].saved` the op fills at canonical `location`."""
        return ()

    def keeps(self, prompt_length: int) -> KeepPosition | None:
        """`position -> bool`: which positions the op acts at (`None`: every one)."""
        return None

    def before_the_prompt(self, prompt_length: int) -> str | None:
        """Why the op can never run as written on a prompt of `prompt_length` tokens, or
        `None`."""
        return None

    def acts_past_the_prompt(self) -> bool:
        """Whether the op may act at a position past its request's prompt (a generated token's
        step), whatever the prompt's length."""
        return True

    def shares_rows(self) -> bool:
        """Whether every row of every request running the op is treated alike, so they can be
        served together."""
        return self.together and self.keeps(0) is None

    def serve(self, visit: Visit) -> None:
        """Run the op on one request's rows at one hook visit."""
        raise NotImplementedError(type(self).__name__)

    def serve_group(self, server: GroupServer) -> bool:
        """Serve the requests running this op together through `server`'s method for its kind;
        `False` (the default: one by one) where it has none."""
        return False

    def position_misfit(self, prompt_length: int, location: str, layout: tuple[str, ...],
                        token_axis: int | None) -> str | None:
        """Why the op's per-position tensor can never serve its `positions=` on a prompt of
        `prompt_length` tokens at `location`, a value of axes `layout`, or `None` (an op
        without one: always)."""
        return None

    def tensor_misfit(self, given: tuple[int, ...], location: str, value: ValueShape
                      ) -> str | None:
        """Why the op's tensor (`TENSOR`), of shape `given`, could never fit `value` at
        `location` at any token count, or `None`. By default it broadcasts over the value; a
        pattern's sizes depend on the step (the worker checks them)."""
        if value.token_axis is None:
            return None
        return broadcast_misfit(given, location, value)

    def saved_rows(self, location: str, value: ValueShape, prompt_length: int,
                   max_tokens: int) -> int:
        """The most rows of `value` (at `location`) the op saves for a prompt of
        `prompt_length` tokens generating up to `max_tokens` (`saves_the_value`); none by
        default."""
        return 0

    def saved_runs(self, first_position: int, count: int, prompt_length: int
                   ) -> list[tuple[int, int]]:
        """The runs `(offset, rows)` of a request's `count` rows from `first_position` whose
        value the op saves as read (`saves_the_value`); none by default."""
        return []

    def failure_detail(self, error: BaseException) -> str:
        """More to say in a request's error when `serve` raised `error` (e.g. user frames)."""
        return ""

    def to_data(self) -> dict[str, Any]:
        """Plain data for `SamplingParams.extra_args` (see `ops.data`)."""
        fields = {item.name: field_to_data(getattr(self, item.name))
                  for item in dataclasses.fields(self)}
        return {TAG: self.kind, **self.data_fields(fields)}

    def data_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """The fields as they travel (a class whose fields do not travel as they are changes
        them here, and back in `fields_from_data`)."""
        return fields

    @classmethod
    def fields_from_data(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """The inverse of `data_fields`: the class's constructor arguments."""
        return fields


@dataclass(frozen=True)
class RowOp(Op):
    """An op with the shared `positions`, `steps` and `tokens` filters (keyword arguments).

    `tokens` (token ids) keeps the positions whose token is one of them, in the prompt or
    generated (EasySteer's triggers): the token a position runs through the model with. The
    worker reads the step's token ids where the model embeds them, so steps with such an op run
    the plain module tree, and its requests are served one by one.
    """

    positions: tuple[int, ...] | None = field(default=None, kw_only=True)
    steps: Steps = field(default="all", kw_only=True)
    tokens: tuple[int, ...] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        check_where(self)

    @property
    def filtered(self) -> bool:
        """Whether `positions`, `steps` or `tokens` limit the rows the op acts at."""
        return self.positions is not None or self.steps != "all" or self.tokens is not None

    def token_rows(self, visit: Visit) -> torch.Tensor | None:
        """Whether each of the request's rows at this visit holds one of `tokens` (bool, on
        the rows' device), or `None` without a `tokens` filter."""
        if self.tokens is None:
            return None
        ids = visit.services.token_ids
        span = visit.want.span
        if ids is None or ids.shape[0] < span.stop:
            raise ValueError(f"{self.kind} with tokens=: the step's token ids were not seen "
                             "whole where the model embeds them (an engine that embeds its "
                             "prompts before the forward: multimodal models, prompt "
                             "embeddings); tokens= is not served there, use positions=")
        wanted = torch.tensor(self.tokens, dtype=ids.dtype).to(ids.device, non_blocking=True)
        return torch.isin(ids[span.start:span.stop], wanted)

    def acts_past_the_prompt(self) -> bool:
        """`False` for `steps="prefill"` and for `positions` counted from the prompt's end
        (negative), which name prompt positions only."""
        if self.steps == "prefill":
            return False
        return self.positions is None or any(position >= 0 for position in self.positions)

    def keeps(self, prompt_length: int) -> KeepPosition | None:
        """`position -> bool` for `positions` (negative: from the prompt's end) and `steps`;
        `None` when the op keeps every position."""
        if not self.filtered:
            return None
        steps = self.steps
        named = named_positions(self.positions, prompt_length)
        absolute = None if named is None else set(named)

        def keep(position: int) -> bool:
            if absolute is not None and position not in absolute:
                return False
            if steps == "prefill":
                return position < prompt_length
            if steps == "decode":
                return position >= prompt_length
            return True
        return keep

    def kept_runs(self, first_position: int, count: int, prompt_length: int
                  ) -> list[tuple[int, int]]:
        """The rows `keeps(prompt_length)` keeps of `count` rows from `first_position`, as runs
        `(start, stop)` of row offsets: worked out from `positions` and `steps`, not row by row
        (a prompt's chunk has thousands of rows, a probe keeps one)."""
        low, high = first_position, first_position + count
        if self.steps == "prefill":
            high = min(high, prompt_length)
        elif self.steps == "decode":
            low = max(low, prompt_length)
        named = named_positions(self.positions, prompt_length)
        if named is None:
            return [(low - first_position, high - first_position)] if low < high else []
        return _runs(position - first_position for position in named if low <= position < high)

    def kept_reads(self, visit: Visit) -> list[tuple[int, torch.Tensor]]:
        """`(first position, value)` of each run of the request's rows the op keeps at this
        visit (all of them where it has no filter, or the value no token axis): a `Save` or a
        `Lens` with `positions` then keeps and computes those rows only."""
        span = visit.want.span
        if not self.filtered or visit.token_axis is None:
            return [(span.first_position, visit.read())]
        prompt_length = visit.want.step.prompt_length
        if (matching := self.token_rows(visit)) is None:
            runs = self.kept_runs(span.first_position, len(span), prompt_length)
        else:  # the rows the other filters keep that hold one of the tokens (read on the host)
            positions = span.first_position + torch.arange(len(span))
            kept = self.kept_rows(positions, torch.full_like(positions, prompt_length))
            runs = _runs(map(int, (kept & matching.cpu()).nonzero().flatten()))
        return [(span.first_position + start, visit.read_rows(start, stop))
                for start, stop in runs]

    def keep_results(self, visit: Visit, names: tuple[str, ...],
                     found: Sequence[tuple[int, tuple[torch.Tensor, ...]]],
                     empty: Callable[[torch.device], tuple[torch.Tensor, ...]]) -> None:
        """Keep what the op computed from each run it kept (`found`: its first position and one
        tensor per name of `names`, rows along axis 1), on rank 0 only. Where it kept no row this
        step, one empty piece per name the first time (`empty(device)`, on the value's device:
        the store joins a request's pieces, one device for all), so that the names come back,
        empty where no position they name is ever reached."""
        if not visit.services.keeps_saves:
            return
        store, program_id = visit.services.store, visit.want.program_id
        if not found:
            if store.has_saves(program_id, names[0]):
                return
            found = [(visit.want.span.first_position, empty(visit.device))]
        for first, results in found:
            for name, result in zip(names, results, strict=True):
                store.save(program_id, name, first, result, 1)

    def kept_rows(self, positions: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor:
        """`keeps` for many rows at once: whether the op acts at each row, given each row's
        position and its request's prompt length (int64, one per row)."""
        keep = torch.ones_like(positions, dtype=torch.bool)
        if self.positions is not None:
            wanted = torch.tensor(self.positions, dtype=torch.long).unsqueeze(0)
            absolute = torch.where(wanted < 0, wanted + prompt_lengths.unsqueeze(1), wanted)
            keep &= (absolute == positions.unsqueeze(1)).any(1)
        if self.steps == "prefill":
            keep &= positions < prompt_lengths
        elif self.steps == "decode":
            keep &= positions >= prompt_lengths
        return keep

    def before_the_prompt(self, prompt_length: int) -> str | None:
        """Why the op can never run as written on a prompt of `prompt_length` tokens (a
        negative position counted past the prompt's start), or `None`."""
        never = [p for p in self.positions or () if p < -prompt_length]
        if not never:
            return None
        return (f"{self.kind} at {self.location}: positions {never} are before the start of the "
                f"prompt, which has {prompt_length} tokens (-1..-{prompt_length} count from its "
                "end)")


@dataclass(frozen=True)
class Save(RowOp):
    """Save the value at `location` for this request, at every position it runs through.

    `outputs[i].saved[location]` is then a CPU tensor in the value's layout with the token axis
    covering the prompt and each generated token but the last, in position order. `positions`
    (absolute, or negative from the end of the prompt) keeps only those positions; `steps`
    keeps only prefill or decode steps.
    """

    kind = "save"
    edits = False
    together = True
    saves_the_value = True

    def saved_names(self, location: str) -> tuple[str, ...]:
        """The value itself, under its canonical location."""
        return (location,)

    def serve_group(self, server: GroupServer) -> bool:
        """Served together as a save."""
        return server.save(self)

    def saved_rows(self, location: str, value: ValueShape, prompt_length: int,
                   max_tokens: int) -> int:
        """Exactly what it keeps when the request generates all `max_tokens`: a row at every
        position the request runs through (the prompt and each generated token but the last),
        `logits` one at each sampled row, a pattern one per position against every key up to
        the last; `positions` and `steps` narrow that."""
        run_through = prompt_length + max(max_tokens - 1, 0)
        if value.token_axis is None:  # a pattern: a row per position, a column per key
            queries = {"all": run_through, "prefill": prompt_length,
                       "decode": run_through - prompt_length}[self.steps]
            if self.positions is not None:
                queries = min(queries, len(set(self.positions)))
            widest = prompt_length if self.steps == "prefill" else run_through
            return queries * widest
        if location == "logits":  # one row per sampled token, the first at prefill
            rows = {"all": max_tokens, "prefill": min(max_tokens, 1),
                    "decode": max(max_tokens - 1, 0)}[self.steps]
        else:
            rows = {"all": run_through, "prefill": prompt_length,
                    "decode": run_through - prompt_length}[self.steps]
        if self.positions is not None:
            rows = min(rows, len(set(self.positions)))
        return rows

    def saved_runs(self, first_position: int, count: int, prompt_length: int
                   ) -> list[tuple[int, int]]:
        """Every row, or the runs its filters keep (`RowOp.kept_runs`)."""
        return self.kept_runs(first_position, count, prompt_length) if self.filtered \
            else [(0, count)]

    def serve(self, visit: Visit) -> None:
        """Keep the request's rows (on rank 0 only: the client collects from there)."""
        if not visit.services.keeps_saves:
            return
        store, program_id = visit.services.store, visit.want.program_id
        reads = self.kept_reads(visit)
        if not reads:  # nothing kept this step: no rows, saved once, so that the location
            # comes back (empty where no position it names is ever reached) with its axis
            if store.has_saves(program_id, visit.location) or visit.token_axis is None:
                return
            reads = [(visit.want.span.first_position,
                      visit.read().narrow(visit.token_axis, 0, 0).clone())]
        for first_position, value in reads:
            store.save(program_id, visit.location, first_position, value, visit.token_axis,
                       visit.fill)


@dataclass(frozen=True)
class Lens(RowOp):
    """A logit lens inside the engine: project the residual value at `location` through the
    model's final norm and unembedding, and save only the top-k tokens and probabilities.

    `saved[f"{location}.lens_tokens"]` and `saved[f"{location}.lens_probs"]` are
    `[1, positions, top_k]`; no hidden state leaves the worker.
    """

    kind = "lens"
    edits = False
    together = True
    #: What a lens at `location` leaves in the saves: `f"{location}.{suffix}"`.
    RESULTS: ClassVar[tuple[str, str]] = ("lens_tokens", "lens_probs")

    top_k: int = 10

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, Integral) \
                or self.top_k < 1:
            raise ValueError(f"Lens({self.location!r}, top_k={self.top_k!r}): top_k must be a "
                             "whole number of tokens, at least 1")
        super().__post_init__()

    def data_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """`top_k` as a Python int (numpy integers do not travel)."""
        return {**fields, "top_k": int(self.top_k)}

    def saved_names(self, location: str) -> tuple[str, ...]:
        """The top-k tokens and their probabilities."""
        return tuple(f"{location}.{suffix}" for suffix in self.RESULTS)

    def serve_group(self, server: GroupServer) -> bool:
        """Served together as a lens."""
        return server.lens(self)

    def serve(self, visit: Visit) -> None:
        """Top-k next-token probabilities of the rows, through the model's own final norm and
        logits (every rank computes them: under tensor parallelism the logits are gathered)."""
        found = []
        for first, rows in self.kept_reads(visit):
            probabilities, tokens = visit.services.lens(rows, self.top_k)
            found.append((first, (tokens.unsqueeze(0), probabilities.unsqueeze(0))))
        self.keep_results(visit, self.saved_names(visit.location), found, lambda device: (
            torch.empty(1, 0, self.top_k, dtype=torch.long, device=device),
            torch.empty(1, 0, self.top_k, dtype=torch.float32, device=device)))


@dataclass(frozen=True)
class Probe(RowOp):
    """A linear probe inside the engine: `value @ weight.T + bias` on each row of the value at
    `location` (a value with one row per token and the probe's width last, e.g. the residual
    stream), saved as `saved[f"{location}.{name}"]` — `[1, positions]` for a `[width]` weight,
    `[1, positions, k]` for a `[k, width]` one — so a score per token leaves the worker
    instead of the value. Computed in float32; `positions` and `steps` as for `Save`. Plain
    data, so the server takes it without code.
    """

    kind = "probe"
    edits = False
    TENSOR = "weight"

    weight: torch.Tensor = field(repr=False)
    bias: torch.Tensor | None = field(default=None, repr=False)
    name: str = "probe"

    def __post_init__(self) -> None:
        check_tensor(self, "weight")
        if self.weight.dim() not in (1, 2) or self.weight.shape[-1] == 0:
            raise ValueError(f"{op_name(self)}: weight has shape {tuple(self.weight.shape)}; "
                             "give [width] for one score a token, or [k, width] for k")
        if self.bias is not None:
            check_tensor(self, "bias")
            if tuple(self.bias.shape) not in ((), tuple(self.weight.shape[:-1])):
                raise ValueError(f"{op_name(self)}: bias has shape {tuple(self.bias.shape)}; "
                                 f"give {list(self.weight.shape[:-1])} (one per score) or a "
                                 "number")
        check_result_name(self, "name")
        super().__post_init__()

    def saved_names(self, location: str) -> tuple[str, ...]:
        """The scores, under `f"{location}.{name}"`."""
        return (f"{location}.{self.name}",)

    def tensor_misfit(self, given: tuple[int, ...], location: str, value: ValueShape
                      ) -> str | None:
        """A score of each token's row: a `[width]` or `[k, width]` weight over a value
        `[1 tokens width]` only."""
        token_axis = value.token_axis
        if token_axis is None:
            return None
        if token_axis == 1 and len(value.shape) == 3 and given[-1:] == value.shape[-1:]:
            return None
        return (f"has shape {list(given)}; a probe's weight for {location} {value.describe()} "
                f"is [width] or [k, width] over a value [1 tokens width]"
                + (f": give [{value.shape[-1]}] or [k, {value.shape[-1]}]"
                   if token_axis == 1 and len(value.shape) == 3 else ""))

    def scores(self, rows: torch.Tensor) -> torch.Tensor:
        """The probe's scores of `rows` (`[1, tokens, width]`), in float32."""
        if rows.dim() != 3 or rows.shape[-1] != self.weight.shape[-1]:
            raise ValueError(f"the probe's weight is {list(self.weight.shape)}, for a value "
                             f"[1, tokens, {self.weight.shape[-1]}]; this one is "
                             f"{list(rows.shape)}: give a weight whose last axis is the "
                             "value's width, at a value with one row per token")
        weight = self.weight.to(rows.device, torch.float32, non_blocking=True)
        scores = rows.float() @ (weight if weight.dim() == 1 else weight.T)
        if self.bias is not None:
            scores = scores + self.bias.to(rows.device, torch.float32, non_blocking=True)
        return scores

    def serve(self, visit: Visit) -> None:
        """Score the rows the op keeps and save the scores (rank 0 keeps them)."""
        if visit.token_axis != 1:
            layout = " ".join(visit.value.eproperty.layout)
            raise ValueError(f"a probe needs a value with one row per token along its second "
                             f"axis; {visit.location} is [{layout}]")
        if not visit.services.keeps_saves:  # only rank 0 keeps saves: nothing to compute
            return
        found = [(first, (self.scores(rows),)) for first, rows in self.kept_reads(visit)]
        self.keep_results(visit, self.saved_names(visit.location), found, lambda device: (
            torch.empty(1, 0, *self.weight.shape[:-1], device=device),))


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
        keep are written back as read (`kept_rows`); with `tokens`, request by request."""
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
            keep = self.kept_rows(positions, torch.full_like(positions, prompt_length))
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


def _runs(offsets: Iterable[int]) -> list[tuple[int, int]]:
    """Increasing row offsets as runs `(start, stop)` of adjacent rows."""
    runs: list[tuple[int, int]] = []
    for offset in offsets:
        if runs and runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], offset + 1)
        else:
            runs.append((offset, offset + 1))
    return runs


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


@dataclass(frozen=True)
class CallContext:
    """What a `Call` function learns about the rows it is given: `location`, `positions` (the
    absolute position of each row in its own request), `prompt_lengths` (the prompt length of
    each row's request) and `prompt_length` (`None` for a `rowwise` call, whose rows may come
    from several requests)."""

    location: str
    _rows: Span | Selection = field(repr=False)
    prompt_length: int | None
    #: The prompt length of each request of `_rows` (one for a span), in slab order.
    _prompt_lengths: tuple[int, ...] = field(default=(), repr=False)

    @cached_property
    def positions(self) -> torch.Tensor:
        """The absolute position of each row (int64), made when first asked for: most
        functions never ask, and a `Call` runs for every request at every step."""
        rows = self._rows
        return rows.positions() if isinstance(rows, Span) else rows.positions

    @cached_property
    def prompt_lengths(self) -> torch.Tensor:
        """The prompt length of each row's request (int64, one per row, made when first asked
        for): `positions >= prompt_lengths` marks the rows of generated tokens, in a `rowwise`
        call too."""
        rows, lengths = self._rows, torch.tensor(self._prompt_lengths, dtype=torch.long)
        return lengths.expand(len(rows)).clone() if isinstance(rows, Span) else \
            rows.per_row(lengths)


@dataclass(frozen=True)
class Call(Op):
    """Run `fn(value, ctx)` on this request's value at `location`, each step it runs.

    How `value` is lent is the read mode, `reads` (default: the engine's, `LLM(interp_reads=)`):

    - `"lease"` (the engine default): a private copy you may keep — the engine never overwrites
      it; edit it in place or return a replacement, and the change is written back to this
      request's rows only. An untouched value costs one copy and writes nothing.
    - `"copy"`: a private copy; only a returned replacement is written back (in-place edits
      stay in your copy), for code that scribbles on what it reads.
    - `"view"`: the engine's own rows where the value is stored as read (`Rows`, `Heads`
      values); no copy, in-place edits land at once, but a kept view may be overwritten by the
      engine's later in-place kernels. Values computed from the rows (a fused stream's two
      halves, patterns, probabilities) are lent as a lease instead.

    `ctx` has `location`, `positions` (absolute position of each row), `prompt_length` and
    `prompt_lengths` (the prompt length again, one per row). The
    function is cloudpickled, so it runs in the worker process(es) — on every rank under tensor
    parallelism, with the whole value — and what it keeps lives there (save values with `Save`).

    `rowwise=True` promises that the function treats every row on its own — row i of what it
    returns (or writes in place) depends on row i of the value only, as an SAE's encoder and
    decoder, a probe or a per-token rule do — and keeps no state of its own per request. Then
    the requests running this same program are handed to it together: one call a step for all
    their rows at the location (a value of row-by-row values only: the residual stream,
    attention and MLP outputs, queries, keys, values, neurons), instead of one call per
    request; `ctx.positions` and `ctx.prompt_lengths` give each row's position and its
    request's prompt length, and `ctx.prompt_length` is `None`. The rows are lent as a private
    copy (a lease, or a copy in `"copy"` mode). Where that call raises or leaves a row not
    finite, the requests are run again one by one, so that only those at fault fail (the
    function then runs twice on their rows). Values that are not row by row (attention
    patterns) are always served per request.

    `saves="name"` makes the function's return value a result to keep rather than a
    replacement: a tensor `[1, rows, ...]` (one row per row it was handed: `ctx.positions`)
    lands in `outputs[i].saved[f"{location}.{name}"]` as a `Save` would keep it — concatenated
    over steps in position order — and a dict of such tensors under
    `f"{location}.{name}.{key}"` (a probe's score per token moves a few bytes instead of the
    residual). In-place edits of the value still land; returning `None` keeps nothing that
    step. Such calls are served request by request.
    """

    kind = "call"

    fn: Any = field(repr=False)
    reads: ReadMode | None = None
    rowwise: bool = False
    saves: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rowwise, bool):
            raise TypeError(f"{op_name(self)}: rowwise must be True or False, not "
                            f"{self.rowwise!r}")
        check_result_name(self, "saves")

    def shares_rows(self) -> bool:
        """Whether the requests running this call are served with one call a step
        (`rowwise=True`, and no results to keep: those are kept request by request)."""
        return self.rowwise and self.saves is None

    def serve_group(self, server: GroupServer) -> bool:
        """Served together as a call."""
        return server.call(self)

    def saved_names(self, location: str) -> tuple[str, ...]:
        """The result's name, where the function returns one tensor (a dict's keys are known
        only when it returns)."""
        return () if self.saves is None else (f"{location}.{self.saves}",)

    def data_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """The function as cloudpickled bytes; a bad read mode is refused here, in the user's
        process."""
        import cloudpickle

        if self.reads is not None and self.reads not in READ_MODES:
            raise ValueError(f"Call(reads={self.reads!r}): the read mode must be one of "
                             f"{', '.join(READ_MODES)} (or None for the engine's)")
        return {**fields, "fn": cloudpickle.dumps(self.fn)}

    @classmethod
    def fields_from_data(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """The function unpickled (in the worker: each request gets its own unless the call is
        `rowwise`); bytes that are no function are refused naming the field."""
        try:
            fn = pickle.loads(fields["fn"])
        except Exception as error:  # unpickling raises whatever the bytes make it raise
            raise ValueError(f"call: fn is not a cloudpickled function ({type(error).__name__}: "
                             f"{error}); send base64.b64encode(cloudpickle.dumps(fn))") from None
        return {**fields, "fn": fn}

    def serve(self, visit: Visit) -> None:
        """Lend the value to the function in the op's read mode and write back what changed."""
        mode = self.reads or visit.services.reads
        lent = None
        if mode == "view" and (view := visit.value.view(visit.rows, visit.want.step)) is not None:
            lent = lend(view, "view")
        if lent is None:  # a copy, or a value not stored as read (lent as a lease)
            # Read outside inference mode, so the copy counts its in-place edits.
            with torch.inference_mode(False):
                value = visit.read()
            lent = lend(value, "copy" if mode == "copy" else "lease", owned=True)
        prompt_length = visit.want.step.prompt_length
        context = CallContext(visit.location, visit.want.span,
                              None if self.rowwise else prompt_length, (prompt_length,))
        result = self.run_user_code(lent.value, context)
        if self.saves is not None:
            self.keep_results(visit, result)
            result = None  # a result, not a replacement: only in-place edits are written
        edited = lent.written(result)
        if edited is None:
            if lent.mode == "view":  # its writes landed already: say so if they broke it
                refuse_non_finite(lent.value, "the function (in view mode: its writes landed)",
                                  visit.location)
            return  # untouched: nothing is written
        visit.write_if_finite(edited, "the function" if edited is lent.value else
                              "the function's result")

    def keep_results(self, visit: Visit, result: Any) -> None:
        """Keep what a `saves` call returned, per position as a `Save` keeps its rows; a result
        of another form fails the request, naming what it should be."""
        if result is None:
            return
        name = f"{visit.location}.{self.saves}"
        found = result.items() if isinstance(result, dict) else [(None, result)]
        rows = len(visit.want.span)
        kept = []
        for key, tensor in found:
            label = name if key is None else f"{name}.{key}"
            if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 \
                    or tensor.shape[0] != 1 or tensor.shape[1] != rows:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else \
                    type(tensor).__name__
                raise ValueError(f"Call(saves={self.saves!r}) returned {shape} for {label}; "
                                 f"return a tensor [1, {rows}, ...] (one row per row handed "
                                 "to the function: ctx.positions) or a dict of them")
            kept.append((label, tensor.detach().clone()))
        if not visit.services.keeps_saves:
            return
        first = visit.want.span.first_position
        for label, tensor in kept:
            visit.services.store.save(visit.want.program_id, label, first, tensor, 1)

    def run_user_code(self, value: torch.Tensor, context: CallContext) -> Any:
        """`fn(value, context)`: the one frame between our code and the user's, which
        `failure_detail` cuts a traceback at."""
        return self.fn(value, context)

    def failure_detail(self, error: BaseException) -> str:
        """The traceback lines of the function's failure below our call into it (the user's own
        code, with its file and line); nothing for an error raised outside the function (its
        result refused), which names what is wrong itself."""
        frames = traceback.extract_tb(error.__traceback__)
        ours = [index for index, frame in enumerate(frames)
                if frame.filename == __file__ and frame.name == "run_user_code"]
        user = frames[ours[-1] + 1:] if ours else []
        if not user:
            return ""
        return "\n" + "".join(traceback.format_list(user)).rstrip()


OPS_BY_KIND: dict[str, type[Op]] = {
    op.kind: op for op in (Save, Add, Set, Scale, Zero, ProjectOut, Skip, Call, Lens, Probe)}


def op_from_data(data: dict[str, Any]) -> Op:
    """The op `Op.to_data` made `data` from, checked again as when the user made it."""
    kind = data.get(TAG)
    op_class = OPS_BY_KIND.get(kind) if isinstance(kind, str) else None
    if op_class is None:
        raise ValueError(f"unknown op {kind!r}: the ops are {', '.join(OPS_BY_KIND)}")
    fields = {name: field_from_data(value) for name, value in data.items() if name != TAG}
    return op_class(**op_class.fields_from_data(fields))
