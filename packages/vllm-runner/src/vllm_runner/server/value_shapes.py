"""What the server checks before a request is queued from each value's shape (issue [L]): a
tensor that could never fit the value it edits (`check_tensors_fit`), and the most bytes a
request's saves can take (`saved_bytes_bound`).

The shapes are not computed from the model's config: the values' sizes come from the engine's
own modules (sharded, fused, per family), so the server asks the engine itself, at start-up,
with one request of one token that saves every value (`ServerState.learn_shapes`). A shape says
nothing about token counts: each step's own shape is still checked in the worker.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_runner.ops import Op
from vllm_runner.ops.base import SAESizes
from vllm_runner.ops.value_shape import ValueShape

__all__ = ["ValueShape", "check_tensors_fit", "misfit", "saved_bytes_bound", "shapes_from_saves"]


def shapes_from_saves(layouts: dict[str, list[str]],
                      saved: dict[str, torch.Tensor]) -> dict[str, ValueShape]:
    """The shapes of the values a one-token request saved, by location (values it did not save
    are left out: nothing is checked for them before queueing)."""
    return {location: ValueShape(tuple(layouts[location]), tuple(tensor.shape),
                                 tensor.element_size())
            for location, tensor in saved.items() if location in layouts}


def saved_bytes_bound(ops: list[Op], locations: list[list[str]],
                      shapes: dict[str, ValueShape], prompt_length: int,
                      max_tokens: int, saes: SAESizes) -> int:
    """The most bytes a request's ops can keep (saves, a lens's top-k, a probe's scores, an
    SAE's features), for a prompt of `prompt_length` tokens generating up to `max_tokens`:
    exactly what they keep when it generates all of them (`Op.saved_bytes`; `saes`: the
    engine's SAEs as `LLM.saes` describes them). Values whose shape is unknown count nothing."""
    total = 0
    for op, acting_at in zip(ops, locations, strict=True):
        for location in acting_at:
            value = shapes.get(location)
            if value is not None:
                total += op.saved_bytes(location, value, prompt_length, max_tokens, saes)
    return total


def misfit(op: Op, tensor: torch.Tensor, location: str, value: ValueShape) -> str | None:
    """Why `tensor` (the op's vector, value or direction) could not fit the value at `location`
    at any token count, or `None` if it could."""
    return op.tensor_misfit(tuple(tensor.shape), location, value)


def check_tensors_fit(ops: list[Op], locations: list[list[str]],
                      shapes: dict[str, ValueShape]) -> tuple[str, str] | None:
    """The first (field, message) of an op whose tensor could not fit one of its values, or
    `None`; `locations[i]` are the locations op `i` acts at."""
    for index, (op, acting_at) in enumerate(zip(ops, locations, strict=True)):
        field_name = op.TENSOR
        if field_name is None:
            continue
        tensor: Any = getattr(op, field_name)
        for location in acting_at:
            value = shapes.get(location)
            reason = None if value is None else misfit(op, tensor, location, value)
            if reason is not None:
                return f"interventions[{index}].{field_name}", f"{field_name} {reason}"
    return None
