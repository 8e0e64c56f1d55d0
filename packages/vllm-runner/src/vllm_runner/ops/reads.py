"""The ops that read a value and save what they find: the value itself (`Save`), a logit
lens's top-k (`Lens`) and a linear probe's scores (`Probe`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vllm_runner.ops.base import GroupServer, RowOp, SAESizes
from vllm_runner.ops.checks import (
    check_result_name,
    check_tensor,
    op_name,
)
from vllm_runner.ops.value_shape import ValueShape

if TYPE_CHECKING:
    from vllm_runner.runtime.row_serving import Services, Visit


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
    keeps_rows = True

    def saved_names(self, location: str) -> tuple[str, ...]:
        """The value itself, under its canonical location."""
        return (location,)

    def serve_group(self, server: GroupServer) -> bool:
        """Served together as a save."""
        return server.save(self)

    def saved_bytes(self, location: str, value: ValueShape, prompt_length: int,
                    max_tokens: int, saes: SAESizes) -> int:
        """Exactly what it keeps when the request generates all `max_tokens`: its rows
        (`RowOp.kept_rows`) of the value."""
        return self.kept_rows(location, value, prompt_length, max_tokens) * value.bytes_per_row()

    def saved_runs(self, first_position: int, count: int, prompt_length: int
                   ) -> list[tuple[int, int]]:
        """Every row, or the runs its filters keep (`RowOp.selected_runs`)."""
        return self.selected_runs(first_position, count, prompt_length) if self.filtered \
            else [(0, count)]

    def serve(self, visit: Visit) -> None:
        """Keep the request's rows (on rank 0 only: the client collects from there)."""
        if not visit.services.keeps_saves:
            return
        store, program_id = visit.services.store, visit.want.program_id
        reads = self.selected_reads(visit)
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
class RowResults(RowOp):
    """An op that saves results it computes from each row it keeps, each row alone (a lens's
    top-k, an SAE's features): requests running the same one are served together, their rows
    joined into one computation (`GroupServer.results`)."""

    edits = False
    together = True
    keeps_rows = True
    #: Whether every tensor-parallel rank must compute (the computation holds a collective, as
    #: the lens's gathered logits do); otherwise only the rank that keeps saves does.
    EVERY_RANK: ClassVar[bool] = False

    def row_results(self, rows: torch.Tensor, services: Services) -> tuple[torch.Tensor, ...]:
        """The results of `rows` (`[1, tokens, width]`), one tensor per name of `saved_names`
        in that order, each with one row per token first (`[tokens, ...]`)."""
        raise NotImplementedError(type(self).__name__)

    def serve_group(self, server: GroupServer) -> bool:
        """Served together, its rows joined (`GroupServer.results`)."""
        return server.results(self)


@dataclass(frozen=True)
class Lens(RowResults):
    """A logit lens inside the engine: project the residual value at `location` through the
    model's final norm and unembedding, and save only the top-k tokens and probabilities.

    `saved[f"{location}.lens_tokens"]` and `saved[f"{location}.lens_probs"]` are
    `[1, positions, top_k]`; no hidden state leaves the worker.
    """

    kind = "lens"
    EVERY_RANK = True  # under tensor parallelism the logits are gathered
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

    def saved_bytes(self, location: str, value: ValueShape, prompt_length: int,
                    max_tokens: int, saes: SAESizes) -> int:
        """`top_k` tokens (int64) and probabilities (float32) for each row it reads."""
        return self.kept_rows(location, value, prompt_length, max_tokens) * self.top_k * (8 + 4)

    def row_results(self, rows: torch.Tensor, services: Services) -> tuple[torch.Tensor, ...]:
        """The top-k tokens and their probabilities, through the model's own final norm and
        logits."""
        probabilities, tokens = services.lens(rows, self.top_k)
        return tokens, probabilities

    def serve(self, visit: Visit) -> None:
        """Top-k next-token probabilities of the rows, through the model's own final norm and
        logits (every rank computes them: under tensor parallelism the logits are gathered)."""
        found = []
        for first, rows in self.selected_reads(visit):
            found.append((first, tuple(result.unsqueeze(0) for result in self.row_results(
                rows, visit.services))))
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
    keeps_rows = True
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

    def saved_bytes(self, location: str, value: ValueShape, prompt_length: int,
                    max_tokens: int, saes: SAESizes) -> int:
        """One float32 score (or `k`) for each row it reads."""
        scores = math.prod(self.weight.shape[:-1])
        return self.kept_rows(location, value, prompt_length, max_tokens) * scores * 4

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
        found = [(first, (self.scores(rows),)) for first, rows in self.selected_reads(visit)]
        self.keep_results(visit, self.saved_names(visit.location), found, lambda device: (
            torch.empty(1, 0, *self.weight.shape[:-1], device=device),))
