"""Results from your own code and declarative probes: a `Call(saves=...)` whose function
returns what it computed (a probe's score per token, as vllm-lens' hooks return values), and
`Probe`, the same linear probe as plain data. Each score equals the probe applied to
transformers' hidden states on the same weights; only the scores leave the worker."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops

STREAM = "layers.1.layer_output"
WEIGHT = torch.randn(3, 128, generator=torch.Generator().manual_seed(21))
BIAS = torch.randn(3, generator=torch.Generator().manual_seed(22))
GENERATED = 4
TOLERANCE = 1e-4


def probe_scores(value, ctx):
    """A user's probe: three scores per token, from the rows it is handed (on the engine's
    device, as a user's function moves its own weights there)."""
    return value.float() @ WEIGHT.T.to(value.device) + BIAS.to(value.device)


def norms_and_scores(value, ctx):
    return {"norm": value.norm(dim=-1), "scores": probe_scores(value, ctx)}


@torch.no_grad()
def oracle(reference, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' layer-1 output over the positions the request ran through, probed:
    `[1, positions, 3]`."""
    tokens = prompt + generated[:-1]
    hidden = reference(torch.tensor([tokens]), output_hidden_states=True).hidden_states[2]
    return hidden @ WEIGHT.T + BIAS


def _run(llm, programs):
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt in PROMPTS]
    return llm.generate(prompts, SamplingParams(max_tokens=GENERATED, temperature=0.0),
                        interventions=programs, use_tqdm=False)


def test_a_calls_returned_scores_land_in_saved_per_position(llm, reference) -> None:
    """The user's function returns a probe's score for each row it was handed; the scores of
    every position the request ran through come back under `{location}.{name}` — the 11-token
    prompt cut into chunks beside two other requests — equal to transformers' hidden states
    probed, and no residual is saved."""
    outputs = _run(llm, [[ops.Call(STREAM, probe_scores, saves="probe")]] * len(PROMPTS))
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.error is None, output.error
        assert set(output.saved) == {f"{STREAM}.probe"}
        expected = oracle(reference, prompt, list(output.outputs[0].token_ids))
        got = output.saved[f"{STREAM}.probe"]
        assert got.shape == expected.shape == (1, len(prompt) + GENERATED - 1, 3)
        assert (got - expected).abs().max() <= TOLERANCE


def test_a_call_may_return_a_dict_and_edit_in_place_too(llm, reference) -> None:
    """A dict of results lands under `{location}.{name}.{key}`, computed from the value as
    lent; the function's in-place edit (here: doubling the stream) still reaches the model,
    as a later `Save` shows. A rowwise call's results are kept as well (request by request)."""
    def seen_then_doubled(value, ctx):
        found = norms_and_scores(value, ctx)
        value.mul_(2.0)
        return found

    (output,) = _run(llm, [[ops.Call(STREAM, seen_then_doubled, saves="seen", rowwise=True),
                            ops.Save(STREAM)], [], []])[:1]
    assert output.error is None, output.error
    assert set(output.saved) == {f"{STREAM}.seen.norm", f"{STREAM}.seen.scores", STREAM}
    tokens = PROMPTS[0] + list(output.outputs[0].token_ids)[:-1]
    with torch.no_grad():
        hidden = reference(torch.tensor([tokens]), output_hidden_states=True).hidden_states[2]
    assert (output.saved[f"{STREAM}.seen.scores"] - (hidden @ WEIGHT.T + BIAS)).abs().max() \
        <= TOLERANCE
    assert (output.saved[f"{STREAM}.seen.norm"] - hidden.norm(dim=-1)).abs().max() <= TOLERANCE
    # Layer 1's output at each position depends on earlier layers only: doubled exactly.
    assert (output.saved[STREAM] - 2.0 * hidden).abs().max() <= 2 * TOLERANCE


def test_a_result_of_the_wrong_shape_fails_its_request_naming_the_shape(llm) -> None:
    bad, plain, _ = _run(llm, [[ops.Call(STREAM, lambda value, ctx: value.sum(), saves="s")],
                               [ops.Save(STREAM)], []])
    assert bad.error is not None and "return a tensor [1, " in bad.error, bad.error
    assert plain.error is None and plain.saved[STREAM].shape[1] == len(PROMPTS[1]) + 3


def test_the_probe_op_equals_the_call_and_transformers(llm, reference) -> None:
    """`Probe` (no code: the server takes it) gives the call's scores; with `positions=(-1,)`
    only the prompt's last token's; a one-vector weight gives `[1, positions]`."""
    outputs = _run(llm, [[ops.Probe(STREAM, WEIGHT, BIAS, name="p")],
                         [ops.Probe(STREAM, WEIGHT, BIAS, positions=(-1,))],
                         [ops.Probe(STREAM, WEIGHT[0], name="one")]])
    assert all(output.error is None for output in outputs), [o.error for o in outputs]
    expected = oracle(reference, PROMPTS[0], list(outputs[0].outputs[0].token_ids))
    assert (outputs[0].saved[f"{STREAM}.p"] - expected).abs().max() <= TOLERANCE
    last = oracle(reference, PROMPTS[1], list(outputs[1].outputs[0].token_ids))
    got = outputs[1].saved[f"{STREAM}.probe"]
    assert got.shape == (1, 1, 3)
    assert (got[0, 0] - last[0, len(PROMPTS[1]) - 1]).abs().max() <= TOLERANCE
    one = oracle(reference, PROMPTS[2], list(outputs[2].outputs[0].token_ids))
    expected_one = one[..., 0] - BIAS[0]
    assert outputs[2].saved[f"{STREAM}.one"].shape == expected_one.shape
    assert (outputs[2].saved[f"{STREAM}.one"] - expected_one).abs().max() <= TOLERANCE


@pytest.mark.parametrize("bad, message", [
    (dict(weight=torch.zeros(2, 3, 128)), "give \\[width\\]"),
    (dict(weight=WEIGHT, bias=torch.zeros(4)), "bias has shape"),
    (dict(weight=WEIGHT, name="a.b"), "letters, digits and underscores"),
])
def test_a_bad_probe_is_refused_where_it_is_made(bad, message) -> None:
    with pytest.raises(ValueError, match=message):
        ops.Probe(STREAM, **bad)


def test_a_probe_at_a_value_of_another_width_fails_its_request(llm) -> None:
    (output,) = _run(llm, [[ops.Probe("layers.0.mlp.mlp_neurons", WEIGHT)], [], []])[:1]
    assert output.error is not None and "weight is [3, 128]" in output.error, output.error


def test_the_trace_form_takes_a_probe(llm, reference) -> None:
    """`t.model.layers[1].layer_output.probe(weight)` in nnsight's style is the same `Probe`."""
    prompt = TokensPrompt(prompt_token_ids=PROMPTS[0])
    with llm.trace(prompt, max_tokens=GENERATED, temperature=0.0) as t:
        scores = t.model.layers[1].layer_output.probe(WEIGHT, BIAS, tokens=(PROMPTS[0][2],))
    sequence = PROMPTS[0] + list(t.output.outputs[0].token_ids)[:-1]
    matching = [p for p, token in enumerate(sequence) if token == PROMPTS[0][2]]
    expected = oracle(reference, PROMPTS[0], list(t.output.outputs[0].token_ids))[0, matching]
    assert scores.value.shape == (1, len(matching), 3)
    assert (scores.value[0] - expected).abs().max() <= TOLERANCE
