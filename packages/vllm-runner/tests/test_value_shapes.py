"""The server's check of a vector against a value's shape before queueing (`value_shapes`),
against torch's own broadcasting: refused exactly when no token count would let it fit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm_runner import ops
from vllm_runner.value_shapes import ValueShape, check_tensors_fit, misfit, shapes_from_saves

SIZES = st.sampled_from([1, 2, 3, 4])


def fits_some_step(given_shape: tuple[int, ...], value: ValueShape) -> bool:
    """torch's answer: the tensor broadcasts over the value at some token count (the counts a
    step could have that matter: 1, and the tensor's own extent along the tokens axis)."""
    counts = {1, 2}
    offset = len(value.shape) - value.token_axis
    if len(given_shape) >= offset:
        counts.add(given_shape[-offset])
    for count in counts:
        step = list(value.shape)
        step[value.token_axis] = count
        try:
            if torch.broadcast_shapes(given_shape, tuple(step)) == tuple(step):
                return True
        except RuntimeError:
            pass
    return False


@settings(max_examples=300, deadline=None)
@given(st.lists(SIZES, min_size=1, max_size=3), st.integers(0, 3),
       st.lists(SIZES, min_size=0, max_size=5))
def test_a_vector_is_refused_exactly_when_torch_could_not_broadcast_it(
        sizes: list[int], tokens_at: int, vector: list[int]) -> None:
    tokens_at = min(tokens_at, len(sizes))
    layout = ["batch", *[f"axis{i}" for i in range(len(sizes))]]
    layout.insert(1 + tokens_at, "tokens")
    shape = [1, *sizes]
    shape.insert(1 + tokens_at, 1)
    value = ValueShape(tuple(layout), tuple(shape))
    op = ops.Add("layers.0.layer_output", torch.zeros(vector))
    reason = misfit(op, op.vector, "layers.0.layer_output", value)
    assert (reason is None) == fits_some_step(tuple(vector), value), reason


RESIDUAL = ValueShape(("batch", "tokens", "hidden"), (1, 1, 8))


@pytest.mark.parametrize(("direction", "fits"), [([8], True), ([1, 8], False), ([4], False)])
def test_a_direction_is_one_vector_along_the_last_axis(direction: list[int], fits: bool) -> None:
    op = ops.ProjectOut("layers.0.layer_output", torch.ones(direction))
    assert (misfit(op, op.direction, "layers.0.layer_output", RESIDUAL) is None) == fits


def test_the_first_misfit_names_its_op_and_field_and_the_size_to_give() -> None:
    shapes = {"layers.0.layer_output": RESIDUAL, "layers.1.layer_output": RESIDUAL,
              "layers.1.mlp_neurons": ValueShape(("batch", "tokens", "intermediate"),
                                                 (1, 1, 16))}
    program = [ops.Save("layers.0.layer_output"), ops.Add("layers.*.layer_output", torch.ones(8)),
               ops.Set("layers.1.mlp_neurons", torch.ones(8))]
    located = [["layers.0.layer_output"], ["layers.0.layer_output", "layers.1.layer_output"],
               ["layers.1.mlp_neurons"]]
    field, message = check_tensors_fit(program, located, shapes) or ("", "")
    assert field == "interventions[2].value"
    assert "[8]" in message and "[1 tokens 16]" in message and "give e.g. [16]" in message
    # A location whose shape was not learned is left to the worker's check at each step.
    assert check_tensors_fit(program, located, {}) is None


def test_only_values_with_a_tokens_axis_get_a_shape() -> None:
    layouts = {"layers.0.layer_output": ["batch", "tokens", "hidden"],
               "layers.0.attention_probabilities": ["batch", "heads", "query", "key"]}
    saved = {"layers.0.layer_output": torch.zeros(1, 1, 8),
             "layers.0.attention_probabilities": torch.zeros(1, 4, 1, 1)}
    assert shapes_from_saves(layouts, saved) == {"layers.0.layer_output": RESIDUAL}
