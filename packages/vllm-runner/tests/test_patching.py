"""Activation patching as researchers bring it from TransformerLens and nnsight: save a value on a
clean prompt, `Set` it into a corrupted one. A per-position value (`[1, positions, hidden]`) is
matched to absolute positions, never to a step's rows by shape, so it patches exactly the
positions it names however vLLM chunks the prompt, beside whatever other requests, for any
number of generated tokens. The oracle: transformers on the same weights with the same patch
made by a forward hook, run over the engine's own tokens (teacher-forced), compared logit by
logit."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops

# 12 tokens: the suite's engine runs at most 8 a step, so each prompt is cut into two chunks.
CLEAN = [12, 200, 45, 7, 99, 3, 150, 61, 8, 33, 120, 5]
CORRUPT = [12, 200, 45, 7, 99, 3, 150, 61, 180, 33, 71, 5]
# 40 tokens: five chunks when it runs alone.
LONG_CLEAN = [(11 * i + 3) % 250 + 1 for i in range(40)]
LONG_CORRUPT = [token if i % 5 else (token + 100) % 250 + 1
                for i, token in enumerate(LONG_CLEAN)]
LAYER = 1
STREAM = f"layers.{LAYER}.layer_output"
NEURONS = "layers.0.mlp.mlp_neurons"  # a tap (not a graph tap) in the suite's compiled pass
TOLERANCE = 1e-4


def _tokens(prompt: list[int]) -> TokensPrompt:
    return TokensPrompt(prompt_token_ids=prompt)


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _saved(llm, prompt: list[int], location: str, max_tokens: int = 1, **where) -> torch.Tensor:
    (out,) = llm.generate([_tokens(prompt)], _params(max_tokens),
                          interventions=[ops.Save(location, **where)], use_tqdm=False)
    assert out.error is None, out.error
    return out.saved[location]


def _module_of(reference, location: str):
    """The transformers module whose output (the stream) or whose input (the neurons: the down
    projection's) holds the value at `location`."""
    layer = reference.model.layers[int(location.split(".")[1])]
    return layer.mlp.down_proj if location.endswith("mlp_neurons") else layer


@torch.no_grad()
def oracle_logits(reference, tokens: list[int], location: str,
                  rows: dict[int, torch.Tensor], add: bool = False) -> torch.Tensor:
    """transformers' logits over `tokens` with row `rows[p]` set (or added) at position `p` of
    the value at `location` (the stream's output or the neurons' input), by a hook."""
    def edit(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.clone()
        for position, row in rows.items():
            if position < hidden.shape[1]:
                hidden[0, position] = hidden[0, position] + row if add else row
        return hidden

    module = _module_of(reference, location)
    if location.endswith("mlp_neurons"):
        handle = module.register_forward_pre_hook(lambda m, args: (edit(args[0]), *args[1:]))
    else:
        handle = module.register_forward_hook(
            lambda m, args, out: (edit(out[0]), *out[1:]) if isinstance(out, tuple) else edit(out))
    try:
        return reference(torch.tensor([tokens])).logits[0]
    finally:
        handle.remove()


def assert_logits_match_oracle(reference, out, prompt: list[int], location: str,
                               rows: dict[int, torch.Tensor], add: bool = False) -> None:
    """The request's saved logits (one row per generated token) equal transformers' with the
    same patch over the prompt and the engine's generated tokens, and its greedy tokens are
    their argmax."""
    assert out.error is None, out.error
    generated = list(out.outputs[0].token_ids)
    expected = oracle_logits(reference, prompt + generated[:-1], location, rows, add)
    expected = expected[len(prompt) - 1:]
    saved = out.saved["logits"][0]
    assert saved.shape == expected.shape, (saved.shape, expected.shape)
    worst = float((saved - expected).abs().max())
    assert worst <= TOLERANCE, f"logits differ from transformers' by {worst}"
    assert generated == expected.argmax(-1).tolist()


@pytest.mark.parametrize("max_tokens", [1, 4, 40])
@pytest.mark.parametrize("where", ["prefill", "positions"])
def test_a_clean_run_patched_into_a_corrupt_one_gives_its_logits(llm, reference, max_tokens,
                                                                  where) -> None:
    """The user saves layer 1's output on a clean prompt and sets it into a corrupted prompt of
    the same length, on the prompt only (`steps="prefill"`, or every prompt position named):
    at every length of generation the request runs, the decode steps are left alone, and the
    logits are transformers' with the same patch — at the first token, the clean run's."""
    clean = _saved(llm, CLEAN, STREAM)
    assert clean.shape[1] == len(CLEAN)
    patch = (ops.Set(STREAM, clean, steps="prefill") if where == "prefill"
             else ops.Set(STREAM, clean, positions=tuple(range(len(CORRUPT)))))
    (out,) = llm.generate([_tokens(CORRUPT)], _params(max_tokens),
                          interventions=[patch, ops.Save("logits")], use_tqdm=False)
    assert_logits_match_oracle(reference, out, CORRUPT, STREAM,
                               {p: clean[0, p] for p in range(len(CORRUPT))})
    (clean_out,) = llm.generate([_tokens(CLEAN)], _params(1),
                                interventions=[ops.Save("logits")], use_tqdm=False)
    assert torch.allclose(out.saved["logits"][0, 0], clean_out.saved["logits"][0, 0],
                          atol=TOLERANCE, rtol=0)


def test_a_patch_is_the_same_beside_other_requests_and_chunked(llm, reference) -> None:
    """The same patch, run in one call beside a plain request, a request saving a long prompt
    and a second patched request: vLLM cuts the prompts into chunks of other sizes and other
    offsets in the step, and every request still gets exactly its own patch."""
    clean = _saved(llm, CLEAN, STREAM)
    long_clean = _saved(llm, LONG_CLEAN, STREAM)
    prompts = [_tokens(LONG_CORRUPT), _tokens(CORRUPT), _tokens(CLEAN), _tokens(CORRUPT)]
    programs = [[ops.Set(STREAM, long_clean, positions=(0, 17, 39)), ops.Save("logits")],
                [ops.Save("layers.0.layer_output")],
                [],
                [ops.Set(STREAM, clean, steps="prefill"), ops.Save("logits")]]
    outs = llm.generate(prompts, _params(4), interventions=programs, use_tqdm=False)
    assert_logits_match_oracle(reference, outs[0], LONG_CORRUPT, STREAM,
                               {p: long_clean[0, p] for p in (0, 17, 39)})
    assert_logits_match_oracle(reference, outs[3], CORRUPT, STREAM,
                               {p: clean[0, p] for p in range(len(CORRUPT))})
    # The requests beside them: the saving one's values and the plain one's tokens unpatched.
    saving = CORRUPT + list(outs[1].outputs[0].token_ids)[:-1]
    with torch.no_grad():
        unpatched = reference(torch.tensor([saving]), output_hidden_states=True)
    assert (outs[1].saved["layers.0.layer_output"] - unpatched.hidden_states[1]).abs().max() \
        <= TOLERANCE
    plain = CLEAN + list(outs[2].outputs[0].token_ids)[:-1]
    expected = oracle_logits(reference, plain, STREAM, {})[len(CLEAN) - 1:]
    assert list(outs[2].outputs[0].token_ids) == expected.argmax(-1).tolist()


def test_rows_saved_at_some_positions_patch_those_positions(llm, reference) -> None:
    """`Save(positions=...)` returns one row per position named, in position order; a `Set`
    with the same `positions` puts each row back where it was read (a long prompt, run alone
    in five chunks)."""
    named = (38, 3, -25)  # -25: position 15 of 40
    rows = _saved(llm, LONG_CLEAN, STREAM, positions=named)
    assert rows.shape[1] == 3
    (out,) = llm.generate([_tokens(LONG_CORRUPT)], _params(4),
                          interventions=[ops.Set(STREAM, rows, positions=named),
                                         ops.Save("logits")], use_tqdm=False)
    assert_logits_match_oracle(reference, out, LONG_CORRUPT, STREAM,
                               {3: rows[0, 0], 15: rows[0, 1], 38: rows[0, 2]})


def test_a_save_of_a_whole_run_patched_back_replays_it(llm, reference) -> None:
    """A value saved over the prompt and the generated tokens (`Save` of a run of 6 tokens),
    set back with no filter into a corrupted prompt: each row lands at its position, the decode
    steps' too, so the patched run generates the clean run's tokens with its logits."""
    (clean_out,) = llm.generate([_tokens(CLEAN)], _params(6),
                                interventions=[ops.Save(STREAM), ops.Save("logits")],
                                use_tqdm=False)
    whole = clean_out.saved[STREAM]
    assert whole.shape[1] == len(CLEAN) + 5
    (out,) = llm.generate([_tokens(CORRUPT)], _params(6),
                          interventions=[ops.Set(STREAM, whole), ops.Save("logits")],
                          use_tqdm=False)
    assert list(out.outputs[0].token_ids) == list(clean_out.outputs[0].token_ids)
    assert torch.allclose(out.saved["logits"], clean_out.saved["logits"], atol=TOLERANCE, rtol=0)
    assert_logits_match_oracle(reference, out, CORRUPT, STREAM,
                               {p: whole[0, p] for p in range(whole.shape[1])})


def test_a_per_position_add_acts_where_it_has_rows(llm, reference) -> None:
    """An `Add` with one vector per prompt position and no filter, generating past the prompt:
    row p is added at position p, and the generated tokens' positions, which it has no row
    for, are left as they are (no error at the decode steps)."""
    vectors = torch.randn(1, len(CORRUPT), 128, generator=torch.Generator().manual_seed(3))
    (out,) = llm.generate([_tokens(CORRUPT)], _params(4),
                          interventions=[ops.Add(STREAM, vectors, scale=0.5),
                                         ops.Save("logits")], use_tqdm=False)
    assert_logits_match_oracle(reference, out, CORRUPT, STREAM,
                               {p: 0.5 * vectors[0, p] for p in range(len(CORRUPT))}, add=True)


def test_a_per_position_patch_of_mlp_neurons(llm, reference) -> None:
    """Patching the MLP's neurons (a tap in the compiled pass, not a graph tap) at the prompt's
    last three positions from a clean run: the same rule, another value."""
    rows = _saved(llm, CLEAN, NEURONS, positions=(-3, -2, -1))
    (out,) = llm.generate([_tokens(CORRUPT)], _params(4),
                          interventions=[ops.Set(NEURONS, rows, positions=(-3, -2, -1)),
                                         ops.Save("logits")], use_tqdm=False)
    last = len(CORRUPT)
    assert_logits_match_oracle(reference, out, CORRUPT, NEURONS,
                               {last - 3: rows[0, 0], last - 2: rows[0, 1], last - 1: rows[0, 2]})


def test_positions_a_value_has_no_row_for_are_refused_before_it_runs(llm) -> None:
    """A `Set` whose `positions` name a position its per-position value has no row for (here
    20, of a 12-row value with two positions named) fails its request before it runs, naming
    the positions and the fix; a request beside it is untouched."""
    clean = _saved(llm, CLEAN, STREAM)
    patched, plain = llm.generate(
        [_tokens(CORRUPT), _tokens(CORRUPT)], _params(3),
        interventions=[[ops.Set(STREAM, clean, positions=(3, 20)), ops.Save("logits")],
                       [ops.Save("logits")]], use_tqdm=False)
    assert patched.error is not None and "[20]" in patched.error, patched.error
    assert "one row per position named" in patched.error
    assert "logits" not in patched.saved
    assert plain.error is None
    assert list(patched.outputs[0].token_ids) == list(plain.outputs[0].token_ids)


def test_saved_logits_set_back_land_where_they_were_read(llm) -> None:
    """The logits have one row per generated token, the first at the prompt's last position:
    a `Save("logits")` of a clean run set into a corrupted one gives each sampled row the clean
    run's, so the corrupted prompt generates the clean run's tokens."""
    (clean_out,) = llm.generate([_tokens(CLEAN)], _params(5), interventions=[
        ops.Save("logits")], use_tqdm=False)
    logits = clean_out.saved["logits"]
    assert logits.shape[1] == 5
    (out,) = llm.generate([_tokens(CORRUPT)], _params(5), interventions=[
        ops.Set("logits", logits), ops.Save("logits")], use_tqdm=False)
    assert out.error is None, out.error
    assert list(out.outputs[0].token_ids) == list(clean_out.outputs[0].token_ids)
    assert torch.equal(out.saved["logits"], logits)
    (last,) = llm.generate([_tokens(CORRUPT)], _params(5), interventions=[
        ops.Set("logits", logits[:, 2:3], positions=(len(CORRUPT) + 1,)),
        ops.Save("logits")], use_tqdm=False)
    assert last.error is None, last.error
    assert torch.equal(last.saved["logits"][0, 2], logits[0, 2])
