"""Ports of what users of nnsight and vllm-lens expect from an offline engine: a default program
changed at run time (vllm-lens' persistent hooks, nnsight's `edit()`, the server's
`--interp-default`), and `llm.trace(..., max_new_tokens=...)`."""

from __future__ import annotations

import pytest
import torch
from conftest import GENERATED, PROMPTS
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import LocationError, ops

STEER = torch.randn(128, generator=torch.Generator().manual_seed(8)) * 2.0
STREAM = "layers.1.layer_output"


@pytest.fixture
def restored(llm):
    """The shared engine, its default program removed after the test whatever happens."""
    try:
        yield llm
    finally:
        llm.default_interventions = []


def _run(llm, **call):
    return llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[1])],
                        SamplingParams(max_tokens=GENERATED, temperature=0.0, logprobs=2),
                        use_tqdm=False, **call)[0]


def test_a_default_program_runs_where_a_call_names_none_until_changed(restored) -> None:
    """The user sets a steering default on the engine: calls without `interventions` are
    steered exactly as if they named it; a call's own program replaces it, `[]` runs none;
    setting it again changes later calls; clearing it brings the plain engine back."""
    llm = restored
    plain = _run(llm)
    steer = [ops.Add(STREAM, STEER), ops.Save(STREAM)]
    explicit = _run(llm, interventions=steer)
    llm.default_interventions = steer
    assert llm.default_interventions == steer
    by_default = _run(llm)
    assert by_default.error is None
    assert list(by_default.outputs[0].token_ids) == list(explicit.outputs[0].token_ids)
    assert torch.equal(by_default.saved[STREAM], explicit.saved[STREAM])
    assert by_default.outputs[0].logprobs[0] != plain.outputs[0].logprobs[0], \
        "the steering changed nothing: the test proves nothing"
    none = _run(llm, interventions=[])
    assert none.saved == {} and list(none.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    own = _run(llm, interventions=[ops.Save("layers.0.layer_output")])
    assert set(own.saved) == {"layers.0.layer_output"}
    llm.default_interventions = [ops.Scale(STREAM, 0.5)]  # changed at run time
    assert _run(llm).outputs[0].logprobs[0] != by_default.outputs[0].logprobs[0]
    with llm.trace(TokensPrompt(prompt_token_ids=PROMPTS[1]), max_new_tokens=GENERATED,
                   temperature=0.0, logprobs=2) as t:  # a trace runs it before its own ops
        t.model.layers[0].layer_output.save()
    scaled = _run(llm, interventions=[ops.Scale(STREAM, 0.5)])
    assert scaled.outputs[0].logprobs != plain.outputs[0].logprobs
    assert t.output.outputs[0].logprobs == scaled.outputs[0].logprobs
    llm.default_interventions = []
    assert _run(llm).outputs[0].logprobs == plain.outputs[0].logprobs


def test_a_bad_default_program_is_refused_when_set(restored) -> None:
    """An unknown location in a default program is refused as soon as it is set (not at some
    later call), and the one before stays."""
    llm = restored
    llm.default_interventions = [ops.Save(STREAM)]
    with pytest.raises(LocationError, match="layer_outptu"):
        llm.default_interventions = [ops.Save("layers.1.layer_outptu")]
    with pytest.raises(TypeError, match="list of ops"):
        llm.default_interventions = ["layers.1.layer_output"]
    assert llm.default_interventions == [ops.Save(STREAM)]


def test_trace_takes_max_new_tokens(llm) -> None:
    """nnsight's and transformers' `max_new_tokens=` is `max_tokens`; both at once is refused."""
    prompt = TokensPrompt(prompt_token_ids=PROMPTS[0])
    with llm.trace(prompt, max_new_tokens=3, temperature=0.0) as t:
        t.model.layers[0].layer_output.save()
    assert len(t.output.outputs[0].token_ids) == 3
    with pytest.raises(TypeError, match="max_tokens or max_new_tokens"):
        llm.trace(prompt, max_new_tokens=3, max_tokens=3)
