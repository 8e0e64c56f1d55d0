"""`LLM(enforce_eager=False)` on vLLM's V1 runner (issue [K], tier 1): the engine compiles the
model as vLLM's default does (on the CPU: Dynamo and inductor), steps without programs run
vLLM's compiled path untouched, and a step with a program runs the plain module tree, so its
hooks run. Oracles: a bare compiled vLLM engine with the same settings (untraced requests),
transformers and the suite's eager engine (traced ones). A forward that skips a program's hook
fails that program loudly instead of returning nothing.

Each compiled engine runs in a script of its own: two in-process engines cannot share this
process (the second one's end tears down the distributed state the suite's engine uses)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from conftest import LOGPROB_TOLERANCE, PROMPTS, engine_script_environment
from test_save import close, transformers_values
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops
from vllm_runner.compat import V2_VARIABLE

# The suite's engine settings (conftest `llm`), compiled: the same steps, so the same rows.
SETTINGS = {"dtype": "float32", "max_model_len": 128, "max_num_seqs": 8,
            "max_num_batched_tokens": 8, "block_size": 32, "seed": 0,
            "kv_cache_memory_bytes": 64 << 20, "enforce_eager": False,
            "skip_tokenizer_init": True}
GENERATED = 4
STEER = torch.randn(128, generator=torch.Generator().manual_seed(3))
# The traced request generates 2 tokens, the plain one 6: with 5 + 3 prompt tokens filling one
# step of the 8-token budget, both prefill in step 1 and decode in step 2, then the plain one
# runs 4 steps alone.
TRACED_PROMPTS, TRACED_TOKENS = [0, 2], [2, 6]
PROGRAM = [ops.Save("layers.*.layer_output"), ops.Save("layers.1.mlp_neurons")]

COMMON = '''
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, reachable
import torch
from vllm import SamplingParams

settings, prompts, steer, traced_prompts, traced_tokens, generated = torch.load(sys.argv[2])
plain = SamplingParams(max_tokens=generated, temperature=0.0, logprobs=2)

def summary(outputs):
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [{t: lp.logprob for t, lp in step.items()}
                          for step in o.outputs[0].logprobs or []],
             "saved": getattr(o, "saved", {}), "error": getattr(o, "error", None)}
            for o in outputs]
'''

BARE = COMMON + '''
from vllm import LLM
llm = LLM(sys.argv[1], **settings)
torch.save({"plain": summary(llm.generate(prompts, plain, use_tqdm=False))}, sys.argv[3])
'''

OURS = COMMON + '''
from vllm_runner import LLM, ops
llm = LLM(sys.argv[1], **settings)
runs = {}

def run(name, *args, **kwargs):
    before = llm.forwards()
    outputs = llm.generate(*args, use_tqdm=False, **kwargs)
    after = llm.forwards()
    runs[name] = {"forwards": {how: after[how] - before[how] for how in after},
                  "outputs": summary(outputs)}

run("plain", prompts, plain)
program = [ops.Save("layers.*.layer_output"), ops.Save("layers.1.mlp_neurons")]
run("traced", [prompts[i] for i in traced_prompts],
    [SamplingParams(max_tokens=n, temperature=0.0) for n in traced_tokens],
    interventions=[program, []])
run("steered", prompts, plain,
    interventions=[[ops.Add("layers.1.layer_output", steer, scale=8.0)], [], []])

def set_compiled(worker, value):
    worker.model_runner.interp.compiled = value

# The adapter told the engine is eager: a step with a program then runs compiled, its hooks
# never run, and the guard must fail the program by name.
llm.collective_rpc(set_compiled, args=(False,))
run("hook skipped", prompts[:2], plain, interventions=[[ops.Save("layers.0.layer_output")], []])
torch.save(runs, sys.argv[3])
'''


@pytest.fixture(scope="module")
def runs(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Both scripts' results, by name. They run side by side: each spends most of its start in
    Python (imports, Dynamo's trace), one core each. On vLLM's V1 runner (on a GPU too: the V2
    adapter runs eager only, and refuses a compiled engine)."""
    folder = tmp_path_factory.mktemp("compiled")
    inputs = folder / "inputs.pt"
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt in PROMPTS]
    torch.save((SETTINGS, prompts, STEER, TRACED_PROMPTS, TRACED_TOKENS, GENERATED), inputs)
    children = {}
    for name, script in (("bare", BARE), ("ours", OURS)):
        with open(folder / f"{name}.log", "w") as log:  # files: a full pipe would block it
            children[name] = subprocess.Popen(
                [sys.executable, "-c", script, model_dir, str(inputs), str(folder / f"{name}.pt")],
                env={**engine_script_environment(), V2_VARIABLE: "0"},
                stdout=log, stderr=subprocess.STDOUT)
    for name, child in children.items():
        child.wait(timeout=900)
        assert child.returncode == 0, f"{name}: {(folder / f'{name}.log').read_text()[-4000:]}"
    return {name: torch.load(folder / f"{name}.pt") for name in children}


@pytest.fixture(scope="module")
def bare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return runs["bare"]


@pytest.fixture(scope="module")
def ours(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return runs["ours"]


def test_requests_without_programs_run_compiled_and_equal_a_bare_compiled_engine(
        ours, bare) -> None:
    plain = ours["plain"]
    assert plain["forwards"]["eager"] == 0 and plain["forwards"]["compiled"] > 0
    assert plain["outputs"] == bare["plain"]  # tokens and log-probabilities, bit for bit


def test_a_traced_request_runs_eager_on_exactly_its_steps_and_equals_transformers(
        ours, llm, reference) -> None:
    traced = ours["traced"]
    assert traced["forwards"] == {"eager": 2, "compiled": 4}
    mine, plain = traced["outputs"]
    assert mine["error"] is None
    generated = mine["tokens"]
    expected = transformers_values(reference, PROMPTS[0] + generated[:-1])
    for location in ("layers.0.layer_output", "layers.1.layer_output",
                     "layers.1.mlp.mlp_neurons"):
        close(mine["saved"][location], expected[location], location)
    # The eager engine's values to the last bits, not bit for bit: a compiling engine runs
    # torch's own norms and activations where an eager one runs vLLM's kernels (custom ops).
    eager = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[i]) for i in TRACED_PROMPTS],
                         [SamplingParams(max_tokens=n, temperature=0.0) for n in TRACED_TOKENS],
                         interventions=[PROGRAM, []], use_tqdm=False)
    assert mine["saved"].keys() == eager[0].saved.keys()
    for location, value in mine["saved"].items():
        close(value, eager[0].saved[location], f"{location} against the eager engine")
    assert mine["tokens"] == list(eager[0].outputs[0].token_ids)
    assert plain["tokens"] == list(eager[1].outputs[0].token_ids)


def test_steering_on_a_compiled_engine_changes_only_its_own_request(ours, bare) -> None:
    steered, others = ours["steered"]["outputs"][0], ours["steered"]["outputs"][1:]
    assert steered["error"] is None and steered["tokens"] != bare["plain"][0]["tokens"]
    # The others shared the steered request's uncompiled steps: the compiled engine's tokens,
    # its log-probabilities to the last bits (inductor's fused kernels round differently from
    # the plain modules; bit-identity beside traced requests needs taps in the graph, tier 2).
    for ours_one, theirs in zip(others, bare["plain"][1:], strict=True):
        assert ours_one["tokens"] == theirs["tokens"]
        for mine, expected in zip(ours_one["logprobs"], theirs["logprobs"], strict=True):
            assert mine.keys() == expected.keys()
            assert all(abs(mine[t] - expected[t]) <= LOGPROB_TOLERANCE for t in mine)


def test_a_program_whose_hook_a_compiled_forward_skips_fails_by_name(ours) -> None:
    skipped = ours["hook skipped"]
    assert skipped["forwards"]["eager"] == 0
    failed, plain = skipped["outputs"]
    assert failed["error"] is not None and "layers.0.layer_output" in failed["error"]
    assert "did not run" in failed["error"] and failed["saved"] == {}
    assert plain["error"] is None
