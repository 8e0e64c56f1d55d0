"""Lens: the logit lens computed in the engine equals transformers' lm_head(norm(h)) top-k."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import GENERATED, PROMPTS
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops
from vllm_runner.runtime import lens, row_serving


def test_lens_equals_transformers_top_k_at_every_position(llm, reference) -> None:
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[1])],
                             SamplingParams(max_tokens=GENERATED, temperature=0.0),
                             interventions=[ops.Lens("layers.1.layer_output", top_k=5)],
                             use_tqdm=False)
    assert output.error is None
    tokens = PROMPTS[1] + list(output.outputs[0].token_ids)[:-1]
    with torch.no_grad():
        hidden = reference(torch.tensor([tokens]), output_hidden_states=True).hidden_states[2]
        probabilities = reference.lm_head(reference.model.norm(hidden)).softmax(-1)
    expected_probs, expected_tokens = probabilities.topk(5, dim=-1)
    saved_tokens = output.saved["layers.1.layer_output.lens_tokens"]
    saved_probs = output.saved["layers.1.layer_output.lens_probs"]
    assert saved_tokens.shape == (1, len(tokens), 5)
    assert torch.equal(saved_tokens, expected_tokens)
    assert torch.allclose(saved_probs, expected_probs, atol=1e-5)
    assert "layers.1.layer_output" not in output.saved  # no hidden state shipped


@pytest.mark.parametrize("top_k", [0, -3, 2.5, True, "5"])
def test_a_lens_of_no_tokens_is_refused_when_made(top_k) -> None:
    with pytest.raises(ValueError, match="top_k must be"):
        ops.Lens("layers.0.layer_output", top_k=top_k)
    assert ops.Lens("layers.0.layer_output", top_k=np.int64(3)).to_data()["top_k"] == 3


def answers_of(monkeypatch: pytest.MonkeyPatch, name: str) -> list[bool]:
    """What `visits.<name>` (a way of serving a group together) answers each time the engine
    asks it, from now on."""
    answers: list[bool] = []
    way = getattr(row_serving, name)

    def recorded(*args, **kwargs):
        answers.append(way(*args, **kwargs))
        return answers[-1]

    monkeypatch.setattr(row_serving, name, recorded)
    return answers


def test_requests_running_one_lens_are_served_together_each_equal_to_transformers(
        llm, reference, monkeypatch) -> None:
    """Three prompts running the same `Lens`: their rows are projected together (one lens a
    step for all, a few rows at a time here) and each request's top-k equals transformers' on
    its own tokens."""
    monkeypatch.setattr(lens, "LENS_ROWS", 3)
    joined = answers_of(monkeypatch, "_results_together")
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in PROMPTS],
                           SamplingParams(max_tokens=GENERATED, temperature=0.0),
                           interventions=[[ops.Lens("layers.1.layer_output", top_k=5)]] * 3,
                           use_tqdm=False)
    assert joined and all(joined)  # served together, never falling back
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.error is None
        tokens = prompt + list(output.outputs[0].token_ids)[:-1]
        with torch.no_grad():
            hidden = reference(torch.tensor([tokens]), output_hidden_states=True).hidden_states[2]
            probabilities = reference.lm_head(reference.model.norm(hidden)).softmax(-1)
        expected_probs, expected_tokens = probabilities.topk(5, dim=-1)
        assert torch.equal(output.saved["layers.1.layer_output.lens_tokens"], expected_tokens)
        assert torch.allclose(output.saved["layers.1.layer_output.lens_probs"], expected_probs,
                              atol=1e-5)


def test_the_logit_lens_at_each_prompts_last_token_is_served_together_equal_to_transformers(
        llm, reference, monkeypatch) -> None:
    """The usual probe — `Lens(..., positions=(-1,))` at every layer on many prompts — has the
    rows it keeps gathered and projected once a step for all the requests (not one lens each),
    and each request's one row equals transformers' top-k at its prompt's last token."""
    joined = answers_of(monkeypatch, "_results_selected_together")
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in PROMPTS],
                           SamplingParams(max_tokens=GENERATED, temperature=0.0),
                           interventions=[[ops.Lens("layers.*.layer_output", top_k=3,
                                                    positions=(-1,))]] * len(PROMPTS),
                           use_tqdm=False)
    assert joined and all(joined)  # served together, never falling back
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.error is None
        with torch.no_grad():
            states = reference(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        for layer, hidden in enumerate(states[1:]):
            if layer == len(states) - 2:  # the last layer's output is already normed there
                break
            probabilities = reference.lm_head(reference.model.norm(hidden[:, -1:])).softmax(-1)
            expected_probs, expected_tokens = probabilities.topk(3, dim=-1)
            name = f"layers.{layer}.layer_output"
            assert torch.equal(output.saved[f"{name}.lens_tokens"], expected_tokens), name
            assert torch.allclose(output.saved[f"{name}.lens_probs"], expected_probs,
                                  atol=1e-5), name
