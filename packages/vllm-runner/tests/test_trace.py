"""`llm.trace(...)`: the nnsight-style form runs the same program as `generate` with the same ops,
and reports a failed program as an exception."""

from __future__ import annotations

import pytest
import torch
from conftest import GENERATED, PROMPTS
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import InterventionError, LocationError, ops

STEER = torch.randn(128, generator=torch.Generator().manual_seed(5))


def test_trace_equals_generate_with_the_same_ops(llm) -> None:
    prompt = TokensPrompt(prompt_token_ids=PROMPTS[0])
    with llm.trace(prompt, max_tokens=GENERATED, temperature=0.0) as t:
        t.model.layers[1].layer_output.add(STEER, scale=2.0)
        layer = t.model.layers[2].layer_output.save()
        queries = t.model.layers[0].self_attn.attention_queries.save(steps="prefill")
        every = t.model.layers[1:].mlp_output.save()
        lens = t.model.layers[2].layer_output.lens(top_k=3)
        t.model.layers[0].skip()
        with pytest.raises(RuntimeError, match=r"once the `with llm.trace"):
            _ = layer.value
    (expected,) = llm.generate(
        [prompt], SamplingParams(max_tokens=GENERATED, temperature=0.0),
        interventions=[[ops.Add("layers.1.layer_output", STEER, scale=2.0),
                        ops.Save("layers.2.layer_output"),
                        ops.Save("layers.0.self_attn.attention_queries", steps="prefill"),
                        ops.Save("layers.1:.mlp_output"), ops.Lens("layers.2.layer_output", 3),
                        ops.Skip(0)]], use_tqdm=False)
    assert list(t.output.outputs[0].token_ids) == list(expected.outputs[0].token_ids)
    assert torch.equal(layer.value, expected.saved["layers.2.layer_output"])
    assert queries.value.shape == (1, 4, len(PROMPTS[0]), 32)
    assert set(every.value) == {"layers.1.mlp.mlp_output", "layers.2.mlp.mlp_output"}
    assert torch.equal(lens.value["layers.2.layer_output.lens_tokens"],
                       expected.saved["layers.2.layer_output.lens_tokens"])
    assert set(t.saved) == set(expected.saved)


def test_trace_refuses_bad_locations_and_reports_failures(llm) -> None:
    prompt = TokensPrompt(prompt_token_ids=PROMPTS[2])
    with pytest.raises(LocationError, match=r"closest: layers\.1\.layer_output"), \
            llm.trace(prompt, max_tokens=1) as t:
        t.model.layers[1].layer_outptu.save()

    def fail(value, ctx):
        raise ValueError("nope")

    with pytest.raises(InterventionError, match="ValueError: nope"), \
            llm.trace(prompt, max_tokens=1) as t:
        t.model.layers[1].layer_output.call(fail)
    with pytest.raises(ValueError, match="one layer"):
        t.model.layers[1].self_attn.skip()
