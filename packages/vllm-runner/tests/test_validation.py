"""Bad input is refused where it enters, naming it (issue [H] item 5, as it was seen): a typo in
`steps`, positions that can never exist, a lens wider than the vocabulary; positions a request
never reached give an empty tensor under their key, not a missing key; and a failing `Call`
reports the user's own lines (item 6)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import PROMPTS
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
LOCATION = "layers.1.layer_output"


def _run(llm, program, prompt=PROMPTS[0]):
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], PARAMS,
                             interventions=[program], use_tqdm=False)
    return output


def test_steps_outside_the_three_are_refused_when_the_op_is_made() -> None:
    with pytest.raises(ValueError, match=r"steps='sometimes' must be one of all, prefill, decode"):
        ops.Save(LOCATION, steps="sometimes")
    with pytest.raises(ValueError, match=r"positions=-1 must be a tuple"):
        ops.Add(LOCATION, torch.ones(128), positions=-1)


@pytest.mark.parametrize("positions", [(10000,), (-10000,)])
def test_positions_past_max_model_len_are_refused_before_anything_runs(llm, positions) -> None:
    with pytest.raises(ValueError, match=r"can never exist.*max_model_len=128"):
        _run(llm, [ops.Save(LOCATION, positions=positions)])


def test_a_million_bad_positions_or_tokens_are_named_in_a_short_message() -> None:
    """A message shows the first few values and how many more: it must not echo a huge request
    back (a million positions made a 7.9 MB answer over HTTP)."""
    from vllm_runner.ops.limits import check_op_fits

    for op, start in ((ops.Save(LOCATION, positions=tuple(range(128, 1_000_128))), "[128, "),
                      (ops.Save(LOCATION, tokens=tuple(range(256, 1_000_256))), "[256, ")):
        with pytest.raises(ValueError) as refused:
            check_op_fits(op, vocab_size=256, max_model_len=128)
        assert len(str(refused.value)) < 400, str(refused.value)[:400]
        assert start in str(refused.value) and "… and 999,990 more]" in str(refused.value)
    with pytest.raises(ValueError, match=r"positions=\[0, 1, .* and 999,991 more\] must be"):
        ops.Save(LOCATION, positions=[*range(1_000_000), True])


def test_negative_positions_before_the_prompt_fail_that_request_by_name(llm) -> None:
    bad, good = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])] * 2, PARAMS,
                             interventions=[[ops.Save(LOCATION, positions=(-50,))],
                                            [ops.Save(LOCATION, positions=(-1,))]],
                             use_tqdm=False)
    assert bad.error is not None and "[-50]" in bad.error and "5 tokens" in bad.error
    assert good.error is None and good.saved[LOCATION].shape == (1, 1, 128)


def test_positions_never_reached_give_an_empty_tensor_under_their_key(llm) -> None:
    output = _run(llm, [ops.Save(LOCATION, positions=(100,))])  # 5 + 4 tokens ran
    assert output.error is None
    assert output.saved[LOCATION].shape == (1, 0, 128)


def test_a_lens_at_positions_never_reached_gives_empty_tokens_and_probabilities(llm) -> None:
    output = _run(llm, [ops.Lens(LOCATION, top_k=3, positions=(100,))])
    assert output.error is None
    assert output.saved[f"{LOCATION}.lens_tokens"].shape == (1, 0, 3)
    assert output.saved[f"{LOCATION}.lens_probs"].shape == (1, 0, 3)


def test_a_lens_wider_than_the_vocabulary_is_refused_naming_both(llm) -> None:
    with pytest.raises(ValueError, match=r"top_k=1000000000.*256 tokens"):
        _run(llm, [ops.Lens(LOCATION, top_k=10**9)])


def _explode(value, ctx):
    scale = 2.0
    raise RuntimeError(f"user code exploded at scale {scale}")


def test_a_failing_call_reports_the_users_lines_and_is_logged_once(llm) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.interp")
    logger.addHandler(handler)
    try:
        output = _run(llm, [ops.Call(LOCATION, _explode)])
    finally:
        logger.removeHandler(handler)
    assert output.error is not None
    assert "RuntimeError: user code exploded at scale 2.0" in output.error
    assert __file__ in output.error and "in _explode" in output.error
    assert 'raise RuntimeError(f"user code exploded' in output.error  # the source line
    # Our frames are not the user's business.
    assert not any(f"vllm_runner/{ours}" in output.error for ours in ("ops.py", "serving.py",
                                                                      "runtime.py"))
    failed = [record for record in records if "program failed" in record.getMessage()]
    assert len(failed) == 1 and output.request_id in failed[0].getMessage()
