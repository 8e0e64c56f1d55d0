"""Non-finite values never leak from one request into another (issue [H] item 3).

As first seen: `ops.Add(loc, zero / zero.norm(), scale=4.0)` steered one request to token 0, and
the next four plain requests on the engine sampled token 0 too — the NaN keys and values the
steered request left in its KV blocks were read by the next owners of those blocks. Now such a
vector is refused when the op is made; an edit whose result is not finite fails its request
before anything is written; and whatever an editing request leaves in its KV blocks (a view-mode
`Call` writes straight into the engine's rows, a finite but huge edit overflows later layers) is
zeroed before the blocks are handed to anyone else. The oracle for the plain requests is
transformers on the same weights.
"""

from __future__ import annotations

import pytest
import torch
from conftest import GENERATED, PROMPTS, greedy
from hypothesis import example, given
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops
from vllm_runner.ops.checks import non_finite

LOCATION = "layers.1.layer_output"
GREEDY = SamplingParams(max_tokens=GENERATED, temperature=0.0)


def _tokens(llm, prompt: list[int], program: list | None = None):
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], GREEDY,
                             interventions=[program] if program else None, use_tqdm=False)
    return output


def _poison(value, ctx):
    value.fill_(float("nan"))  # view mode: straight into the engine's rows


_SPECIAL = [float("nan"), float("inf"), float("-inf"), 3e38, -3e38, 6e4, 1e300, 0.0]


@given(values=st.lists(st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=32),
                                 st.sampled_from(_SPECIAL)), max_size=40),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       on_logits=st.booleans())
@example(values=[3e38, 3e38], dtype=torch.float32, on_logits=False)  # a sum that overflows
@example(values=[float("inf"), float("-inf")], dtype=torch.float32, on_logits=False)
@example(values=[float("-inf"), 1.0], dtype=torch.bfloat16, on_logits=True)
def test_the_check_of_an_edit_counts_exactly_the_values_torch_calls_not_finite(
        values: list[float], dtype: torch.dtype, on_logits: bool) -> None:
    """The check every edit passes before it is written (its fast path sums the edit) counts
    what `torch.isfinite` says is not finite, `-inf` on the logits aside, whatever the values:
    huge finite ones whose sum overflows included."""
    tensor = torch.tensor(values, dtype=torch.float64).to(dtype)
    bad = ~torch.isfinite(tensor)
    if on_logits:
        bad &= tensor != float("-inf")
    assert non_finite(tensor, on_logits) == int(bad.sum())


@pytest.mark.parametrize("make", [
    lambda: ops.Add(LOCATION, torch.zeros(128) / torch.zeros(128).norm(), scale=4.0),
    lambda: ops.Set(LOCATION, torch.full((128,), float("inf"))),
    lambda: ops.Add(LOCATION, torch.ones(128), scale=float("nan")),
    lambda: ops.Add(LOCATION, torch.ones(128), scale=1e39),  # overflows float32
    lambda: ops.Scale(LOCATION, float("inf")),
    lambda: ops.ProjectOut(LOCATION, torch.zeros(128)),  # a zero direction divides by zero
], ids=["nan-vector", "inf-value", "nan-scale", "overflowing-scale", "inf-factor",
        "zero-direction"])
def test_non_finite_arguments_are_refused_when_the_op_is_made(make) -> None:
    with pytest.raises(ValueError, match=r"non-finite|not finite|zero vector|overflow"):
        make()


@pytest.mark.parametrize("program", [
    [ops.Scale(LOCATION, 1e38)],                                   # finite factor, inf result
    [ops.Call(LOCATION, lambda value, ctx: value * float("nan"))],  # a NaN replacement
], ids=["scale", "call-result"])
def test_an_edit_that_gives_non_finite_values_fails_its_request_and_writes_nothing(
        llm, reference, program) -> None:
    prompt = PROMPTS[1]
    failed = _tokens(llm, prompt, program)
    assert failed.error is not None and "non-finite" in failed.error, failed.error
    assert failed.error.split(" at ")[0] in ("scale", "call")  # names the op
    # Nothing was written, and the failed program stopped there: the request ran unedited.
    assert list(failed.outputs[0].token_ids) == greedy(reference, prompt, GENERATED)


def _the_long_prompts_generated_token(ctx) -> bool:
    # (its prompt is prefilled in two chunks, the first one alone: its generated tokens' steps
    # are the ones it shares with the short prompt)
    return ctx.prompt_length == len(PROMPTS[1]) and int(ctx.positions[0]) >= ctx.prompt_length


def _nan_for_the_long_prompt(value, ctx):
    return value * float("nan") if _the_long_prompts_generated_token(ctx) else None


def _scramble_the_long_prompt(value, ctx):
    return value * -3.0 if _the_long_prompts_generated_token(ctx) else None


def test_a_call_refused_beside_others_fails_alone_and_its_program_stops_there(llm,
                                                                             reference) -> None:
    """Two requests of one program, served together at a generated token's step (their results
    checked on the device, the answer read later): the one whose first `Call` gives NaN fails,
    nothing of it written, and its second `Call`, later in the same forward, is not served (it
    would scramble its rows); the other request runs on untouched, with no error."""
    program = [ops.Call(LOCATION, _nan_for_the_long_prompt),
               ops.Call("layers.2.layer_output", _scramble_the_long_prompt)]
    prompts = [PROMPTS[1], PROMPTS[0]]
    failed, fine = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in prompts],
                                GREEDY, interventions=program, use_tqdm=False)
    assert failed.error is not None and "non-finite" in failed.error, failed.error
    assert failed.error.startswith(f"call at {LOCATION}: ValueError: the function's result "
                                   "gave"), failed.error
    assert fine.error is None
    for output, prompt in zip((failed, fine), prompts, strict=True):
        assert list(output.outputs[0].token_ids) == greedy(reference, prompt, GENERATED)


@pytest.mark.parametrize("program", [
    [ops.Call("layers.1.mlp_output", _poison, reads="view")],  # a view: the module's rows
    [ops.Scale("layers.0.layer_output", 1e30)],  # finite, then inf and NaN in later layers
], ids=["view-call-writes-nan", "huge-finite-scale"])
def test_plain_requests_after_a_poisoned_one_equal_transformers(llm, reference,
                                                                program) -> None:
    # The poisoned request is the longer one: a shorter plain request given its block does not
    # overwrite every slot it left, and the attention kernel reads the whole block.
    long, short = PROMPTS[1], PROMPTS[0]
    expected = greedy(reference, short, GENERATED)
    poisoned = _tokens(llm, long, program)
    assert list(poisoned.outputs[0].token_ids) != greedy(reference, long, GENERATED)
    for attempt in range(4):  # as seen: four plain requests in a row went wrong
        plain = _tokens(llm, short)
        assert list(plain.outputs[0].token_ids) == expected, f"plain request {attempt}"
    if isinstance(program[0], ops.Call):  # the view-mode write is reported, too
        assert poisoned.error is not None and "non-finite" in poisoned.error
