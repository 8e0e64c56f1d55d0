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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm_envoys import Step, Value
from vllm_envoys.pattern import Pattern, probabilities_from

from vllm_runner.errors import LocationError
from vllm_runner.ops import Op

if TYPE_CHECKING:
    from vllm_runner.runtime.row_serving import Visit

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
    """A request's edited attention at one layer this step: the probabilities its output is
    made from, the scores as last edited (`None` where only the probabilities were), and its
    values so far."""

    probabilities: torch.Tensor
    scores: torch.Tensor | None
    values: torch.Tensor


class EditedPatterns:
    """Per request and attention layer: the values of every position so far (for a request
    whose program may edit that layer's pattern), and this step's edited attention until the
    layer's output takes it. Scores and probabilities of one layer are one pattern: an edit of
    the scores is seen by a later read of the probabilities (through the layer's softmax), and
    the output is made from the last edit of either."""

    def __init__(self, tensor_parallel: bool = False) -> None:
        #: At more than one rank the values here would be one rank's piece: no edit is served.
        self.tensor_parallel = tensor_parallel
        self._values: dict[tuple[str, str], torch.Tensor] = {}
        self._pending: dict[tuple[str, str], PendingPattern] = {}

    def keep_values(self, program_id: str, pattern: Value, first_position: int, rows: Any,
                    step: Step) -> None:
        """Keep the request's values of this step's positions (the layer's input rows `rows`)
        after those of earlier positions; a recomputed position (after preemption) replaces
        what was kept."""
        if self.tensor_parallel:
            return
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

    def pending(self, program_id: str, pattern: Value) -> torch.Tensor | None:
        """The request's `pattern` (scores or probabilities) as edited so far this step at its
        layer, if it was: scores only where the scores were edited."""
        found = self._pending.get((program_id, pattern.host.location))
        if found is None:
            return None
        codec = pattern.eproperty.codec
        assert isinstance(codec, Pattern)
        return found.probabilities if codec.probabilities else found.scores

    def edit(self, visit: Visit, edited: torch.Tensor) -> None:
        """Take a request's edited pattern (its shape as read), to be served at the layer's
        output; later reads of the layer's pattern in this step see it."""
        if self.tensor_parallel:
            raise ValueError(edit_refusal(visit.value, {}, tensor_parallel=True))
        current = visit.read()
        if tuple(edited.shape) != tuple(current.shape):
            raise ValueError(f"{visit.location}: an edited pattern must keep its shape "
                             f"{tuple(current.shape)} (as read), not {tuple(edited.shape)}")
        held_at = (visit.want.program_id, visit.value.host.location)
        values = self._values.get(held_at)
        if values is None:
            raise ValueError(f"{visit.location}: no values were kept for this request")
        codec = visit.value.eproperty.codec
        assert isinstance(codec, Pattern)
        edited = edited.detach().to(current.dtype)
        if codec.probabilities:
            before = self._pending.get(held_at)
            self._pending[held_at] = PendingPattern(
                edited, None if before is None else before.scores, values)
        else:
            probabilities = probabilities_from(edited, visit.value.module).to(current.dtype)
            self._pending[held_at] = PendingPattern(probabilities, edited, values)

    def output(self, program_id: str, layer: str) -> torch.Tensor | None:
        """The head outputs `[1, query, heads, head_dim]` of the request's edited attention at
        the attention layer `layer`, taken (`None` where it edited none this step)."""
        found = self._pending.pop((program_id, layer), None)
        if found is None:
            return None
        keys = found.probabilities.shape[-1]
        return head_outputs(found.probabilities, found.values[:, :, :keys])

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
    """The worker's own op at a layer's head outputs for a request that may edit the pattern of
    attention layer `layer`: its rows replaced by the edited attention
    (`EditedPatterns.output`). Never sent by a client; one per layer, served before the
    request's own ops there, so a `Save` or an edit of the head outputs sees (and may change)
    the edited attention."""

    kind = "edited_pattern"
    added_by_the_worker = True

    layer: str
    #: Whether an edit of the layer's pattern may act past the prompt
    #: (`Op.acts_past_the_prompt`).
    past_the_prompt: bool = True

    def acts_past_the_prompt(self) -> bool:
        """As the edit it serves."""
        return self.past_the_prompt

    def serve(self, visit: Visit) -> None:
        """Write the edited attention into the request's head outputs, if its pattern was
        edited this step."""
        found = visit.services.patterns.output(visit.want.program_id, self.layer)
        if found is not None:
            dtype = visit.rows.dtype if isinstance(visit.rows, torch.Tensor) else found.dtype
            visit.write_if_finite(found.to(dtype), f"the edited attention of {self.layer}")


def with_pattern_outputs(ops: tuple[Op, ...], locations_of: Callable[[Op], list[str]],
                         values: dict[str, Value]) -> tuple[Op, ...]:
    """`ops` with a `PatternOutput` in front for every attention layer whose pattern an op that
    may edit names (a program's ops as decoded; unchanged where none does)."""
    added: dict[str, bool] = {}  # head outputs location -> acts past the prompt
    layers: dict[str, str] = {}
    for op in ops:
        if not op.edits:
            continue
        try:
            locations = locations_of(op)
        except LocationError:
            continue  # refused where it is served
        for location in locations:
            value = values[location]
            target = sibling(value, HEAD_OUTPUTS)
            if is_pattern(value) and target in values:
                added[target] = added.get(target, False) or op.acts_past_the_prompt()
                layers[target] = value.host.location
    if not added:
        return ops
    return (*(PatternOutput(target, layers[target], past) for target, past in added.items()),
            *ops)
