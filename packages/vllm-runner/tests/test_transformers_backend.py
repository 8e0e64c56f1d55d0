"""The runtime on vLLM's Transformers backend (`model_impl="transformers"`): requests sharing
steps each get their own attention values — queries, keys, values, head outputs, the pattern at
every position — equal to the same requests on vLLM's own Llama code (where prompts are split
over steps) and to transformers' pattern, and an edit of
the keys reaches the KV cache (the next tokens change) for its request only. The same holds on a
compiled engine with those values tapped (issue [K]), where no step runs eager."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import PROMPTS, engine_script_environment, greedy
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops

#: Its engines on the Transformers backend, eager and compiled with taps, are its own; the
#: suite's engine is only their oracle, so the suite's compiled pass leaves the module out.
pytestmark = pytest.mark.first_pass_only

GENERATED = 3
VALUES = ("attention_queries", "attention_keys", "attention_values", "attention_head_outputs")
SAVES = [ops.Save(f"layers.*.self_attn.{name}") for name in VALUES] + [
    ops.Save("layers.0.self_attn.attention_probabilities"), ops.Save("layers.*.layer_output")]

SCRIPT = """
import json, sys, torch
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import LLM, ops
names = ("attention_queries", "attention_keys", "attention_values", "attention_head_outputs")
saves = [ops.Save(f"layers.*.self_attn.{name}") for name in names] + [
    ops.Save("layers.0.self_attn.attention_probabilities"), ops.Save("layers.*.layer_output")]
tapped = sys.argv[4] == "compiled with taps"
compiled = {"enforce_eager": False,
            "taps": [op.location for op in saves] + ["layers.1.self_attn.attention_keys"]}
llm = LLM(sys.argv[1], skip_tokenizer_init=True, dtype="float32", gpu_memory_utilization=0.15,
          kv_cache_memory_bytes=64 << 20, max_model_len=128, max_num_seqs=8, seed=0,
          model_impl="transformers",
          **(compiled if tapped else {"enforce_eager": True}))
prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[2])]
params = SamplingParams(max_tokens=3, temperature=0.0)
# Layer 1's keys sharpened (a shift common to every key would cancel in the softmax), for the
# first prompt only; all three share each step.
push = [ops.Scale("layers.1.self_attn.attention_keys", 8.0)]
runs = {"saved": llm.generate(prompts, params, interventions=saves, use_tqdm=False),
        "pushed": llm.generate(prompts, params, interventions=[push, [], []], use_tqdm=False)}
results = {name: [{"tokens": list(out.outputs[0].token_ids), "saved": out.saved,
                  "error": out.error} for out in outputs] for name, outputs in runs.items()}
torch.save({**results, "forwards": llm.forwards()}, sys.argv[3])
"""


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
    error = (actual - expected).abs().max() / expected.abs().max()
    assert error <= 1e-4, f"{what}: relative error {error:.2e}"


@pytest.mark.parametrize("engine", ["eager", "compiled with taps"])
def test_attention_values_on_the_backend_equal_vllms_own_code(llm, model_dir, reference,
                                                               tmp_path, engine: str) -> None:
    path = tmp_path / "backend.pt"
    subprocess.run([sys.executable, "-c", SCRIPT, model_dir, json.dumps(PROMPTS), str(path),
                    engine], check=True, env=engine_script_environment(),
                   timeout=600)
    runs = torch.load(path)
    forwards = runs["forwards"]
    assert forwards["eager" if engine == "eager" else "taps"] > 0
    assert engine == "eager" or forwards["eager"] == 0, forwards
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    params = SamplingParams(max_tokens=GENERATED, temperature=0.0)
    native = llm.generate(prompts, params, interventions=SAVES, use_tqdm=False)
    for prompt, backend, own in zip(PROMPTS, runs["saved"], native, strict=True):
        assert backend["error"] is None, backend["error"]
        assert backend["tokens"] == greedy(reference, prompt, GENERATED)
        assert set(backend["saved"]) == set(own.saved)
        for location, value in own.saved.items():
            close(backend["saved"][location], value, location)
        sequence = prompt + backend["tokens"][:-1]
        with torch.no_grad():
            pattern = reference(torch.tensor([sequence]), output_attentions=True).attentions[0]
        (probabilities,) = [value for location, value in backend["saved"].items()
                            if location.endswith("attention_probabilities")]
        close(probabilities, pattern, "layers.0.self_attn.attention_probabilities")
    pushed = runs["pushed"]
    assert pushed[0]["tokens"] != runs["saved"][0]["tokens"]  # the edited keys were attended to
    assert [run["tokens"] for run in pushed[1:]] == [run["tokens"] for run in runs["saved"][1:]]
