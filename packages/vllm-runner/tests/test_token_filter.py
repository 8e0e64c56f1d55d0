"""Acting where a token appears (EasySteer's triggers): `tokens=` on a row op keeps the
positions whose token is one of the given ids — in the prompt, or generated — beside any
`positions` and `steps`. Checked against transformers over the engine's own tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops
from vllm_runner.ops.limits import check_op_fits

STREAM = "layers.1.layer_output"
# 12 tokens, token 7 at positions 1, 5 and 9; the engine runs 8 a step, so two chunks.
PROMPT = [3, 7, 40, 12, 90, 7, 33, 61, 8, 7, 150, 21]
GENERATED = 6
TOLERANCE = 1e-4
VECTOR = torch.randn(128, generator=torch.Generator().manual_seed(31))


def _run(llm, programs, prompts=(PROMPT,)):
    return llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                        SamplingParams(max_tokens=GENERATED, temperature=0.0, ignore_eos=True),
                        interventions=programs, use_tqdm=False)


@torch.no_grad()
def _hidden(reference, tokens: list[int], added: dict[int, torch.Tensor] | None = None):
    """transformers' layer-1 output and logits over `tokens`, `added[p]` added at position p."""
    def hook(module, args, output):
        hidden = (output[0] if isinstance(output, tuple) else output).clone()
        for position, row in (added or {}).items():
            hidden[0, position] += row
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = reference.model.layers[1].register_forward_hook(hook)
    try:
        out = reference(torch.tensor([tokens]), output_hidden_states=True)
    finally:
        handle.remove()
    return out.hidden_states[2], out.logits[0]


def test_saves_and_edits_act_where_a_token_appears(llm, reference) -> None:
    """The user saves the stream wherever token 7 or a token the model generates appears, and
    steers at token 7 only: the saved rows are those positions' (prompt and generated, in
    position order), and the logits are transformers' with the vector added there — while a
    request beside it, chunked alike, is untouched."""
    (plain,) = _run(llm, [[]])
    generated = list(plain.outputs[0].token_ids)
    trigger = generated[2]  # runs through the model at position len(PROMPT) + 2
    sequence = PROMPT + generated[:-1]
    saved_at = [p for p, token in enumerate(sequence) if token in (7, trigger)]
    assert len(PROMPT) + 2 in saved_at and 5 in saved_at
    outputs = _run(llm, [[ops.Save(STREAM, tokens=(7, trigger))],
                         [ops.Add(STREAM, VECTOR, tokens=(7,)), ops.Save("logits")],
                         [ops.Save("logits")]], prompts=(PROMPT, PROMPT, PROMPTS[1]))
    saving, steered, beside = outputs
    assert all(output.error is None for output in outputs), [o.error for o in outputs]
    hidden, _ = _hidden(reference, sequence)
    assert saving.saved[STREAM].shape == (1, len(saved_at), 128)
    assert (saving.saved[STREAM][0] - hidden[0, saved_at]).abs().max() <= TOLERANCE
    steered_sequence = PROMPT + list(steered.outputs[0].token_ids)[:-1]
    _, logits = _hidden(reference, steered_sequence,
                        {p: VECTOR for p, t in enumerate(steered_sequence) if t == 7})
    expected = logits[len(PROMPT) - 1:]
    assert (steered.saved["logits"][0] - expected).abs().max() <= TOLERANCE
    assert list(steered.outputs[0].token_ids) == expected.argmax(-1).tolist()
    (alone,) = _run(llm, [[ops.Save("logits")]], prompts=(PROMPTS[1],))
    # Compiled, the batch ran the module tree (the token ids are read there) and the request
    # alone vLLM's compiled forward: equal up to the compiler's rounding.
    assert (beside.saved["logits"] - alone.saved["logits"]).abs().max() <= TOLERANCE


def test_tokens_with_steps_and_a_probe_keep_only_both(llm, reference) -> None:
    """`tokens` with `steps="prefill"` keeps the prompt's matches only, though a generated
    token matches too; a `Probe` takes the filter, and a `Lens` with `positions` keeps the
    positions both name."""
    (plain,) = _run(llm, [[]])
    generated = list(plain.outputs[0].token_ids)
    trigger = generated[1]
    weight = torch.randn(128, generator=torch.Generator().manual_seed(32))
    (output,) = _run(llm, [[ops.Save(STREAM, tokens=(7, trigger), steps="prefill"),
                            ops.Probe(STREAM, weight, tokens=(7, trigger)),
                            ops.Lens(STREAM, top_k=2, tokens=(7,), positions=(4, 5, 9))]])
    assert output.error is None, output.error
    sequence = PROMPT + list(output.outputs[0].token_ids)[:-1]
    assert sequence == PROMPT + generated[:-1]
    hidden, _ = _hidden(reference, sequence)
    in_prompt = [p for p in range(len(PROMPT)) if sequence[p] in (7, trigger)]
    everywhere = [p for p, token in enumerate(sequence) if token in (7, trigger)]
    assert len(everywhere) > len(in_prompt), "no generated match: steps= proves nothing"
    assert output.saved[STREAM].shape[1] == len(in_prompt)
    assert (output.saved[STREAM][0] - hidden[0, in_prompt]).abs().max() <= TOLERANCE
    expected = hidden[0, everywhere] @ weight
    assert (output.saved[f"{STREAM}.probe"][0] - expected).abs().max() <= TOLERANCE
    assert output.saved[f"{STREAM}.lens_tokens"].shape == (1, 2, 2)  # 5 and 9, not 4


def test_tokens_at_the_logits_and_one_name_saved_twice_are_refused_before_running(llm) -> None:
    """The logits have one row per sampled position, not per token run: `tokens=` there is
    refused; two probes saving under one name would lose one: refused, naming both."""
    from vllm_runner import LocationError
    with pytest.raises(LocationError, match="tokens= is not taken"):
        _run(llm, [[ops.Save("logits", tokens=(7,))]])
    weight = torch.ones(128)
    with pytest.raises(LocationError, match="as op 0 of the program does"):
        _run(llm, [[ops.Probe(STREAM, weight), ops.Probe("layers.*.layer_output", weight)]])


@pytest.mark.parametrize("tokens, message", [((), "non-empty"), ((-1,), "whole numbers >= 0"),
                                             ("7", "non-empty tuple")])
def test_bad_tokens_are_refused_where_the_op_is_made(tokens, message) -> None:
    with pytest.raises(ValueError, match=message):
        ops.Save(STREAM, tokens=tokens)


def test_tokens_outside_the_vocabulary_are_refused_before_queueing() -> None:
    with pytest.raises(ValueError, match=r"tokens \[300\] are not in the vocabulary"):
        check_op_fits(ops.Save(STREAM, tokens=(7, 300)), vocab_size=256, max_model_len=128)
