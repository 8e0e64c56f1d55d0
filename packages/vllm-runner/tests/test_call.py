"""Call: user code gets a private copy it may keep, and its edits reach only its own request."""

from __future__ import annotations

import torch
from conftest import GENERATED, PROMPTS, same_logprobs
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops

LOCATION = "layers.1.layer_output"
KEPT: list[torch.Tensor] = []  # in-process engine: the worker runs in this process
CONTEXTS: list[tuple[str, list[int], int, int]] = []


def keep(value, ctx):
    KEPT.append(value)


def halve(value, ctx):
    value.mul_(0.5)  # in place: the lease writes it back


def replace_with_half(value, ctx):
    return value * 0.5


def note_context(value, ctx):
    assert ctx.prompt_lengths.tolist() == [ctx.prompt_length] * value.shape[1]
    CONTEXTS.append((ctx.location, ctx.positions.tolist(), ctx.prompt_length, value.shape[1]))


def fail(value, ctx):
    raise RuntimeError("user code failed")


def run(llm, programs):
    params = SamplingParams(max_tokens=GENERATED, temperature=0.0, logprobs=0)
    prompts = [TokensPrompt(prompt_token_ids=PROMPTS[1]) for _ in programs]
    return llm.generate(prompts, params, interventions=programs, use_tqdm=False)


def test_kept_values_are_private_and_equal_what_save_returns(llm) -> None:
    KEPT.clear()
    (output,) = run(llm, [[ops.Call(LOCATION, keep), ops.Save(LOCATION)]])
    kept = torch.cat(KEPT, dim=1).cpu()  # one copy per step; later layers and steps left them alone
    assert torch.equal(kept[:, : output.saved[LOCATION].shape[1]], output.saved[LOCATION])


def test_the_context_gives_each_rows_absolute_position_and_the_prompt_length(llm) -> None:
    """Over the request's steps (prefill chunks, then one row a decode), `ctx.positions` runs
    through every position once, in order, one per row of the value lent."""
    CONTEXTS.clear()
    (output,) = run(llm, [[ops.Call(LOCATION, note_context)]])
    assert output.error is None
    assert {location for location, *_ in CONTEXTS} == {LOCATION}
    assert {prompt_length for _, _, prompt_length, _ in CONTEXTS} == {len(PROMPTS[1])}
    assert all(len(positions) == rows for _, positions, _, rows in CONTEXTS)
    seen = [position for _, positions, _, _ in CONTEXTS for position in positions]
    assert seen == list(range(len(PROMPTS[1]) + GENERATED - 1))


def test_in_place_and_returned_edits_equal_scale(llm) -> None:
    in_place, returned, scaled, plain = run(llm, [
        [ops.Call(LOCATION, halve)], [ops.Call(LOCATION, replace_with_half)],
        [ops.Scale(LOCATION, 0.5)], []])
    expected = list(scaled.outputs[0].token_ids)
    assert list(in_place.outputs[0].token_ids) == expected
    assert list(returned.outputs[0].token_ids) == expected
    logprob = [step[token].logprob for step, token in
               zip(scaled.outputs[0].logprobs, expected, strict=True)]
    for output in (in_place, returned):
        got = [step[token].logprob for step, token in
               zip(output.outputs[0].logprobs, expected, strict=True)]
        assert torch.allclose(torch.tensor(got), torch.tensor(logprob), atol=1e-5)
    assert plain.outputs[0].logprobs[0] != scaled.outputs[0].logprobs[0]


def test_read_modes(llm) -> None:
    """`view` edits land in place; `copy` writes back only a returned replacement."""
    queries = "layers.1.attention_queries"
    view, copy_in_place, copy_returned, scaled, plain = run(llm, [
        [ops.Call(queries, halve, reads="view")], [ops.Call(queries, halve, reads="copy")],
        [ops.Call(queries, replace_with_half, reads="copy")], [ops.Scale(queries, 0.5)], []])

    assert not same_logprobs(scaled, plain), "the edit does nothing; the test proves nothing"
    assert same_logprobs(view, scaled) and same_logprobs(copy_returned, scaled)
    assert same_logprobs(copy_in_place, plain)
    assert all(o.error is None for o in (view, copy_in_place, copy_returned))


def test_a_raising_call_fails_only_its_request(llm) -> None:
    failing, plain = run(llm, [[ops.Call(LOCATION, fail)], []])
    assert "RuntimeError: user code failed" in failing.error
    assert plain.error is None
    (again,) = run(llm, [[]])
    assert list(again.outputs[0].token_ids) == list(plain.outputs[0].token_ids)


ROWWISE_CALLS: list[tuple[int, int | None]] = []


def halve_rows(value, ctx):
    ROWWISE_CALLS.append((value.shape[1], ctx.prompt_length))
    value.mul_(0.5)


def fail_on_nan_prompt(value, ctx):
    """Rowwise: leaves NaN in the rows at position 10 (only the longest prompt has one)."""
    value.mul_(0.5)
    value[0, ctx.positions == 10] = float("nan")


def test_a_rowwise_call_serves_its_program_s_requests_in_one_call_a_step(llm) -> None:
    """Four requests running one rowwise `Call`: one call a step for all their rows (a decode
    step hands it four), with the same tokens and log-probabilities as `Scale` gives each."""
    ROWWISE_CALLS.clear()
    programs = 4
    rowwise = run(llm, [[ops.Call(LOCATION, halve_rows, rowwise=True)]] * programs)
    scaled = run(llm, [[ops.Scale(LOCATION, 0.5)]] * programs)
    for got, expected in zip(rowwise, scaled, strict=True):
        assert got.error is None
        assert list(got.outputs[0].token_ids) == list(expected.outputs[0].token_ids)
        assert same_logprobs(got, expected)
    rows_per_request = len(PROMPTS[1]) + GENERATED - 1
    assert sum(rows for rows, _ in ROWWISE_CALLS) == programs * rows_per_request
    assert (programs, None) in ROWWISE_CALLS  # a decode step: every request's row at once
    assert len(ROWWISE_CALLS) < programs * GENERATED  # not one call per request


def test_a_rowwise_call_that_breaks_one_request_fails_only_that_one(llm) -> None:
    """The group's call leaves NaN in one request's rows: the requests are run alone, the one at
    fault fails, the others are edited as `Scale` edits them."""
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    params = SamplingParams(max_tokens=GENERATED, temperature=0.0, logprobs=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in prompts], params,
                           interventions=[[ops.Call(LOCATION, fail_on_nan_prompt, rowwise=True)]]
                           * 3, use_tqdm=False)
    scaled = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in prompts[1:]],
                          params, interventions=[[ops.Scale(LOCATION, 0.5)]] * 2, use_tqdm=False)
    assert "the function gave" in (outputs[0].error or "")  # its own check, alone
    assert "non-finite values (NaN or infinity)" in (outputs[0].error or "")
    for got, expected in zip(outputs[1:], scaled, strict=True):
        assert got.error is None
        assert list(got.outputs[0].token_ids) == list(expected.outputs[0].token_ids)
        assert same_logprobs(got, expected)


def halve_generated_rows(value, ctx):
    value[:, (ctx.positions >= ctx.prompt_lengths).to(value.device)] *= 0.5


def test_a_rowwise_call_knows_each_row_s_prompt_length(llm) -> None:
    """Prompts of three lengths joined in one rowwise call: `ctx.prompt_lengths` tells each
    row's prompt from its generated tokens, as `Scale(..., steps="decode")` does per request."""
    params = SamplingParams(max_tokens=GENERATED, temperature=0.0, logprobs=0)
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt in PROMPTS]
    rowwise = llm.generate(prompts, params, use_tqdm=False, interventions=[
        [ops.Call(LOCATION, halve_generated_rows, rowwise=True)]] * len(PROMPTS))
    scaled = llm.generate(prompts, params, use_tqdm=False, interventions=[
        [ops.Scale(LOCATION, 0.5, steps="decode")]] * len(PROMPTS))
    plain = llm.generate(prompts, params, use_tqdm=False)
    for got, expected in zip(rowwise, scaled, strict=True):
        assert got.error is None
        assert list(got.outputs[0].token_ids) == list(expected.outputs[0].token_ids)
        assert same_logprobs(got, expected)
    assert any(not same_logprobs(edited, untouched) for edited, untouched in zip(
        scaled, plain, strict=True)), "the edit changed nothing: the comparison proves nothing"
