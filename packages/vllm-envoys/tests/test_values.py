"""The standard tree, availability with reasons, refused writes, and the family registry."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from vllm_envoys import (
    Call,
    Family,
    ReadOnly,
    Step,
    Unavailable,
    UnknownFamily,
    UnknownValue,
    ValueShapeError,
)
from vllm_envoys.families import known, lookup, register

LAYER_VALUES = {"layer_input", "layer_mid", "layer_output"}
ATTENTION_VALUES = {
    "attention_input", "attention_queries", "attention_keys", "attention_values",
    "attention_head_outputs", "attention_scores", "attention_probabilities", "attention_output",
}
MLP_VALUES = {"mlp_input", "mlp_neurons", "mlp_activation", "mlp_output"}


def test_tree_has_nnterp_names_for_every_layer(harness, family) -> None:
    standard = harness.standard
    assert standard.family.model_types[0] == family.case.name
    assert len(standard.layers) == 3
    expected = {"token_embeddings"}
    for i in range(3):
        expected |= {f"layers.{i}.{name}" for name in LAYER_VALUES}
        expected |= {f"layers.{i}.self_attn.{name}" for name in ATTENTION_VALUES}
        expected |= {f"layers.{i}.mlp.{name}" for name in MLP_VALUES}
    assert set(standard.values()) == expected
    native = harness.model.get_submodule(standard.family.layers)
    assert standard.layers[1].module is native[1]
    assert standard.layers[2].mlp.mlp_neurons.module is native[2].mlp.get_submodule(
        standard.layers[2].mlp.down_name)


def test_support_names_every_reason_without_running_anything(harness) -> None:
    support = harness.standard.support()
    unavailable = {location: reason for location, reason in support.items() if reason}
    gated = "act" not in dict(harness.standard.layers[0].mlp.module.named_children())
    if gated:
        assert set(unavailable) == {f"layers.{i}.mlp.mlp_activation" for i in range(3)}
        assert all("gated" in reason and "mlp_neurons" in reason
                   for reason in unavailable.values())
    else:
        assert unavailable == {}
    decode = harness.standard.support(Step(first_position=11, tokens=1, prompt_length=11))
    assert "whole prompt" in decode["layers.0.self_attn.attention_probabilities"]
    assert decode["layers.0.self_attn.attention_queries"] is None


def test_unavailable_and_read_only_values_refuse_with_reasons(harness) -> None:
    layer = harness.standard.layers[0]
    if layer.mlp.mlp_activation.reason() is not None:
        with pytest.raises(Unavailable, match=r"layers.0.mlp.mlp_activation is unavailable"):
            layer.mlp.mlp_activation.read(torch.zeros(2, 8))
    query, key = torch.randn(3, 128), torch.randn(3, 64)
    raw = Call((query, key, torch.randn(3, 64)), {})
    pattern = layer.self_attn.attention_probabilities
    with pytest.raises(Unavailable, match="decode steps"):
        pattern.read(raw, Step(first_position=5, tokens=1, prompt_length=5))
    probabilities = pattern.read(raw, Step(first_position=0, tokens=3, prompt_length=3))
    assert probabilities.shape == (1, 4, 3, 3)
    with pytest.raises(ReadOnly, match="derived and read-only"):
        pattern.write(raw, probabilities, Step(0, 3, 3))


def test_wrong_shape_write_is_refused_before_anything_changes(harness) -> None:
    queries = harness.standard.layers[0].self_attn.attention_queries
    raw = Call((torch.randn(3, 128), torch.randn(3, 64), torch.randn(3, 64)), {})
    value = queries.read(raw)
    assert value.shape == (1, 4, 3, 32)  # [batch, heads, tokens, head_dim]
    with pytest.raises(ValueShapeError, match=r"expected a tensor of shape \(1, 4, 3, 32\)"):
        queries.write(raw, value[:, :, :2])
    rebuilt = queries.write(raw, value)
    assert torch.equal(rebuilt.args[0], raw.args[0])  # a read written back is the same rows


def test_unedited_stream_write_rebuilds_the_stream_exactly(harness) -> None:
    output = harness.standard.layers[1].layer_output
    if output.eproperty.site.indices == ():  # a stream-in/stream-out block has no halves
        stream = torch.randn(4, 128)
        assert torch.equal(output.write(stream, output.read(stream)), stream)
        return
    hidden, residual = torch.randn(4, 128), torch.randn(4, 128)
    stream = output.read((hidden, residual))
    new_hidden, new_residual = output.write((hidden, residual), stream)
    assert torch.equal(new_hidden + new_residual, (hidden + residual))
    assert torch.count_nonzero(new_residual) == 0


def test_unknown_location_suggests_close_names(harness) -> None:
    with pytest.raises(UnknownValue, match=r"did you mean layers.1.self_attn.attention_queries"):
        harness.standard.value("layers.1.self_attn.attention_query")


def test_registry() -> None:
    assert lookup("llama").__name__ == "Llama" and lookup("mistral") is lookup("llama")
    assert {"llama", "qwen2", "qwen3"} <= set(known())
    with pytest.raises(UnknownFamily, match=r"'mamba'.*Families exist for: .*llama.*register"):
        lookup("mamba")

    class Custom(Family):
        model_types = ("custom-arch",)

    register(Custom)
    assert lookup("custom-arch") is Custom


def test_import_pulls_in_no_sibling_above_it_and_no_engine() -> None:
    code = "import sys, json, vllm_envoys; print(json.dumps(sorted(sys.modules)))"
    loaded = set(json.loads(subprocess.check_output([sys.executable, "-c", code], text=True)))
    roots = {name.split(".")[0] for name in loaded}
    assert not roots & {"tpfragments", "vllm_runner", "vllm", "transformers"}
