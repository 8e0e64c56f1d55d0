"""Programs and saves cross process boundaries: vLLM's default multiprocess engine (client,
engine core and worker in separate processes) gives the same saves as the in-process one —
small ones inside vLLM's messages, a request's 1 MiB or more through a file in shared memory,
which no process leaves behind — and an engine-wide read mode set on the client
(`LLM(interp_reads=)`) reaches the worker process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from conftest import COUNT_ATTACHED_IN_SCRIPT, LARGE_PROMPT, LARGE_SAVES, PROMPTS
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops
from vllm_runner.saves import shm_files, wire

SCRIPT = """
import json, sys, torch
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import LLM, ops
COUNT_ATTACHED

def halve(value, ctx):
    value.mul_(0.5)  # in place: in "copy" read mode this never reaches the engine

if __name__ == "__main__":
    # Eager, as the suite's first pass (on a GPU `LLM` would compile: minutes for nothing here).
    llm = LLM(sys.argv[1], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              gpu_memory_utilization=0.15, kv_cache_memory_bytes=64 << 20, max_model_len=128,
              seed=0, interp_reads="copy")
    location = "layers.1.layer_output"
    (out, copied, large) = llm.generate(
        [TokensPrompt(prompt_token_ids=json.loads(sys.argv[2]))] * 2
        + [TokensPrompt(prompt_token_ids=json.loads(sys.argv[3]))],
        SamplingParams(max_tokens=3, temperature=0.0),
        interventions=[[ops.Save(location)], [ops.Call(location, halve), ops.Save(location)],
                       [ops.Save(saved) for saved in json.loads(sys.argv[4])]],
        use_tqdm=False)
    torch.save(large.saved, sys.argv[5])
    saved = out.saved[location]
    # Halving would move every value by half of it; GPU kernels are not batch-invariant, so
    # the two requests' rows are compared within a tolerance, not bit for bit.
    print("RESULT", json.dumps({"shape": list(saved.shape), "values": saved.flatten().tolist(),
                                "copied": torch.allclose(copied.saved[location], saved,
                                                         rtol=1e-4, atol=1e-5),
                                "attached": attached}))
""".replace("COUNT_ATTACHED", COUNT_ATTACHED_IN_SCRIPT)




def ours_left_behind() -> set[str]:
    """Files of ours in shared memory whose process is gone (`shm_files` names them
    `vllm-interp-<pid>-...`)."""
    left = set()
    for name in os.listdir(shm_files.DIRECTORY):
        if name.startswith("vllm-interp-"):
            pid = int(name.split("-")[2])
            if not os.path.exists(f"/proc/{pid}"):
                left.add(name)
    return left


def test_multiprocess_engine_gives_the_same_saves(llm, model_dir: str, tmp_path) -> None:
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    before = ours_left_behind()
    large_saves = tmp_path / "large.pt"
    completed = subprocess.run(
        [sys.executable, "-c", SCRIPT, model_dir, json.dumps(PROMPTS[0]),
         json.dumps(LARGE_PROMPT), json.dumps(LARGE_SAVES), str(large_saves)],
        env=environment, capture_output=True, text=True, timeout=300)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the multiprocess run failed:\n{completed.stderr[-3000:]}"
    result = json.loads(lines[0].removeprefix("RESULT "))
    (local,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])],
                            SamplingParams(max_tokens=3, temperature=0.0),
                            interventions=[ops.Save("layers.1.layer_output")], use_tqdm=False)
    expected = local.saved["layers.1.layer_output"]
    assert result["shape"] == list(expected.shape) == [1, len(PROMPTS[0]) + 2, 128]
    assert torch.allclose(torch.tensor(result["values"]).reshape(expected.shape), expected,
                          atol=1e-5)
    assert result["copied"], "interp_reads='copy' did not reach the worker: an in-place edit landed"
    # Only the large request's saves came through a file, and no file was left behind.
    (size,) = result["attached"]
    assert size >= wire.SHARED_MIN_BYTES
    assert ours_left_behind() <= before
    (large,) = llm.generate([TokensPrompt(prompt_token_ids=LARGE_PROMPT)],
                            SamplingParams(max_tokens=3, temperature=0.0),
                            interventions=[ops.Save(location) for location in LARGE_SAVES],
                            use_tqdm=False)
    crossed = torch.load(large_saves)
    assert crossed.keys() == large.saved.keys() and len(crossed) == 9
    for location, tensor in large.saved.items():
        assert torch.allclose(crossed[location], tensor, atol=1e-5), location
