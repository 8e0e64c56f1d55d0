"""Set, Scale, Zero, ProjectOut, Skip and edits of the logits: each equals transformers with the
same edit done by hand — the same greedy tokens and log-probabilities of the chosen tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import GENERATED, PROMPTS
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops

GENERATOR = torch.Generator().manual_seed(11)
VECTOR = torch.randn(128, generator=GENERATOR)
DIRECTION = torch.randn(128, generator=GENERATOR)
LOGIT_SHIFT = torch.randn(256, generator=GENERATOR) * 3


def _output_edit(fn):
    """A forward hook applying `fn` to a module's (first) output."""
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (fn(output[0]), *output[1:])
        return fn(output)
    return hook


def _input_edit(fn):
    """A forward pre-hook applying `fn` to a module's first argument."""
    def pre_hook(module, args):
        return (fn(args[0]), *args[1:])
    return pre_hook


def _zero_heads(heads: list[int], head_dim: int = 32):
    def edit(x):
        x = x.clone()
        for head in heads:
            x[..., head * head_dim:(head + 1) * head_dim] = 0
        return x
    return edit


def _project_out(x):
    unit = DIRECTION / DIRECTION.norm()
    return x - (x @ unit).unsqueeze(-1) * unit


CASES = {
    "scale": (ops.Scale("layers.1.layer_output", 0.5),
              lambda m: m.model.layers[1].register_forward_hook(_output_edit(lambda x: x * 0.5))),
    "set": (ops.Set("layers.1.mlp.mlp_output", VECTOR),
            lambda m: m.model.layers[1].mlp.register_forward_hook(
                _output_edit(lambda x: VECTOR.expand_as(x)))),
    "zero-heads": (ops.Zero("layers.1.self_attn.attention_head_outputs", heads=(1, 3)),
                   lambda m: m.model.layers[1].self_attn.o_proj.register_forward_pre_hook(
                       _input_edit(_zero_heads([1, 3])))),
    "zero-neurons": (ops.Zero("layers.0.mlp_neurons"),
                     lambda m: m.model.layers[0].mlp.down_proj.register_forward_pre_hook(
                         _input_edit(torch.zeros_like))),
    "project-out": (ops.ProjectOut("layers.2.layer_output", DIRECTION),
                    lambda m: m.model.layers[2].register_forward_hook(_output_edit(_project_out))),
    # The sampler and the logprobs see the edited logits.
    "add-logits": (ops.Add("logits", LOGIT_SHIFT),
                   lambda m: m.lm_head.register_forward_hook(
                       _output_edit(lambda x: x + LOGIT_SHIFT))),
}


@torch.no_grad()
def transformers_run(model, prompt: list[int], install) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities with the hand-made edit installed."""
    handle = install(model)
    try:
        tokens, logprobs = list(prompt), []
        for _ in range(GENERATED):
            scores = model(torch.tensor([tokens])).logits[0, -1].log_softmax(-1)
            tokens.append(int(scores.argmax()))
            logprobs.append(float(scores.max()))
        return tokens[len(prompt):], logprobs
    finally:
        handle.remove()


@pytest.mark.parametrize("name", list(CASES))
def test_edit_equals_transformers_by_hand(llm, reference, name) -> None:
    """Three requests run the same edit, one runs none. The three are edited together
    (`row_serving.serve_together`): requests 0 and 1 as one run of rows wherever they are
    adjacent (every decode step), request 3 as a run of its own. Each edited request equals
    transformers; the plain one is untouched."""
    op, install = CASES[name]
    params = SamplingParams(max_tokens=GENERATED, temperature=0.0, logprobs=0)
    *edits, plain, last = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[1])] * 4, params,
                                       interventions=[[op], [op], [], [op]], use_tqdm=False)
    tokens, logprobs = transformers_run(reference, PROMPTS[1], install)
    for edited in (*edits, last):
        assert edited.error is None
        completion = edited.outputs[0]
        assert list(completion.token_ids) == tokens
        chosen = [step[token].logprob
                  for step, token in zip(completion.logprobs, tokens, strict=True)]
        assert torch.allclose(torch.tensor(chosen), torch.tensor(logprobs), atol=1e-4)
    plain_logprobs = [step[token].logprob for step, token in
                      zip(plain.outputs[0].logprobs, plain.outputs[0].token_ids, strict=True)]
    assert plain_logprobs != chosen, "the edit had no effect"


def test_a_value_of_two_rows_gives_each_request_its_own_positions_row(llm) -> None:
    """Two one-token prompts share a step as two adjacent rows; a `Set` value of two rows is a
    value per position (rows for positions 0 and 1), so each request gets row 0 at its own
    position 0 — never one of the two rows each because they happen to sit side by side."""
    rows = torch.randn(2, 128, generator=torch.Generator().manual_seed(2))
    outputs = llm.generate([TokensPrompt(prompt_token_ids=[5]), TokensPrompt(prompt_token_ids=[9])],
                           SamplingParams(max_tokens=1, temperature=0.0),
                           interventions=[[ops.Set("layers.0.layer_output", rows),
                                           ops.Save("layers.0.layer_output")]] * 2,
                           use_tqdm=False)
    for output in outputs:
        assert output.error is None, output.error
        assert torch.equal(output.saved["layers.0.layer_output"], rows[:1].unsqueeze(0))


def test_a_value_that_fits_no_row_is_refused_naming_its_shape(llm) -> None:
    """A `Set` value whose last axis is not the value's fails its request with the shapes."""
    outputs = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])],
                           SamplingParams(max_tokens=1, temperature=0.0),
                           interventions=[ops.Set("layers.0.layer_output", torch.zeros(2, 127))],
                           use_tqdm=False)
    assert outputs[0].error is not None and "set at layers.0.layer_output" in outputs[0].error
    assert "has shape (2, 127), which does not broadcast over the value" in outputs[0].error


def test_skip_makes_a_layer_pass_its_input_through_for_one_request(llm, reference) -> None:
    params = SamplingParams(max_tokens=GENERATED, temperature=0.0)
    skipped, plain = llm.generate(
        [TokensPrompt(prompt_token_ids=PROMPTS[0]), TokensPrompt(prompt_token_ids=PROMPTS[0])],
        params, interventions=[[ops.Skip(1), ops.Save("layers.*.layer_output")],
                               [ops.Save("layers.*.layer_output")]], use_tqdm=False)
    assert skipped.error is None
    # The skipped layer's output is its input: layer 0's output.
    assert torch.equal(skipped.saved["layers.1.layer_output"],
                       skipped.saved["layers.0.layer_output"])
    assert not torch.allclose(plain.saved["layers.1.layer_output"],
                              plain.saved["layers.0.layer_output"])

    def identity(module, args, kwargs, output):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = reference.model.layers[1].register_forward_hook(identity, with_kwargs=True)
    try:
        tokens = list(PROMPTS[0])
        with torch.no_grad():
            for _ in range(GENERATED):
                tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
    finally:
        handle.remove()
    assert list(skipped.outputs[0].token_ids) == tokens[len(PROMPTS[0]):]
