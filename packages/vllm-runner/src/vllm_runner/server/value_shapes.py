"""What the server checks before a request is queued from each value's shape (issue [L]): a
tensor that could never fit the value it edits (`check_tensors_fit`), and the most bytes a
request's saves can take (`saved_bytes_bound`).

The shapes are not computed from the model's config: the values' sizes come from the engine's
own modules (sharded, fused, per family), so the server asks the engine itself, at start-up,
with one request of one token that saves every value (`ServerState.learn_shapes`). A shape says
nothing about token counts: each step's own shape is still checked in the worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from vllm_runner.ops import Add, Op, Probe, ProjectOut, Save, Set

#: The tensor each op that brings one (an edit's, a probe's weight) has, by its field's name in
#: the op and in JSON.
TENSOR_FIELDS: dict[type[Op], str] = {Add: "vector", Set: "value", ProjectOut: "direction",
                                      Probe: "weight"}


@dataclass(frozen=True)
class ValueShape:
    """A value as saved for a one-token prompt: its axis names, its sizes (the tokens axis, or
    a pattern's query and key axes, at 1) and the bytes of one element as saved."""

    layout: tuple[str, ...]
    shape: tuple[int, ...]
    itemsize: int = 4

    @property
    def token_axis(self) -> int | None:
        """The axis that runs along tokens; `None` for a pattern (query by key)."""
        return self.layout.index("tokens") if "tokens" in self.layout else None

    def describe(self) -> str:
        """The shape with its axis names, the tokens axis left open, e.g. `[1 tokens 576]`."""
        sizes = ["tokens" if axis == self.token_axis else str(size)
                 for axis, size in enumerate(self.shape)]
        return "[" + " ".join(sizes) + "] (" + " ".join(self.layout) + ")"

    def bytes_per_row(self) -> int:
        """Bytes saved per token (per query-key pair for a pattern)."""
        return math.prod(self.shape) * self.itemsize


def shapes_from_saves(layouts: dict[str, list[str]],
                      saved: dict[str, torch.Tensor]) -> dict[str, ValueShape]:
    """The shapes of the values a one-token request saved, by location (values it did not save
    are left out: nothing is checked for them before queueing)."""
    return {location: ValueShape(tuple(layouts[location]), tuple(tensor.shape),
                                 tensor.element_size())
            for location, tensor in saved.items() if location in layouts}


def saved_bytes_bound(ops: list[Op], locations: list[list[str]],
                      shapes: dict[str, ValueShape], prompt_length: int,
                      max_tokens: int) -> int:
    """The most bytes a request's `Save` ops can keep, for a prompt of `prompt_length` tokens
    generating up to `max_tokens`: exactly what they keep when it generates all of them.

    Each value is saved at every position the request runs through (the prompt and each
    generated token but the last), `logits` at each sampled row, a pattern at each of those
    positions against every key up to the last; `positions` and `steps` narrow that. Values
    whose shape is unknown count nothing."""
    total = 0
    run_through = prompt_length + max(max_tokens - 1, 0)
    for op, acting_at in zip(ops, locations, strict=True):
        if not isinstance(op, Save):
            continue
        for location in acting_at:
            value = shapes.get(location)
            if value is None:
                continue
            if value.token_axis is None:  # a pattern: a row per position, a column per key
                queries = {"all": run_through, "prefill": prompt_length,
                           "decode": run_through - prompt_length}[op.steps]
                if op.positions is not None:
                    queries = min(queries, len(set(op.positions)))
                widest = prompt_length if op.steps == "prefill" else run_through
                rows = queries * widest
            else:
                if location == "logits":  # one row per sampled token, the first at prefill
                    rows = {"all": max_tokens, "prefill": min(max_tokens, 1),
                            "decode": max(max_tokens - 1, 0)}[op.steps]
                else:
                    rows = {"all": run_through, "prefill": prompt_length,
                            "decode": run_through - prompt_length}[op.steps]
                if op.positions is not None:
                    rows = min(rows, len(set(op.positions)))
            total += rows * value.bytes_per_row()
    return total


def misfit(op: Op, tensor: torch.Tensor, location: str, value: ValueShape) -> str | None:
    """Why `tensor` (the op's vector, value or direction) could not fit the value at `location`
    at any token count, or `None` if it could."""
    given = tuple(tensor.shape)
    token_axis = value.token_axis
    if token_axis is None:  # a pattern: its sizes depend on the step (the worker checks)
        return None
    if isinstance(op, Probe):  # scores of each token's row: [1 tokens width] values only
        if token_axis == 1 and len(value.shape) == 3 and given[-1:] == value.shape[-1:]:
            return None
        return (f"has shape {list(given)}; a probe's weight for {location} {value.describe()} "
                f"is [width] or [k, width] over a value [1 tokens width]"
                + (f": give [{value.shape[-1]}] or [k, {value.shape[-1]}]"
                   if token_axis == 1 and len(value.shape) == 3 else ""))
    if isinstance(op, ProjectOut):  # a dot product along the last axis
        if given == value.shape[-1:]:
            return None
        return (f"has shape {list(given)}; a direction for {location} {value.describe()} is one "
                f"vector along its last axis: give [{value.shape[-1]}]")
    fits = len(given) <= len(value.shape)  # more axes than the value: never (as in the worker)
    for offset in range(1, min(len(given), len(value.shape)) + 1):
        axis = len(value.shape) - offset
        if axis != token_axis and given[-offset] not in (1, value.shape[axis]):
            fits = False
    if fits:
        return None
    return (f"has shape {list(given)}, which does not broadcast over {location} "
            f"{value.describe()}: give e.g. [{value.shape[-1]}] for one vector along its last "
            "axis")


def check_tensors_fit(ops: list[Op], locations: list[list[str]],
                      shapes: dict[str, ValueShape]) -> tuple[str, str] | None:
    """The first (field, message) of an op whose tensor could not fit one of its values, or
    `None`; `locations[i]` are the locations op `i` acts at."""
    for index, (op, acting_at) in enumerate(zip(ops, locations, strict=True)):
        field_name = TENSOR_FIELDS.get(type(op))
        if field_name is None:
            continue
        tensor: Any = getattr(op, field_name)
        for location in acting_at:
            value = shapes.get(location)
            reason = None if value is None else misfit(op, tensor, location, value)
            if reason is not None:
                return f"interventions[{index}].{field_name}", f"{field_name} {reason}"
    return None
