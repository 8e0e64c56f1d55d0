"""The standard tree, availability with reasons, refused writes, and the family registry."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from vllm_envoys import Family, Step, UnknownFamily, UnknownValue
from vllm_envoys.families import known, lookup, register

LAYER_VALUES = {"layer_input", "layer_mid", "layer_output"}
ATTENTION_VALUES = {
    "attention_input", "attention_queries", "attention_keys", "attention_values",
    "attention_head_outputs", "attention_scores", "attention_probabilities", "attention_output",
}
MLP_VALUES = {"mlp_input", "mlp_neurons", "mlp_activation", "mlp_output"}
ROUTING_VALUES = {"router_logits", "expert_weights", "expert_indices"}
ROUTED_UNAVAILABLE = {"mlp_neurons", "mlp_activation"}


def test_tree_has_nnterp_names_for_every_layer(harness, family) -> None:
    standard = harness.standard
    expected_family = family.case.family
    if expected_family is None:
        assert family.case.name in standard.family.model_types
    else:
        assert standard.family.__name__ == expected_family
    assert len(standard.layers) == 3
    expected = {"token_embeddings", "logits", "next_token_probs"}
    for i in range(3):
        expected |= {f"layers.{i}.{name}" for name in LAYER_VALUES}
        expected |= {f"layers.{i}.self_attn.{name}" for name in ATTENTION_VALUES}
        expected |= {f"layers.{i}.mlp.{name}" for name in MLP_VALUES}
        if i in family.case.moe_layers:
            expected |= {f"layers.{i}.mlp.{name}" for name in ROUTING_VALUES}
    assert set(standard.values()) == expected
    native = harness.model.get_submodule(standard.family.layers)
    assert standard.layers[1].module is native[1]
    if 2 not in family.case.moe_layers:
        assert standard.layers[2].mlp.mlp_neurons.module is native[2].get_submodule(
            standard.layers[2].mlp_name).get_submodule(standard.layers[2].mlp.down_name)


def test_support_names_every_reason_without_running_anything(harness, family) -> None:
    support = harness.standard.support()
    unavailable = {location for location, reason in support.items() if reason}

    def expected_unavailable(location: str) -> bool:
        name = location.rsplit(".", 1)[-1]
        layer = int(location.split(".")[1]) if location.startswith("layers.") else None
        routed = layer in family.case.moe_layers and name in ROUTED_UNAVAILABLE
        return name in family.case.unavailable or routed

    assert unavailable == {location for location in support if expected_unavailable(location)}
    for location in unavailable:
        reason = support[location]
        # Each reason names what to read instead.
        assert any(other in reason for other in ("mlp_neurons", "router_logits",
                                                 "attention_output")), reason
    decode = harness.standard.support(Step(first_position=11, tokens=1, prompt_length=11))
    pattern = decode["layers.0.self_attn.attention_probabilities"]
    if "attention_probabilities" in family.case.unavailable:  # on every step, for one reason
        assert pattern == support["layers.0.self_attn.attention_probabilities"]
    else:
        assert "keys of every earlier position" in pattern


def test_unknown_location_suggests_close_names(harness) -> None:
    with pytest.raises(UnknownValue, match=r"did you mean layers.1.self_attn.attention_queries"):
        harness.standard.value("layers.1.self_attn.attention_query")


def test_registry() -> None:
    assert lookup("llama").__name__ == "Llama" and lookup("mistral") is lookup("llama")
    assert {"llama", "qwen2", "qwen3", "phi3", "gpt2", "gemma2"} <= set(known())
    assert set(known("transformers")) == {"olmo2", "olmoe"}
    assert lookup("olmo2", "transformers").__name__ == "Olmo2"
    # Anything on the Transformers backend without a family gets the generic one...
    assert lookup("llama", "transformers").__name__ == "TransformersBackend"
    # ...while vLLM's own model code with no family is refused with what to do.
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
