"""Edited attention patterns: a request's own attention output, computed from the pattern it
edited.

vLLM's attention kernels never form the pattern; vllm-envoys recomputes it from the layer's
queries and keys (`vllm_envoys.pattern`), read-only. A request whose program edits
`attention_probabilities` or `attention_scores` (`Set`, `Scale`, `Zero`, `Call` ...) gets the
layer's output as eager attention would make it from the edited pattern: at the layer's input
the edit is kept with the request's values of every position so far (`EditedPatterns`), and at
the layer's output its rows of the head outputs are replaced by `probabilities @ values`
(`PatternOutput`, an op the worker adds to such programs: `with_pattern_outputs`). Other
requests keep the fused kernel's output; the KV cache is untouched (keys and values are the
layer's inputs, which the edit does not change), so later steps attend as before.

Scores are turned into probabilities with the layer's softmax (its attention sinks included),
so `-inf` on a score masks that key. Served on the plain module tree (eager steps) at one rank:
under tensor parallelism the values the output needs are each rank's piece, and such edits are
refused before the request runs (`edit_refusal`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm_envoys import Step, Value
from vllm_envoys.pattern import Pattern, probabilities_from

from vllm_runner.errors import LocationError
from vllm_runner.ops import Op, Skip

if TYPE_CHECKING:
    from vllm_runner.serving import Visit

#: The value whose rows an edited pattern's output replaces, beside the pattern on its host.
HEAD_OUTPUTS = "attention_head_outputs"
VALUES = "attention_values"


def is_pattern(value: Value) -> bool:
    """Whether `value` is an attention pattern (recomputed from queries and keys)."""
    return isinstance(value.eproperty.codec, Pattern)


def sibling(value: Value, name: str) -> str:
    """The location of the value `name` on `value`'s host (`layers.1.self_attn.<name>`)."""
    return f"{value.host.location}.{name}"


def edit_refusal(value: Value, values: dict[str, Value], tensor_parallel: bool) -> str | None:
    """Why an edit at `value` can never be served, or `None`: a read-only value other than a
    pattern; a pattern whose host lacks the head outputs and values its output is made from,
    or under tensor parallelism."""
    if value.eproperty.writable:
        return None
    if not is_pattern(value):
        return (f"{value.location} is derived and read-only; edit the values it is computed "
                "from instead")
    missing = [name for name in (HEAD_OUTPUTS, VALUES) if sibling(value, name) not in values]
    if missing:
        return (f"{value.location} cannot be edited here: its layer has no "
                f"{' or '.join(missing)} to compute the edited attention from")
    if tensor_parallel:
        return (f"{value.location} is edited at tensor_parallel_size=1 only (each rank holds "
                "a piece of the values the edited attention needs); run the engine at one "
                "rank, or edit attention_head_outputs")
    return None


def head_outputs(probabilities: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Eager attention's output from a pattern: `[1, heads, query, key]` probabilities and
    `[1, kv_heads, key, head_dim]` values (shared by groups of query heads) →
    `[1, query, heads, head_dim]` (the head outputs' layout), in float32."""
    heads, kv_heads = probabilities.shape[1], values.shape[1]
    values = values.float().repeat_interleave(heads // kv_heads, dim=1)
    return (probabilities.float() @ values).transpose(1, 2)


@dataclass
class PendingPattern:
    """A request's edited pattern at one layer this step, and its values so far."""

    pattern: torch.Tensor
    values: torch.Tensor
    probabilities: bool
    module: Any


class EditedPatterns:
    """Per request and attention layer: the values of every position so far (for a request
    whose program edits that layer's pattern), and this step's edited patterns until the
    layer's output takes them."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, str], torch.Tensor] = {}
        self._pending: dict[tuple[str, str], PendingPattern] = {}

    def keep_values(self, program_id: str, pattern: Value, first_position: int, rows: Any,
                    step: Step) -> None:
        """Keep the request's values of this step's positions (the layer's input rows `rows`)
        after those of earlier positions; a recomputed position (after preemption) replaces
        what was kept."""
        host = pattern.host
        step_values = getattr(host, VALUES).read(rows, step)  # [1, kv_heads, tokens, head_dim]
        held_at = (program_id, host.location)
        held = self._values.get(held_at)
        kept = 0 if held is None else min(held.shape[2], first_position)
        if kept < first_position:
            raise ValueError(f"{pattern.location}: the values of positions {kept}.."
                             f"{first_position - 1} never ran through this layer for this "
                             "request, so its edited attention cannot be computed")
        self._values[held_at] = step_values if held is None or kept == 0 else torch.cat(
            [held[:, :, :kept], step_values], dim=2)

    @property
    def active(self) -> bool:
        """Whether some request edited a pattern this step (reads look for it only then)."""
        return bool(self._pending)

    def pending(self, program_id: str, location: str) -> torch.Tensor | None:
        """The request's pattern at `location` as edited so far this step, if it was."""
        found = self._pending.get((program_id, location))
        return None if found is None else found.pattern

    def edit(self, visit: Visit, edited: torch.Tensor) -> None:
        """Take a request's edited pattern (its shape as read), to be served at the layer's
        output; later reads of the pattern in this step see it."""
        current = visit.read()
        if tuple(edited.shape) != tuple(current.shape):
            raise ValueError(f"{visit.location}: an edited pattern must keep its shape "
                             f"{tuple(current.shape)} (as read), not {tuple(edited.shape)}")
        host = visit.value.host
        values = self._values.get((visit.want.program_id, host.location))
        if values is None:
            raise ValueError(f"{visit.location}: no values were kept for this request")
        codec = visit.value.eproperty.codec
        assert isinstance(codec, Pattern)
        self._pending[(visit.want.program_id, visit.location)] = PendingPattern(
            edited.detach().to(current.dtype), values, codec.probabilities, visit.value.module)

    def output(self, program_id: str, location: str) -> torch.Tensor | None:
        """The head outputs `[1, query, heads, head_dim]` of the request's edited pattern at
        `location`, taken (`None` where it edited none this step)."""
        found = self._pending.pop((program_id, location), None)
        if found is None:
            return None
        probabilities = found.pattern if found.probabilities else probabilities_from(
            found.pattern, found.module)
        keys = probabilities.shape[-1]
        return head_outputs(probabilities, found.values[:, :, :keys])

    def end_step(self) -> None:
        """Forget the step's edits (a layer whose output never ran took none)."""
        self._pending.clear()

    def forget(self, program_id: str) -> None:
        """Drop a finished or abandoned request's values and edits."""
        for held_at in [held_at for held_at in self._values if held_at[0] == program_id]:
            del self._values[held_at]
        for held_at in [held_at for held_at in self._pending if held_at[0] == program_id]:
            del self._pending[held_at]


@dataclass(frozen=True)
class PatternOutput(Op):
    """The worker's own op at a layer's head outputs for a request that edits that layer's
    pattern at `source`: its rows replaced by the edited attention (`EditedPatterns.output`).
    Never sent by a client; served before the request's own ops there, so a `Save` or an edit
    of the head outputs sees (and may change) the edited attention."""

    kind = "pattern_output"

    source: str
    #: Whether the edit at `source` may act past the prompt (`Op.acts_past_the_prompt`).
    past_the_prompt: bool = True

    def acts_past_the_prompt(self) -> bool:
        """As the edit it serves."""
        return self.past_the_prompt

    def serve(self, visit: Visit) -> None:
        """Write the edited attention into the request's head outputs, if its pattern was
        edited this step."""
        found = visit.services.patterns.output(visit.want.program_id, self.source)
        if found is not None:
            visit.write_if_finite(found.to(visit.read().dtype), f"the edited {self.source}")


def with_pattern_outputs(ops: tuple[Op, ...], locations_of: Callable[[Op], list[str]],
                         values: dict[str, Value]) -> tuple[Op, ...]:
    """`ops` with a `PatternOutput` in front for every pattern an editing op names (a
    program's ops as decoded; unchanged where none edits a pattern)."""
    added: list[Op] = []
    for op in ops:
        if not op.edits or isinstance(op, Skip):
            continue
        try:
            locations = locations_of(op)
        except LocationError:
            continue  # refused where it is served
        for location in locations:
            value = values[location]
            target = sibling(value, HEAD_OUTPUTS)
            if is_pattern(value) and target in values:
                added.append(PatternOutput(target, location, op.acts_past_the_prompt()))
    return (*added, *ops) if added else ops


def edits_patterns(ops: Sequence[Op]) -> bool:
    """Whether a program holds the worker's pattern outputs (it edits a pattern)."""
    return any(isinstance(op, PatternOutput) for op in ops)
