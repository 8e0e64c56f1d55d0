"""Eight concurrent requests of different lengths with different programs, sharing steps (an
8-token budget): each request's saves equal transformers' values for its prompt alone, at prompt
and generated positions; a wrong-shaped write fails only its own request; and the requests
without programs produce tokens and log-probabilities identical to a bare vLLM engine (bit for
bit) although steered requests run beside them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import LOGPROB_TOLERANCE, SUITE_COMPILED, SUITE_EAGER_IN_SCRIPT
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops

GENERATOR = torch.Generator().manual_seed(8)
PROMPTS8 = [torch.randint(0, 256, (length,), generator=GENERATOR).tolist()
            for length in (3, 11, 6, 17, 4, 9, 13, 5)]
STEER = torch.randn(128, generator=GENERATOR) * 3
TOKENS = 4
TOLERANCE = 1e-4
PROGRAMS = [
    [ops.Save("layers.*.layer_output")],
    [ops.Save("layers.1.mlp_neurons"), ops.Save("logits")],
    [],
    [ops.Save("layers.2.attention_output"), ops.Save("layers.0.layer_input"),
     ops.Add("layers.2.layer_output", STEER)],
    [ops.Set("layers.0.layer_output", torch.zeros(3)), ops.Save("layers.0.layer_output")],
    [],
    # Ops at one location run in the order written: this Save sees the scaled output.
    [ops.Scale("layers.1.mlp_output", 2.0), ops.Save("layers.*.mlp_output", positions=(-1, 0))],
    [ops.Save("token_embeddings"), ops.Save("layers.1.layer_mid")],
]
NO_PROGRAM = [i for i, program in enumerate(PROGRAMS) if not program]


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0.0, logprobs=3)


@pytest.fixture(scope="module")
def outputs(llm):
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS8], _params(),
                        interventions=PROGRAMS, use_tqdm=False)


@torch.no_grad()
def transformers_values(model, tokens: list[int], edits: list[ops.Op]) -> dict[str, torch.Tensor]:
    """Every value the programs save, for one sequence, by hooks on transformers' modules —
    with the program's Add/Scale edits done by hand."""
    values: dict[str, torch.Tensor] = {}
    handles = []

    def record(name, tensor):
        values[name] = tensor[0] if isinstance(tensor, tuple) else tensor

    def edit_output(layer_index, module_name):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            for op in edits:
                if op.location == f"layers.{layer_index}.{module_name}":
                    hidden = hidden + op.vector * op.scale if isinstance(op, ops.Add) else (
                        hidden * op.factor)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        return hook

    handles.append(model.model.embed_tokens.register_forward_hook(
        lambda m, a, out: record("token_embeddings", out)))
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_hook(edit_output(i, "layer_output")))
        handles.append(layer.mlp.register_forward_hook(edit_output(i, "mlp_output")))
        handles += [
            layer.register_forward_pre_hook(
                lambda m, a, kw, i=i: record(f"layers.{i}.layer_input",
                                             a[0] if a else kw["hidden_states"]),
                with_kwargs=True),
            layer.register_forward_hook(
                lambda m, a, out, i=i: record(f"layers.{i}.layer_output", out)),
            layer.post_attention_layernorm.register_forward_pre_hook(
                lambda m, a, i=i: record(f"layers.{i}.layer_mid", a[0])),
            layer.self_attn.register_forward_hook(
                lambda m, a, out, i=i: record(f"layers.{i}.self_attn.attention_output", out)),
            layer.mlp.down_proj.register_forward_pre_hook(
                lambda m, a, i=i: record(f"layers.{i}.mlp.mlp_neurons", a[0])),
            layer.mlp.register_forward_hook(
                lambda m, a, out, i=i: record(f"layers.{i}.mlp.mlp_output", out)),
        ]
    try:
        values["logits"] = model(torch.tensor([tokens])).logits
    finally:
        for handle in handles:
            handle.remove()
    return values


def test_each_request_saves_what_transformers_computes_for_it_alone(outputs, reference) -> None:
    for index, (output, prompt) in enumerate(zip(outputs, PROMPTS8, strict=True)):
        if index == 4 or index in NO_PROGRAM:
            continue  # request 4 fails on purpose (below); the others are checked against vLLM
        assert output.error is None, f"request {index}: {output.error}"
        generated = list(output.outputs[0].token_ids)
        assert len(generated) == TOKENS
        edits = [op for op in PROGRAMS[index] if isinstance(op, ops.Add | ops.Scale)]
        expected = transformers_values(reference, prompt + generated[:-1], edits)
        expected["logits"] = expected["logits"][:, len(prompt) - 1:]
        for location, saved in output.saved.items():
            want = expected[location]
            if location.endswith("mlp_output") and index == 6:
                want = want[:, [0, len(prompt) - 1]]  # positions=(-1, 0), in position order
            assert saved.shape == want.shape, f"request {index}, {location}"
            error = ((saved - want).abs().max() / want.abs().max()).item()
            assert error <= TOLERANCE, f"request {index}, {location}: relative error {error:.1e}"
        assert output.saved, f"request {index} saved nothing"


def test_a_wrong_shaped_set_fails_only_its_request(outputs) -> None:
    assert "set at layers.0.layer_output" in outputs[4].error
    assert "Set's value has shape (3,), which does not broadcast over the value " \
           "[batch tokens hidden]" in outputs[4].error
    assert [i for i, o in enumerate(outputs) if o.error is not None] == [4]


BARE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

if __name__ == "__main__":
    llm = LLM(sys.argv[1], skip_tokenizer_init=True, enforce_eager=SUITE_EAGER, dtype="float32",
              gpu_memory_utilization=0.15, kv_cache_memory_bytes=64 << 20,
              max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=8, block_size=32, seed=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[2])],
                           SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0,
                                          logprobs=3), use_tqdm=False)
    print("RESULT", json.dumps([
        {"tokens": list(o.outputs[0].token_ids),
         "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                      for step in o.outputs[0].logprobs]}
        for o in outputs]))
""".replace("SUITE_EAGER", SUITE_EAGER_IN_SCRIPT)


def test_program_free_requests_equal_the_bare_engine(outputs, model_dir: str) -> None:
    completed = subprocess.run(
        [sys.executable, "-c", BARE, model_dir, json.dumps(PROMPTS8), str(TOKENS)],
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, capture_output=True,
        text=True, timeout=300)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the bare engine failed:\n{completed.stderr[-3000:]}"
    bare = json.loads(lines[0].removeprefix("RESULT "))
    # Bit for bit on the eager engine. On the compiled one, a step with a program at a location
    # no tap serves runs the plain module tree for the whole batch (tier 1), and these requests
    # share such steps: the same tokens, log-probabilities within LOGPROB_TOLERANCE (seen: 2e-7).
    tolerance = LOGPROB_TOLERANCE if SUITE_COMPILED else 0.0
    for index in NO_PROGRAM:
        ours = outputs[index].outputs[0]
        assert list(ours.token_ids) == bare[index]["tokens"], f"request {index}"
        for step, expected in zip(ours.logprobs, bare[index]["logprobs"], strict=True):
            found = {str(t): lp.logprob for t, lp in step.items()}
            assert found.keys() == expected.keys(), f"request {index}"
            assert all(abs(found[t] - expected[t]) <= tolerance for t in found), (found, expected)
    steered = {str(t): lp.logprob for t, lp in outputs[3].outputs[0].logprobs[1].items()}
    assert steered != bare[3]["logprobs"][1], "the steering did nothing"
