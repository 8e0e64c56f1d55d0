"""Preemption: with a KV cache too small for every request, vLLM preempts and recomputes from
position 0; saves stay complete, free of duplicates and equal to transformers', and steering
and ablation from a compiled graph's buffers (issue [K]) edit the recomputed positions as the
first ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from test_add import steered_greedy

SCRIPT = """
import json, sys
import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import LLM, ops
PREEMPTED = []
original = Scheduler._preempt_request


def counting(self, request, *args, **kwargs):
    PREEMPTED.append(request.request_id)
    return original(self, request, *args, **kwargs)


Scheduler._preempt_request = counting

if __name__ == "__main__":
    # 4 blocks of 32 tokens (vLLM can use 3): three 30-token prompts take one block each, then
    # each needs a second block while decoding, and there is none: vLLM preempts.
    patched = sys.argv[3:4] == ["patched"]  # eager, a vector per position
    steered = len(sys.argv) > 3 and not patched  # compiled, steering from the tap's buffers
    compiled = ({"enforce_eager": False, "graph_taps": ["layers.1.layer_output"]} if steered
                else {"enforce_eager": True})
    llm = LLM(sys.argv[1], skip_tokenizer_init=True, dtype="float32",
              gpu_memory_utilization=0.15, kv_cache_memory_bytes=64 << 20,
              max_model_len=96, block_size=32,
              num_gpu_blocks_override=4, enable_prefix_caching=False, seed=0, **compiled)
    prompts = json.loads(sys.argv[2])
    params = SamplingParams(max_tokens=16, temperature=0.0)
    if patched:
        rows = torch.tensor(json.loads(sys.argv[4])).unsqueeze(0)
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               interventions=[[ops.Add("layers.1.layer_output", rows),
                                               ops.Save("logits")], [], [ops.Save("logits")]],
                               use_tqdm=False)
        print("RESULT", json.dumps({"preempted": len(PREEMPTED), "outputs": [
            {"tokens": list(o.outputs[0].token_ids), "error": o.error,
             "logits": o.saved["logits"].flatten().tolist() if o.saved else None}
            for o in outputs]}))
        sys.exit(0)
    if steered:
        add = [ops.Add("layers.1.layer_output", torch.tensor(json.loads(sys.argv[3])))]
        ablate = [ops.ProjectOut("layers.1.layer_output", torch.tensor(json.loads(sys.argv[4])))]
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)  # 16 each
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               interventions=[add, [], ablate], use_tqdm=False)
        print("RESULT", json.dumps({"preempted": len(PREEMPTED), "forwards": llm.forwards(),
                                    "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                                    "errors": [o.error for o in outputs]}))
        sys.exit(0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           interventions=[ops.Save("layers.1.layer_output")], use_tqdm=False)
    print("RESULT", json.dumps({"preempted": len(PREEMPTED), "outputs": [
        {"tokens": list(o.outputs[0].token_ids), "error": o.error,
         "shape": list(o.saved["layers.1.layer_output"].shape),
         "values": o.saved["layers.1.layer_output"].flatten().tolist()} for o in outputs]}))
"""


PROMPTS = [[(11 * i + 7 * r) % 256 for i in range(30)] for r in range(3)]


def preempted_run(model_dir: str, *extra: str, environment: dict[str, str] | None = None) -> dict:
    """The script's result; it must have preempted."""
    completed = subprocess.run(
        [sys.executable, "-c", SCRIPT, model_dir, json.dumps(PROMPTS), *extra],
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(environment or {})},
        capture_output=True, text=True, timeout=900)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the run failed:\n{completed.stderr[-3000:]}"
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["preempted"] > 0, "the KV cache was large enough: nothing was preempted"
    return result


def test_steering_and_ablation_from_a_compiled_graph_survive_preemption(
        model_dir: str, reference) -> None:
    # Request 0 steered, request 1 plain, request 2 ablated (along the same vector).
    vector = torch.randn(128, generator=torch.Generator().manual_seed(7)) * 3.0
    result = preempted_run(model_dir, json.dumps(vector.tolist()), json.dumps(vector.tolist()))
    forwards = result["forwards"]
    assert forwards["eager"] == forwards["taps"] == 0 < forwards["in_graph"], forwards
    for index, (prompt, tokens, error) in enumerate(
            zip(PROMPTS, result["tokens"], result["errors"], strict=True)):
        assert error is None
        edit = vector if index == 0 else None
        ablated = vector if index == 2 else None
        assert tokens == steered_greedy(reference, prompt, 16, edit, ablated), f"request {index}"
    assert result["tokens"][2] != steered_greedy(reference, PROMPTS[2], 16, None), \
        "the ablation changes nothing here: the test proves nothing about it"


def test_a_per_position_patch_survives_preemption(model_dir: str, reference) -> None:
    """Issue [Q]: an `Add` with one row per position — the prompt's and the first generated
    tokens' — on a request that vLLM preempts and recomputes from position 0: each row lands at
    its position again, and the logits equal transformers' with the same rows added."""
    from test_patching import oracle_logits

    rows = torch.randn(len(PROMPTS[0]) + 8, 128, generator=torch.Generator().manual_seed(5))
    result = preempted_run(model_dir, "patched", json.dumps(rows.tolist()))
    patched = result["outputs"][0]
    assert patched["error"] is None
    sequence = PROMPTS[0] + patched["tokens"][:-1]
    expected = oracle_logits(reference, sequence, "layers.1.layer_output",
                             dict(enumerate(rows)), add=True)[len(PROMPTS[0]) - 1:]
    saved = torch.tensor(patched["logits"]).reshape(expected.shape)
    assert (saved - expected).abs().max() <= 1e-4
    assert patched["tokens"] == expected.argmax(-1).tolist()
    plain = oracle_logits(reference, sequence, "layers.1.layer_output", {})[len(PROMPTS[0]) - 1:]
    assert (saved - plain).abs().max() > 1e-2, "the patch changed nothing: the test proves nothing"


def test_saves_survive_preemption(model_dir: str, reference) -> None:
    prompts = PROMPTS
    result = preempted_run(model_dir)
    for prompt, output in zip(prompts, result["outputs"], strict=True):
        assert output["error"] is None
        sequence = prompt + output["tokens"][:-1]
        assert output["shape"] == [1, len(sequence), 128]  # every position once
        with torch.no_grad():
            expected = reference(torch.tensor([sequence]),
                                 output_hidden_states=True).hidden_states[2]
        saved = torch.tensor(output["values"]).reshape(output["shape"])
        assert (saved - expected).abs().max() / expected.abs().max() <= 1e-4
