"""Lens: the logit lens computed in the engine equals transformers' lm_head(norm(h)) top-k."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import GENERATED, PROMPTS
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops


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
