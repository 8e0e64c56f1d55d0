"""Editing attention patterns (nnterp's editable `attention_probabilities`): the layer's output
for the editing request is the one transformers' eager attention makes from the same edited
pattern — on a prompt cut into chunks beside other requests and at every decode step — while
the request beside it keeps vLLM's own attention. Where an edit can never be served, it is
refused before anything runs."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import PROMPTS
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import LocationError, ops

PROBABILITIES = "layers.1.self_attn.attention_probabilities"
SCORES = "layers.1.self_attn.attention_scores"
LAYER = 1
GENERATED = 4
TOLERANCE = 1e-4


def knock_out_the_first_token(pattern, ctx=None):
    """The user's edit: no query attends to position 0 (its share is dropped, not spread)."""
    pattern[..., 0] = 0.0
    return pattern


@contextlib.contextmanager
def edited_eager_attention(layer: int, probabilities=None, scores=None):
    """transformers' eager attention at `layer` with `scores(weights)` applied before the
    softmax and `probabilities(weights)` after it (the oracle)."""
    from transformers.models.llama import modeling_llama as modeling

    original = modeling.eager_attention_forward

    def forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if module.layer_idx != layer:
            return original(module, query, key, value, attention_mask, scaling, dropout,
                            **kwargs)
        keys = modeling.repeat_kv(key, module.num_key_value_groups)
        values = modeling.repeat_kv(value, module.num_key_value_groups)
        weights = query @ keys.transpose(2, 3) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        if scores is not None:
            weights = scores(weights.clone())
        weights = weights.softmax(-1, dtype=torch.float32).to(query.dtype)
        if probabilities is not None:
            weights = probabilities(weights.clone())
        return (weights @ values).transpose(1, 2).contiguous(), weights

    modeling.eager_attention_forward = forward
    try:
        yield
    finally:
        modeling.eager_attention_forward = original


@torch.no_grad()
def oracle_logits(reference, prompt: list[int], generated: list[int], **edits) -> torch.Tensor:
    """transformers' logits of the generated tokens with the edited attention (teacher-forced
    over the engine's tokens: each query row's edit depends on that row only)."""
    with edited_eager_attention(LAYER, **edits):
        logits = reference(torch.tensor([prompt + generated[:-1]])).logits[0]
    return logits[len(prompt) - 1:]


def _run(llm, programs, prompts=PROMPTS):
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=GENERATED, temperature=0.0),
                        interventions=programs, use_tqdm=False)


def _assert_oracle(reference, output, prompt, **edits) -> None:
    assert output.error is None, output.error
    generated = list(output.outputs[0].token_ids)
    expected = oracle_logits(reference, prompt, generated, **edits)
    worst = float((output.saved["logits"][0] - expected).abs().max())
    assert worst <= TOLERANCE, f"logits differ from transformers' edited attention by {worst}"
    assert generated == expected.argmax(-1).tolist()


def test_knocking_out_attention_to_the_first_token_equals_transformers(llm, reference) -> None:
    """The user zeroes every query's attention to position 0 at layer 1, in place from a
    `Call`; the 11-token prompt runs in chunks beside a plain request and a saving one, then
    four decode steps: every logit is transformers' with the same edit, and the requests beside
    it are untouched."""
    outputs = _run(llm, [[ops.Call(PROBABILITIES, knock_out_the_first_token),
                          ops.Save("logits")],
                         [ops.Save("logits")], []], prompts=[PROMPTS[1], PROMPTS[0], PROMPTS[2]])
    _assert_oracle(reference, outputs[0], PROMPTS[1], probabilities=knock_out_the_first_token)
    plain = oracle_logits(reference, PROMPTS[0], list(outputs[1].outputs[0].token_ids))
    assert (outputs[1].saved["logits"][0] - plain).abs().max() <= TOLERANCE
    unedited = oracle_logits(reference, PROMPTS[1], list(outputs[0].outputs[0].token_ids))
    assert (outputs[0].saved["logits"][0] - unedited).abs().max() > 1e-2, \
        "the edit changed nothing: the test proves nothing"


def test_a_scaled_pattern_on_the_prompt_only_and_saves_see_the_edit(llm, reference) -> None:
    """`Scale` with `steps="prefill"`: the prompt's queries attend with half their weights, the
    decode steps' as before; a `Save` of the pattern after the edit and of the head outputs
    see the edited attention."""
    prompt = PROMPTS[1]
    (output,) = _run(llm, [[ops.Scale(PROBABILITIES, 0.5, steps="prefill"),
                            ops.Save(PROBABILITIES, steps="prefill"),
                            ops.Save("layers.1.self_attn.attention_head_outputs",
                                     steps="prefill"),
                            ops.Save("logits")]], prompts=[prompt])

    def halve_prompt_rows(weights):
        weights[:, :, :len(prompt)] *= 0.5
        return weights

    _assert_oracle(reference, output, prompt, probabilities=halve_prompt_rows)
    with torch.no_grad(), edited_eager_attention(LAYER):
        plain = reference(torch.tensor([prompt]), output_attentions=True).attentions[LAYER]
    saved = output.saved[PROBABILITIES]
    assert saved.shape == plain.shape
    assert (saved - 0.5 * plain).abs().max() <= TOLERANCE
    captured = []
    handle = reference.model.layers[LAYER].self_attn.o_proj.register_forward_pre_hook(
        lambda module, args: captured.append(args[0]))
    try:
        with torch.no_grad(), edited_eager_attention(LAYER, probabilities=halve_prompt_rows):
            reference(torch.tensor([prompt]))
    finally:
        handle.remove()
    heads = output.saved["layers.1.self_attn.attention_head_outputs"]
    assert (heads.flatten(2) - captured[0]).abs().max() <= TOLERANCE


def test_masking_a_key_on_the_scores_equals_transformers(llm, reference) -> None:
    """An edit of the pre-softmax scores: `-inf` hides key 0 from every query past position 0,
    and the softmax spreads their attention over the other keys."""
    def mask(scores):
        scores[..., 1:, 0] = float("-inf")
        return scores

    def edit(scores, ctx):
        rows = ctx.positions > 0  # a decode step's one row is past position 0
        scores[:, :, rows, 0] = float("-inf")

    (output,) = _run(llm, [[ops.Call(SCORES, edit), ops.Save("logits")]],
                     prompts=[PROMPTS[1]])
    _assert_oracle(reference, output, PROMPTS[1], scores=mask)


def test_scores_and_probabilities_of_one_layer_are_one_pattern(llm, reference) -> None:
    """A program that masks a key on the scores, then halves the probabilities: the second
    edit starts from the first (the softmax of the masked scores), a save of the probabilities
    sees both, and the logits are transformers' with both edits."""
    def mask(scores):
        scores[..., 1:, 0] = float("-inf")
        return scores

    def halve(weights):
        return weights * 0.5

    def edit(scores, ctx):
        scores[:, :, ctx.positions > 0, 0] = float("-inf")

    (output,) = _run(llm, [[ops.Call(SCORES, edit), ops.Scale(PROBABILITIES, 0.5),
                            ops.Save(PROBABILITIES, steps="prefill"), ops.Save("logits")]],
                     prompts=[PROMPTS[1]])
    _assert_oracle(reference, output, PROMPTS[1], scores=mask, probabilities=halve)
    with torch.no_grad(), edited_eager_attention(LAYER, scores=mask, probabilities=halve):
        weights = reference(torch.tensor([PROMPTS[1]]), output_attentions=True).attentions[LAYER]
    assert (output.saved[PROBABILITIES] - weights).abs().max() <= TOLERANCE


def test_a_call_that_only_reads_a_read_only_value_still_runs(llm) -> None:
    """A `Call` may only read: at a value no edit can take it is not refused (its write
    would be, if it made one)."""
    outputs = _run(llm, [[ops.Call("next_token_probs", lambda value, ctx: value.amax(-1),
                                   saves="top")]], prompts=[PROMPTS[0]])
    assert outputs[0].error is None, outputs[0].error
    assert outputs[0].saved["next_token_probs.top"].shape == (1, GENERATED)


def test_edits_no_value_can_take_are_refused_before_anything_runs(llm) -> None:
    """A read-only value that is not a pattern (the sampler's probabilities) cannot be edited:
    refused by `generate` before any request runs, naming the value and what to edit instead;
    a save there is fine."""
    with pytest.raises(LocationError, match="next_token_probs is derived and read-only"):
        _run(llm, [[ops.Scale("next_token_probs", 2.0)]] * 3)
    outputs = _run(llm, [[ops.Save("next_token_probs")]] * 3)
    assert all(output.error is None for output in outputs)


def test_an_edit_of_a_pattern_that_breaks_it_fails_its_request_alone(llm) -> None:
    """A pattern edited to NaN fails its request at the layer's output (nothing written); the
    request beside it completes as if alone."""
    def poison(pattern, ctx):
        pattern.fill_(float("nan"))

    bad, good = _run(llm, [[ops.Call(PROBABILITIES, poison)], [ops.Save("logits")]],
                     prompts=[PROMPTS[1], PROMPTS[1]])
    assert bad.error is not None, "a NaN pattern was written"
    assert "the edited attention of layers.1.self_attn" in bad.error, bad.error
    assert "non-finite values" in bad.error and "nothing was written" in bad.error, bad.error
    assert good.error is None
    (alone,) = _run(llm, [[ops.Save("logits")]], prompts=[PROMPTS[1]])
    # Equal up to rounding: compiled, the batch ran the module tree and the request alone
    # vLLM's compiled forward.
    assert (good.saved["logits"] - alone.saved["logits"]).abs().max() <= TOLERANCE


def test_pattern_edits_under_tensor_parallelism_are_refused_by_name(llm) -> None:
    """At more than one rank each holds a piece of the values an edited pattern's output needs:
    the refusal names the setting and the alternative, for patterns only."""
    from vllm_runner.runtime.pattern_edits import edit_refusal

    def reasons(worker):
        values = worker.model_runner.interp.values
        return {location: edit_refusal(values[location], values, tensor_parallel=True)
                for location in (PROBABILITIES, SCORES, "layers.1.self_attn.attention_values",
                                 "next_token_probs")}

    (found,) = llm.engine.collective_rpc(reasons)
    assert "tensor_parallel_size=1" in found[PROBABILITIES]
    assert "tensor_parallel_size=1" in found[SCORES]
    assert found["layers.1.self_attn.attention_values"] is None
    assert "read-only" in found["next_token_probs"]


COMPILED_SCRIPT = """
import os, sys, torch
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import LLM, ops
def knock_out(pattern, ctx):
    pattern[..., 0] = 0.0

if __name__ == "__main__":
    model_dir, prompts, out = sys.argv[1], eval(sys.argv[2]), sys.argv[3]
    llm = LLM(model_dir, dtype="float32", gpu_memory_utilization=0.15,
              kv_cache_memory_bytes=64 << 20, max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=8, block_size=32, seed=0, skip_tokenizer_init=True,
              enforce_eager=False, taps=[sys.argv[4], "layers.1.self_attn.attention_head_outputs"])
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           SamplingParams(max_tokens=4, temperature=0.0),
                           interventions=[[ops.Call(sys.argv[4], knock_out), ops.Save("logits")],
                                          [ops.Save("logits")]], use_tqdm=False)
    torch.save({"errors": [o.error for o in outputs], "forwards": llm.forwards(),
                "logits": [o.saved["logits"] for o in outputs]}, out)
"""


@pytest.mark.first_pass_only  # its compiled engine is its own; the suite's is its oracle
def test_a_pattern_edited_at_taps_of_a_compiled_engine_equals_the_eager_engine(
        llm, model_dir: str, tmp_path) -> None:
    """With the pattern and the head outputs tapped, the edit is served by the taps inside the
    compiled model (no step runs eager) and gives the eager engine's logits."""
    import subprocess
    import sys

    from conftest import engine_script_environment

    prompts = [PROMPTS[1], PROMPTS[0]]
    out = tmp_path / "compiled.pt"
    completed = subprocess.run(
        [sys.executable, "-c", COMPILED_SCRIPT, model_dir, repr(prompts), str(out),
         PROBABILITIES], env=engine_script_environment(), capture_output=True, text=True,
        timeout=900)
    assert out.exists(), completed.stderr[-4000:]
    compiled = torch.load(out)
    assert compiled["errors"] == [None, None], compiled["errors"]
    assert compiled["forwards"]["eager"] == 0 < compiled["forwards"]["taps"], compiled["forwards"]
    eager = _run(llm, [[ops.Call(PROBABILITIES, knock_out_the_first_token), ops.Save("logits")],
                       [ops.Save("logits")]], prompts=prompts)
    for got, expected in zip(compiled["logits"], eager, strict=True):
        assert (got - expected.saved["logits"]).abs().max() <= TOLERANCE
