"""Preemption: with a KV cache too small for every request, vLLM preempts and recomputes from
position 0; saves stay complete, free of duplicates and equal to transformers'."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

SCRIPT = """
import json, sys
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
    llm = LLM(sys.argv[1], skip_tokenizer_init=True, dtype="float32",
              gpu_memory_utilization=0.15, max_model_len=96, block_size=32,
              num_gpu_blocks_override=4, enable_prefix_caching=False, seed=0)
    prompts = json.loads(sys.argv[2])
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           SamplingParams(max_tokens=16, temperature=0.0),
                           interventions=[ops.Save("layers.1.layer_output")], use_tqdm=False)
    print("RESULT", json.dumps({"preempted": len(PREEMPTED), "outputs": [
        {"tokens": list(o.outputs[0].token_ids), "error": o.error,
         "shape": list(o.saved["layers.1.layer_output"].shape),
         "values": o.saved["layers.1.layer_output"].flatten().tolist()} for o in outputs]}))
"""


def test_saves_survive_preemption(model_dir: str, reference) -> None:
    prompts = [[(11 * i + 7 * r) % 256 for i in range(30)] for r in range(3)]
    completed = subprocess.run(
        [sys.executable, "-c", SCRIPT, model_dir, json.dumps(prompts)],
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, capture_output=True,
        text=True, timeout=300)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the run failed:\n{completed.stderr[-3000:]}"
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["preempted"] > 0, "the KV cache was large enough: nothing was preempted"
    for prompt, output in zip(prompts, result["outputs"], strict=True):
        assert output["error"] is None
        sequence = prompt + output["tokens"][:-1]
        assert output["shape"] == [1, len(sequence), 128]  # every position once
        with torch.no_grad():
            expected = reference(torch.tensor([sequence]),
                                 output_hidden_states=True).hidden_states[2]
        saved = torch.tensor(output["values"]).reshape(output["shape"])
        assert (saved - expected).abs().max() / expected.abs().max() <= 1e-4
