"""What every op is (`Op`) and what the row ops share (`RowOp`: the `positions`, `steps`
and `tokens` filters), with the protocol through which the worker serves many requests
running one op together (`GroupServer`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from vllm_runner.ops.checks import (
    Steps,
    check_where,
    listed,
)
from vllm_runner.ops.data import (
    TAG,
    field_to_data,
)
from vllm_runner.ops.per_position import (
    named_positions,
)
from vllm_runner.ops.value_shape import ValueShape, broadcast_misfit

if TYPE_CHECKING:
    from saecodec import SAE

    from vllm_runner.ops.call import Call
    from vllm_runner.ops.edits import EditOp
    from vllm_runner.ops.reads import RowResults, Save
    from vllm_runner.runtime.row_serving import Visit


PositionFilter = Callable[[int], bool]
#: The engine's SAEs as a worker holds them: name -> (the SAE, the location it reads).
SAELookup = Callable[[str], "tuple[SAE, str]"]
#: The engine's SAEs as a client learns them: name -> `LLM.saes`'s description of it.
SAESizes = Mapping[str, Mapping[str, Any]]


class GroupServer(Protocol):
    """How the worker serves many requests running one op with one read (and one write) per run
    of their rows (`runtime.row_serving.serve_together`): a method per kind of op that can be, each
    returning whether it served them (`False`: they are served one by one). An op picks its
    method (`Op.serve_group`)."""

    def save(self, op: Save) -> bool: ...

    def results(self, op: RowResults) -> bool: ...

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
    #: run of their rows instead of one per request (`row_serving.serve_together`).
    together: ClassVar[bool] = False
    #: Whether the op saves the value itself (its rows as read: `Save`).
    saves_the_value: ClassVar[bool] = False
    #: Whether the op keeps something for each row it reads (the value, a lens's top-k, a
    #: probe's scores, an SAE's features), whose bytes the server bounds before the request
    #: runs (`saved_bytes`).
    keeps_rows: ClassVar[bool] = False
    #: The field of the tensor the op brings (an edit's vector, a probe's weight), checked
    #: against the value's shape before the request runs (`tensor_misfit`), or `None`.
    TENSOR: ClassVar[str | None] = None
    #: Whether the worker adds the op itself (never sent by a client: the edited attention a
    #: pattern edit writes, `runtime.pattern_edits`); the checks of a request's own ops skip it.
    added_by_the_worker: ClassVar[bool] = False
    #: The field that says where it acts (`location`; an SAE op: the SAE's name, `sae`).
    PATTERN_FIELD: ClassVar[str] = "location"

    location: str

    def patterns(self) -> tuple[str, ...]:
        """The location patterns the op acts at (resolved by the worker)."""
        return (self.location,)

    def saved_names(self, location: str) -> tuple[str, ...]:
        """The keys of `outputs[i].saved` the op fills at canonical `location`."""
        return ()

    def position_filter(self, prompt_length: int) -> PositionFilter | None:
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
        return self.together and self.position_filter(0) is None

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

    def saved_bytes(self, location: str, value: ValueShape, prompt_length: int,
                    max_tokens: int, saes: SAESizes) -> int:
        """The most bytes the op keeps reading `value` (at `location`) for a prompt of
        `prompt_length` tokens generating up to `max_tokens` (`keeps_rows`), given the engine's
        SAEs (`saes`: name -> `LLM.saes`'s description); none by default."""
        return 0

    def saved_runs(self, first_position: int, count: int, prompt_length: int
                   ) -> list[tuple[int, int]]:
        """The runs `(offset, rows)` of a request's `count` rows from `first_position` whose
        value the op saves as read (`saves_the_value`); none by default."""
        return []

    def with_saes(self, lookup: SAELookup) -> Op:
        """The op as a worker runs it, given the engine's SAEs (`lookup(name)`: the SAE loaded
        under `name` and the location it reads; it raises for a name the engine has not):
        itself, but for the ops in an SAE's feature space (`ops.features`)."""
        return self

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

    def position_filter(self, prompt_length: int) -> PositionFilter | None:
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

    def selected_runs(self, first_position: int, count: int, prompt_length: int
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

    def selected_reads(self, visit: Visit) -> list[tuple[int, torch.Tensor]]:
        """`(first position, value)` of each run of the request's rows the op keeps at this
        visit (all of them where it has no filter, or the value no token axis): a `Save` or a
        `Lens` with `positions` then keeps and computes those rows only."""
        span = visit.want.span
        if not self.filtered or visit.token_axis is None:
            return [(span.first_position, visit.read())]
        prompt_length = visit.want.step.prompt_length
        if (matching := self.token_rows(visit)) is None:
            runs = self.selected_runs(span.first_position, len(span), prompt_length)
        else:  # the rows the other filters keep that hold one of the tokens (read on the host)
            positions = span.first_position + torch.arange(len(span))
            kept = self.selected_rows(positions, torch.full_like(positions, prompt_length))
            runs = _runs(map(int, (kept & matching.cpu()).nonzero().flatten()))
        return [(span.first_position + start, visit.read_rows(start, stop))
                for start, stop in runs]

    def keep_results(self, visit: Visit, names: tuple[str, ...],
                     found: Sequence[tuple[int, tuple[torch.Tensor, ...]]],
                     empty: Callable[[torch.device], tuple[torch.Tensor, ...]],
                     fills: tuple[float, ...] | None = None) -> None:
        """Keep what the op computed from each run it kept (`found`: its first position and one
        tensor per name of `names`, rows along axis 1), on rank 0 only. Where it kept no row this
        step, one empty piece per name the first time (`empty(device)`, on the value's device:
        the store joins a request's pieces, one device for all), so that the names come back,
        empty where no position they name is ever reached. `fills`, one per name, for results
        whose last axis differs from step to step: what pads them to the widest when joined."""
        if not visit.services.keeps_saves:
            return
        store, program_id = visit.services.store, visit.want.program_id
        if not found:
            if store.has_saves(program_id, names[0]):
                return
            found = [(visit.want.span.first_position, empty(visit.device))]
        for first, results in found:
            for index, (name, result) in enumerate(zip(names, results, strict=True)):
                store.save(program_id, name, first, result, 1,
                           None if fills is None else fills[index], width_is_position=False)

    def selected_rows(self, positions: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor:
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
        return (f"{self.kind} at {self.location}: positions {listed(never)} are before the start "
                f"of the prompt, which has {prompt_length} tokens (-1..-{prompt_length} count "
                "from its end)")

    def kept_rows(self, location: str, value: ValueShape, prompt_length: int,
                  max_tokens: int) -> int:
        """The most rows of `value` (at `location`) the op reads and keeps for a prompt of
        `prompt_length` tokens generating up to `max_tokens`: a row at every position the
        request runs through (the prompt and each generated token but the last), `logits` one
        at each sampled row, a pattern one per position against every key up to the last;
        `positions` and `steps` narrow that (`tokens` may keep them all)."""
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


def _runs(offsets: Iterable[int]) -> list[tuple[int, int]]:
    """Increasing row offsets as runs `(start, stop)` of adjacent rows."""
    runs: list[tuple[int, int]] = []
    for offset in offsets:
        if runs and runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], offset + 1)
        else:
            runs.append((offset, offset + 1))
    return runs
