"""Requests without programs are untouched: with programs on the other requests of the same
batch, their tokens and log-probabilities equal a bare vLLM engine's, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from conftest import GENERATED, PROMPTS
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops

BARE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

if __name__ == "__main__":
    llm = LLM(sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              gpu_memory_utilization=0.15, max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=8, block_size=32, seed=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[2])],
                           SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0,
                                          logprobs=3), use_tqdm=False)
    print("RESULT", json.dumps([
        {"tokens": list(o.outputs[0].token_ids),
         "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                      for step in o.outputs[0].logprobs]}
        for o in outputs]))
"""


def test_program_free_requests_equal_the_bare_engine(llm, model_dir: str) -> None:
    completed = subprocess.run(
        [sys.executable, "-c", BARE, model_dir, json.dumps(PROMPTS), str(GENERATED)],
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, capture_output=True,
        text=True, timeout=300)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the bare engine failed:\n{completed.stderr[-3000:]}"
    bare = json.loads(lines[0].removeprefix("RESULT "))
    steer = [ops.Add("layers.1.layer_output", torch.ones(128)), ops.Save("layers.*.mlp_output")]
    ours = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                        SamplingParams(max_tokens=GENERATED, temperature=0.0, logprobs=3),
                        interventions=[steer, [], steer], use_tqdm=False)
    plain, reference = ours[1], bare[1]
    assert list(plain.outputs[0].token_ids) == reference["tokens"]
    for step, expected in zip(plain.outputs[0].logprobs, reference["logprobs"], strict=True):
        assert {str(t): lp.logprob for t, lp in step.items()} == expected  # bit for bit
    steered_first = {str(t): lp.logprob for t, lp in ours[0].outputs[0].logprobs[0].items()}
    assert steered_first != bare[0]["logprobs"][0], "the steering did nothing"
