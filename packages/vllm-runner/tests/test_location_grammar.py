"""The location grammar on its own (`ops.locations.resolve`): layer indices, ranges and `*`
expand to the model's canonical locations, and a range that reaches past the model or names no
layer is refused by name instead of being cut to what exists."""

from __future__ import annotations

import pytest
from vllm_runner.errors import LocationError
from vllm_runner.ops.locations import resolve

LAYERS = 4
CANONICAL = [f"layers.{index}.{value}" for index in range(LAYERS)
             for value in ("layer_output", "self_attn.attention_queries")] + ["logits"]


@pytest.mark.parametrize(("pattern", "indices"), [
    ("layers.*.layer_output", [0, 1, 2, 3]),
    ("layers.1:3.layer_output", [1, 2]),
    ("layers.2:.layer_output", [2, 3]),
    ("layers.:4.layer_output", [0, 1, 2, 3]),  # the whole model: stop may be its depth
    ("layers.-2:.layer_output", [2, 3]),
    ("layers.-4:-1.layer_output", [0, 1, 2]),
    ("layers.-1.layer_output", [3]),
])
def test_layers_expand_to_the_models_locations(pattern, indices) -> None:
    assert resolve(pattern, CANONICAL, LAYERS) == [f"layers.{i}.layer_output" for i in indices]


def test_a_value_name_unique_in_its_layer_needs_no_host() -> None:
    assert resolve("layers.0:2.attention_queries", CANONICAL, LAYERS) == [
        "layers.0.self_attn.attention_queries", "layers.1.self_attn.attention_queries"]


@pytest.mark.parametrize(("pattern", "message"), [
    ("layers.0:40.layer_output", r"'0:40' reaches past the model \(it has 4 layers: 0..3"),
    ("layers.5:.layer_output", "'5:' reaches past the model"),
    ("layers.-5:.layer_output", "'-5:' reaches past the model"),
    ("layers.3:1.layer_output", "'3:1' names no layer"),
    ("layers.4:4.layer_output", "'4:4' names no layer"),
    ("layers.a:b.layer_output", "bad layer range 'a:b'"),
    ("layers.4.layer_output", "layer 4 does not exist"),
])
def test_a_range_past_the_model_or_naming_no_layer_is_refused_by_name(pattern, message) -> None:
    with pytest.raises(LocationError, match=message):
        resolve(pattern, CANONICAL, LAYERS)
