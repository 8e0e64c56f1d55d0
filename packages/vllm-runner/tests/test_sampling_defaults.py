"""Without `SamplingParams`, requests sample with the model's defaults (its generation config,
or `override_generation_config`), as `vllm.LLM.generate` does, with or without a program; and
`trace`'s sampling keywords apply over those defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import PROMPTS, greedy

SCRIPT = """
import json, sys
from vllm.inputs import TokensPrompt
from vllm_runner import LLM, ops
if __name__ == "__main__":
    # Eager, as the suite's first pass (on a GPU `LLM` would compile: minutes for nothing here).
    llm = LLM(sys.argv[1], skip_tokenizer_init=True, dtype="float32", gpu_memory_utilization=0.15,
              kv_cache_memory_bytes=64 << 20, max_model_len=128, block_size=32, seed=0,
              enforce_eager=True,
              override_generation_config={"max_new_tokens": 3, "temperature": 0.0})
    prompt = TokensPrompt(prompt_token_ids=json.loads(sys.argv[2]))
    (plain,) = llm.generate([prompt], use_tqdm=False)
    (saved,) = llm.generate([prompt], interventions=[ops.Save("layers.0.layer_output")],
                            use_tqdm=False)
    with llm.trace(prompt) as traced:
        traced.model.layers[0].layer_output.save()
    with llm.trace(prompt, max_tokens=2) as shorter:
        pass
    print("RESULT", json.dumps({name: list(output.outputs[0].token_ids) for name, output in (
        ("plain", plain), ("saved", saved), ("traced", traced.output),
        ("shorter", shorter.output))} | {"error": saved.error}))
"""


def test_requests_without_params_use_the_models_generation_defaults(model_dir: str,
                                                                   reference) -> None:
    completed = subprocess.run(
        [sys.executable, "-c", SCRIPT, model_dir, json.dumps(PROMPTS[1])],
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, capture_output=True,
        text=True, timeout=300)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the run failed:\n{completed.stderr[-3000:]}"
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["error"] is None
    expected = greedy(reference, PROMPTS[1], 3)  # 3 tokens at temperature 0: the overrides
    assert result["plain"] == result["saved"] == result["traced"] == expected
    assert result["shorter"] == expected[:2]  # a keyword over the defaults, the rest kept
