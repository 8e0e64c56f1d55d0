"""`LLM(enforce_eager=False)` on vLLM's V1 runner (issue [K], tiers 1 and 2): the engine compiles
the model as vLLM's default does (on the CPU: Dynamo and inductor); steps without programs run
vLLM's compiled path untouched; a step whose programs act only at taps (`LLM(taps=...)`) runs
compiled too, its taps served by the tap op inside the graph; any other step with a program runs
the plain module tree, so its hooks run. Oracles: a bare compiled vLLM engine with the same
settings (untraced requests), transformers and the suite's eager engine (traced ones). A forward
that skips a program's hook fails that program loudly instead of returning nothing.

Each compiled engine runs in a script of its own: two in-process engines cannot share this
process (the second one's end tears down the distributed state the suite's engine uses)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from conftest import LOGPROB_TOLERANCE, PROMPTS, engine_script_environment, logprob_steps
from test_save import close, transformers_values
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops

#: The suite's engine (`llm`) is this module's eager engine, beside compiled engines of its own:
#: the suite's compiled pass leaves the module out (conftest), its first pass runs it whole.
pytestmark = pytest.mark.first_pass_only

# The suite's engine settings (conftest `llm`), compiled: the same steps, so the same rows.
SETTINGS = {"dtype": "float32", "max_model_len": 128, "max_num_seqs": 8,
            "max_num_batched_tokens": 8, "block_size": 32, "seed": 0,
            "kv_cache_memory_bytes": 64 << 20, "gpu_memory_utilization": 0.15,
            "enforce_eager": False,
            "skip_tokenizer_init": True}
GENERATED = 4
STEER = torch.randn(128, generator=torch.Generator().manual_seed(3))
# The traced request generates 2 tokens, the plain one 6: with 5 + 3 prompt tokens filling one
# step of the 8-token budget, both prefill in step 1 and decode in step 2, then the plain one
# runs 4 steps alone.
TRACED_PROMPTS, TRACED_TOKENS = [0, 2], [2, 6]
PROGRAM = [ops.Save("layers.*.layer_output"), ops.Save("layers.1.mlp_neurons")]
TAPS = ["layers.*.layer_output", "layers.1.mlp_neurons"]
#: Full graphs broken at the taps (`engine.v2_tap_graphs`) exist where V2 captures CUDA graphs.
TAP_BREAKS = int(torch.cuda.is_available() and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0")
# Two requests steered in one step with vectors of their own, at a tap; the third runs plain.
OTHER_STEER = torch.randn(128, generator=torch.Generator().manual_seed(4))

COMMON = '''
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, reachable
import torch
from vllm import SamplingParams

(settings, prompts, steer, other_steer, traced_prompts, traced_tokens, generated,
 taps) = torch.load(sys.argv[2])
plain = SamplingParams(max_tokens=generated, temperature=0.0, logprobs=2)
traced = ([prompts[i] for i in traced_prompts],
          [SamplingParams(max_tokens=n, temperature=0.0, logprobs=2) for n in traced_tokens])

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
torch.save({"plain": summary(llm.generate(prompts, plain, use_tqdm=False)),
            "traced": summary(llm.generate(*traced, use_tqdm=False))}, sys.argv[3])
'''

OURS = COMMON + '''
from vllm_runner import LLM, ops
# Add and Save at the layer outputs run inside the graph (`in_graph`), the rest via the taps.
llm = LLM(sys.argv[1], taps=taps, graph_taps=["layers.*.layer_output"], **settings)
runs = {"taps": llm.taps()}

def run(name, *args, **kwargs):
    before = llm.forwards()
    outputs = llm.generate(*args, use_tqdm=False, **kwargs)
    after = llm.forwards()
    runs[name] = {"forwards": {how: after[how] - before[how] for how in after},
                  "outputs": summary(outputs)}

run("plain", prompts, plain)
program = [ops.Save("layers.*.layer_output"), ops.Save("layers.1.mlp_neurons")]
run("traced at taps", *traced, interventions=[program, []])
run("traced elsewhere", *traced,
    interventions=[[ops.Save("layers.1.attention_output"), *program], []])
run("steered at a tap", prompts, plain,
    interventions=[[ops.Add("layers.1.layer_output", steer, scale=8.0)],
                   [ops.Add("layers.1.layer_output", other_steer, scale=8.0)], []])
run("steered from the graph after the prompt", prompts, plain,
    interventions=[[ops.Add("layers.1.layer_output", steer, scale=8.0, steps="decode")], [], []])
run("saved in the graph beside steering", prompts, plain,
    interventions=[[ops.Save("layers.*.layer_output")],
                   [ops.Add("layers.1.layer_output", other_steer, scale=8.0)], []])
run("steered then saved in the graph", prompts, plain,
    interventions=[[ops.Add("layers.1.layer_output", steer, scale=8.0),
                    ops.Save("layers.*.layer_output")], [], []])
run("saved then steered at a tap", prompts, plain,
    interventions=[[ops.Save("layers.*.layer_output"),
                    ops.Add("layers.1.layer_output", steer, scale=8.0)], [], []])
run("ablated in the graph", prompts, plain,
    interventions=[[ops.ProjectOut("layers.1.layer_output", steer),
                    ops.Save("layers.1.layer_output")],
                   [ops.ProjectOut("layers.1.layer_output", other_steer),
                    ops.Add("layers.1.layer_output", other_steer, scale=8.0)], []])
run("ablated from the graph after the prompt", prompts, plain,
    interventions=[[ops.ProjectOut("layers.1.layer_output", steer, steps="decode")], [], []])
run("steered then ablated at a tap", prompts, plain,
    interventions=[[ops.Add("layers.1.layer_output", steer, scale=8.0),
                    ops.ProjectOut("layers.1.layer_output", steer)], [], []])
# Acts at the prompt's last token only, where no tap serves: its prompt's step runs eager, the
# steps of its generated tokens run compiled as if it had no program.
prompt_only = [ops.Save("layers.1.mlp_neurons", positions=(-1,)),
               ops.Save("layers.1.attention_output", positions=(-1,)),
               ops.Add("layers.1.attention_output", steer, scale=8.0, positions=(-1,))]
run("prompt only elsewhere", *traced, interventions=[prompt_only, []])
run("steered elsewhere", prompts, plain,
    interventions=[[ops.Add("layers.1.attention_output", steer, scale=8.0)], [], []])

def fail_a_spill_once(worker):
    # As a move of saves to the host that fails (`SaveStore.spill`): at the start of a step the
    # first request holding saves fails, its saves freed.
    store = worker.model_runner.interp.store

    def failing(limit):
        held = [program_id for program_id, chunks in store._chunks.items() if chunks]
        if not held:
            return type(store).spill(store, limit)
        del store.spill  # once: the store's own again
        store.fail(held[0], "its saves could not be moved to the host (the test's)")
        store._release(held[0])
        return held[:1]

    store.spill = failing

llm.collective_rpc(fail_a_spill_once)
run("a spill failed", prompts, plain,
    interventions=[[ops.Add("layers.1.layer_output", steer, scale=8.0),
                    ops.Save("layers.*.layer_output")], [], []])

def set_compiled(worker, value):
    worker.model_runner.interp.compiled = value

# The adapter told the engine is eager: a step with a program then runs compiled, its hooks
# never run, and the guard must fail the program by name.
llm.collective_rpc(set_compiled, args=(False,))
run("hook skipped", prompts[:2], plain,
    interventions=[[ops.Save("layers.0.attention_output")], []])

# A tap that names nothing, and a graph tap at a value the graph cannot serve: refused by name
# once the engine started (an eager one: quick).
try:
    LLM(sys.argv[1], taps=["layers.0.layer_output", "layers.9.layer_output"],
        graph_taps=["layers.1.self_attn.attention_queries"],
        **{**settings, "enforce_eager": True})
    runs["refused"] = None
except Exception as error:
    runs["refused"] = f"{type(error).__name__}: {error}"
torch.save(runs, sys.argv[3])
'''


@pytest.fixture(scope="module")
def runs(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Both scripts' results, by name. They run side by side: each spends most of its start in
    Python (imports, Dynamo's trace), one core each. On the runner vLLM picks (V2 on a GPU, V1
    with `VLLM_USE_V2_MODEL_RUNNER=0` and on the CPU)."""
    folder = tmp_path_factory.mktemp("compiled")
    inputs = folder / "inputs.pt"
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt in PROMPTS]
    torch.save((SETTINGS, prompts, STEER, OTHER_STEER, TRACED_PROMPTS, TRACED_TOKENS, GENERATED,
                TAPS), inputs)
    children = {}
    for name, script in (("bare", BARE), ("ours", OURS)):
        with open(folder / f"{name}.log", "w") as log:  # files: a full pipe would block it
            children[name] = subprocess.Popen(
                [sys.executable, "-c", script, model_dir, str(inputs), str(folder / f"{name}.pt")],
                env=engine_script_environment(),
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


def test_taps_are_the_canonical_locations_of_their_patterns(ours) -> None:
    assert ours["taps"] == ["layers.0.layer_output", "layers.1.layer_output",
                            "layers.1.mlp.mlp_neurons", "layers.2.layer_output"]


def test_bad_taps_are_refused_by_name(ours) -> None:
    # `TapsRefused`, a `LocationError`: the message names each pattern and why.
    assert ours["refused"] is not None and ours["refused"].startswith("TapsRefused: ")
    assert "tap 'layers.9.layer_output'" in ours["refused"]
    assert "tap 'layers.1.self_attn.attention_queries': layers.1.self_attn.attention_queries " \
        "(batch heads tokens head_dim) is not a residual-width value" in ours["refused"]
    assert "tap 'layers.0.layer_output'" not in ours["refused"]


def test_requests_without_programs_run_compiled_and_equal_a_bare_compiled_engine(
        ours, bare) -> None:
    plain = ours["plain"]
    assert plain["forwards"] == {"compiled": plain["forwards"]["compiled"], "taps": 0,
                                 "in_graph": 0, "eager": 0, "tap_breaks": 0,
                                 "tap_breaks_joined": 0}
    assert plain["forwards"]["compiled"] > 0
    as_the_bare_engine(plain["outputs"], bare["plain"])


def as_the_bare_engine(ours_outputs: list[dict[str, Any]],
                       bare_outputs: list[dict[str, Any]]) -> None:
    """Plain requests of our tapped engine against the bare compiled engine's: tokens and
    log-probabilities bit for bit on the CPU. On a GPU the same tokens and log-probabilities to
    the last bits (H200, 2026-12-02: 2.4e-7 apart, one float32 step): there each tap is one of
    the compiler's splitting ops, so the pieces on either side of it are fused apart and round
    differently — we believe; a compiled engine of ours without taps has not run there yet."""
    if not torch.cuda.is_available():
        assert ours_outputs == bare_outputs
        return
    equal_to_the_last_bits(ours_outputs, bare_outputs)


def traced_on_the_eager_engine(llm, program: list[ops.Op]) -> list[Any]:
    return llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[i]) for i in TRACED_PROMPTS],
                        [SamplingParams(max_tokens=n, temperature=0.0) for n in TRACED_TOKENS],
                        interventions=[program, []], use_tqdm=False)


def check_traced(run: dict[str, Any], llm, reference, program: list[ops.Op]) -> None:
    """The traced request's values equal transformers' and the eager engine's, and both
    requests' tokens the eager engine's."""
    mine, plain = run["outputs"]
    assert mine["error"] is None
    generated = mine["tokens"]
    expected = transformers_values(reference, PROMPTS[0] + generated[:-1])
    for location in ("layers.0.layer_output", "layers.1.layer_output",
                     "layers.1.mlp.mlp_neurons"):
        close(mine["saved"][location], expected[location], location)
    # The eager engine's values to the last bits, not bit for bit: a compiling engine runs
    # torch's own norms and activations where an eager one runs vLLM's kernels (custom ops).
    eager = traced_on_the_eager_engine(llm, program)
    assert mine["saved"].keys() == eager[0].saved.keys()
    for location, value in mine["saved"].items():
        close(value, eager[0].saved[location], f"{location} against the eager engine")
    assert mine["tokens"] == list(eager[0].outputs[0].token_ids)
    assert plain["tokens"] == list(eager[1].outputs[0].token_ids)


def test_a_request_traced_at_taps_runs_compiled_and_equals_transformers(
        ours, llm, reference) -> None:
    traced = ours["traced at taps"]
    # On a GPU the decode step replays V2's full graph broken at the taps, its prompt's step
    # the piecewise graphs; the CPU captures no graph. The graph serves the layer outputs' saves,
    # so the decode step waits at one tap of three (the neurons'): its replay joins the graph
    # segments around the other two (`compiled.replays`).
    assert traced["forwards"] == {"compiled": 4, "taps": 2, "in_graph": 0, "eager": 0,
                                  "tap_breaks": TAP_BREAKS, "tap_breaks_joined": TAP_BREAKS}
    check_traced(traced, llm, reference, PROGRAM)


def test_a_request_traced_beside_a_tap_runs_eager_on_exactly_its_steps(
        ours, llm, reference) -> None:
    traced = ours["traced elsewhere"]
    assert traced["forwards"] == {"compiled": 4, "taps": 0, "in_graph": 0, "eager": 2,
                                  "tap_breaks": 0, "tap_breaks_joined": 0}
    check_traced(traced, llm, reference, [ops.Save("layers.1.attention_output"), *PROGRAM])


def test_untraced_requests_beside_traced_ones_at_taps_equal_a_bare_compiled_engine(
        ours, bare) -> None:
    # The plain request shares both of the traced request's steps, all of them compiled.
    plain = ours["traced at taps"]["outputs"][1]
    assert plain["error"] is None and plain["saved"] == {}
    as_the_bare_engine([plain], [bare["traced"][1]])


def equal_to_the_last_bits(others: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """Requests of ours against another engine's (both as `summary` gives them): the same
    tokens, log-probabilities to the last bits (the plain module tree and inductor's fused
    kernels round differently)."""
    for ours_one, theirs in zip(others, expected, strict=True):
        assert ours_one["error"] is None and ours_one["tokens"] == theirs["tokens"]
        for mine, wanted in zip(ours_one["logprobs"], theirs["logprobs"], strict=True):
            assert mine.keys() == wanted.keys()
            assert all(abs(mine[t] - wanted[t]) <= LOGPROB_TOLERANCE for t in mine)


def steered_on_the_eager_engine(llm, programs: list[list[ops.Op]]) -> list[Any]:
    """The suite's eager engine (hooks, no graph) running `programs` on the three prompts."""
    return llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in PROMPTS],
                        SamplingParams(max_tokens=GENERATED, temperature=0.0, logprobs=2),
                        interventions=programs, use_tqdm=False)


def as_the_eager_engine(mine: dict[str, Any], theirs: Any) -> None:
    """A request of the compiled engine against the eager engine's output (`theirs`)."""
    equal_to_the_last_bits([mine], [{"tokens": list(theirs.outputs[0].token_ids),
                                     "logprobs": logprob_steps(theirs)}])


def test_two_requests_steered_at_a_tap_in_one_step_each_get_their_own_vector_in_the_graph(
        ours, bare, llm) -> None:
    # Tier 3: both `Add`s run from the tap's buffers, no step runs the tap's Python.
    steered = ours["steered at a tap"]
    assert steered["forwards"]["eager"] == steered["forwards"]["taps"] == 0
    assert steered["forwards"]["in_graph"] > 0
    first, second, plain = steered["outputs"]
    eager = steered_on_the_eager_engine(llm, [
        [ops.Add("layers.1.layer_output", STEER, scale=8.0)],
        [ops.Add("layers.1.layer_output", OTHER_STEER, scale=8.0)], []])
    for mine, theirs, unsteered in zip((first, second), eager, bare["plain"], strict=False):
        as_the_eager_engine(mine, theirs)
        assert mine["tokens"] != unsteered["tokens"]
    assert first["tokens"] != second["tokens"]
    equal_to_the_last_bits([plain], bare["plain"][2:])


def test_steering_from_the_graph_keeps_to_the_positions_its_add_names(ours, bare, llm) -> None:
    run = ours["steered from the graph after the prompt"]
    assert run["forwards"]["eager"] == run["forwards"]["taps"] == 0 < run["forwards"]["in_graph"]
    eager = steered_on_the_eager_engine(llm, [
        [ops.Add("layers.1.layer_output", STEER, scale=8.0, steps="decode")], [], []])
    as_the_eager_engine(run["outputs"][0], eager[0])
    # Not added to the prompt: the first token is the unsteered one.
    assert run["outputs"][0]["tokens"][0] == bare["plain"][0]["tokens"][0]
    equal_to_the_last_bits(run["outputs"][1:], bare["plain"][1:])


def test_saves_from_the_graph_equal_transformers_beside_steering_from_it(
        ours, llm, reference) -> None:
    run = ours["saved in the graph beside steering"]
    assert run["forwards"]["eager"] == run["forwards"]["taps"] == 0 < run["forwards"]["in_graph"]
    saving = run["outputs"][0]
    assert saving["error"] is None
    expected = transformers_values(reference, PROMPTS[0] + saving["tokens"][:-1])
    assert len(saving["saved"]) == 3
    for location, value in saving["saved"].items():
        close(value, expected[location], location)
    eager = steered_on_the_eager_engine(llm, [
        [ops.Save("layers.*.layer_output")],
        [ops.Add("layers.1.layer_output", OTHER_STEER, scale=8.0)], []])
    for mine, theirs in zip(run["outputs"], eager, strict=True):
        as_the_eager_engine(mine, theirs)
    for location, value in saving["saved"].items():
        close(value, eager[0].saved[location], f"{location} against the eager engine")


@pytest.mark.parametrize(("name", "path"), [("steered then saved in the graph", "in_graph"),
                                            ("saved then steered at a tap", "taps")])
def test_a_save_beside_steering_at_one_tap_sees_what_its_order_says(
        ours, llm, name: str, path: str) -> None:
    # A `Save` after the `Add` is served in the graph (the copy follows the steering); one
    # before it needs the tap's Python, which serves the program's ops in order.
    run = ours[name]
    other = "taps" if path == "in_graph" else "in_graph"
    assert run["forwards"]["eager"] == run["forwards"][other] == 0 < run["forwards"][path]
    edited_in_broken_graphs(run, path)
    steer = ops.Add("layers.1.layer_output", STEER, scale=8.0)
    save = ops.Save("layers.*.layer_output")
    program = [steer, save] if path == "in_graph" else [save, steer]
    eager = steered_on_the_eager_engine(llm, [program, [], []])
    mine = run["outputs"][0]
    as_the_eager_engine(mine, eager[0])
    assert mine["saved"].keys() == eager[0].saved.keys()
    for location, value in mine["saved"].items():
        close(value, eager[0].saved[location], f"{location} against the eager engine")


def edited_in_broken_graphs(run: dict[str, Any], path: str) -> None:
    """Where a tap's Python edits (`taps`), the decode steps replayed full graphs broken at the
    taps wherever those exist (V2 on a GPU), so the values compared with the eager engine's
    went through them: the graph segments after a tap read what its Python wrote."""
    breaks = run["forwards"]["tap_breaks"]
    assert (breaks > 0) if (TAP_BREAKS and path == "taps") else breaks == 0


ABLATED = {
    "ablated in the graph": (
        "in_graph", [[ops.ProjectOut("layers.1.layer_output", STEER),
                      ops.Save("layers.1.layer_output")],
                     [ops.ProjectOut("layers.1.layer_output", OTHER_STEER),
                      ops.Add("layers.1.layer_output", OTHER_STEER, scale=8.0)], []]),
    "ablated from the graph after the prompt": (
        "in_graph", [[ops.ProjectOut("layers.1.layer_output", STEER, steps="decode")], [], []]),
    "steered then ablated at a tap": (
        "taps", [[ops.Add("layers.1.layer_output", STEER, scale=8.0),
                  ops.ProjectOut("layers.1.layer_output", STEER)], [], []]),
}


@pytest.mark.parametrize("name", list(ABLATED))
def test_ablation_from_the_graph_equals_the_eager_engines_and_leaves_the_others_alone(
        ours, bare, llm, name: str) -> None:
    # `ProjectOut` before a request's `Add`s and `Save`s there runs from the tap's buffers,
    # at some positions only too; after an `Add` it needs the tap's Python (program order).
    path, programs = ABLATED[name]
    run = ours[name]
    other = "taps" if path == "in_graph" else "in_graph"
    assert run["forwards"]["eager"] == run["forwards"][other] == 0 < run["forwards"][path]
    edited_in_broken_graphs(run, path)
    eager = steered_on_the_eager_engine(llm, programs)
    for mine, theirs in zip(run["outputs"], eager, strict=True):
        as_the_eager_engine(mine, theirs)
        assert mine["saved"].keys() == theirs.saved.keys()
        for location, value in mine["saved"].items():
            close(value, theirs.saved[location], f"{location} against the eager engine")
    equal_to_the_last_bits(run["outputs"][2:], bare["plain"][2:])


def test_ablation_from_the_graph_after_the_prompt_changes_only_the_later_steps(ours, bare) -> None:
    """The first token's log-probabilities are the unablated engine's (the prompt's rows keep
    their direction), the later ones move (the decode rows lose it)."""
    mine, plain = ours["ablated from the graph after the prompt"]["outputs"][0], bare["plain"][0]
    # Steps whose top tokens differ moved too (no token in common: infinitely far).
    first, *later = (max((abs(m[t] - p[t]) for t in m.keys() & p.keys()), default=float("inf"))
                     for m, p in zip(mine["logprobs"], plain["logprobs"], strict=True))
    assert first <= LOGPROB_TOLERANCE < max(later)


def test_a_value_saved_after_its_ablation_in_the_graph_has_nothing_left_along_it(ours) -> None:
    saved = ours["ablated in the graph"]["outputs"][0]["saved"]["layers.1.layer_output"]
    unit = STEER / STEER.norm()
    assert saved.shape[1] == len(PROMPTS[0]) + GENERATED - 1
    assert (saved[0] @ unit).abs().max() < 1e-4 * saved.norm(dim=-1).max()


def test_a_request_whose_saves_a_spill_lost_gets_nothing_more_from_the_graph(ours, bare) -> None:
    """A failed move of saves to the host (`SaveStore.spill`, at a step's start) fails the
    requests it was moving; the step already scheduled them, and one served from the graph's
    buffers must not steer them or save for them at that step (saves that would come back as a
    fragment beside the error). The others run as if nothing happened."""
    run = ours["a spill failed"]
    # The step it failed at runs compiled with nothing to serve (counted with the taps' steps:
    # its adapter saw a program scheduled).
    assert run["forwards"]["eager"] == 0 < run["forwards"]["in_graph"]
    failed, *others = run["outputs"]
    assert "could not be moved to the host (the test's)" in (failed["error"] or "")
    assert failed["saved"] == {}
    equal_to_the_last_bits(others, bare["plain"][1:])


def test_steering_elsewhere_on_a_compiled_engine_changes_only_its_own_request(
        ours, bare) -> None:
    run = ours["steered elsewhere"]
    assert run["forwards"]["eager"] > 0 and run["forwards"]["taps"] == 0
    steered, others = run["outputs"][0], run["outputs"][1:]
    assert steered["error"] is None and steered["tokens"] != bare["plain"][0]["tokens"]
    equal_to_the_last_bits(others, bare["plain"][1:])


def test_a_program_acting_on_its_prompt_only_runs_eager_on_its_prompts_step_only(
        ours, llm, bare) -> None:
    """Saves and an edit at the prompt's last token where no tap serves: the prompt's step runs
    eager, the generated tokens' steps compiled (vLLM's full graphs on a GPU); the values, the
    edited request's tokens and its neighbour's equal the eager engine's."""
    run = ours["prompt only elsewhere"]
    assert run["forwards"] == {"compiled": 5, "taps": 0, "in_graph": 0, "eager": 1,
                               "tap_breaks": 0, "tap_breaks_joined": 0}
    mine, plain = run["outputs"]
    eager = traced_on_the_eager_engine(llm, [
        ops.Save("layers.1.mlp_neurons", positions=(-1,)),
        ops.Save("layers.1.attention_output", positions=(-1,)),
        ops.Add("layers.1.attention_output", STEER, scale=8.0, positions=(-1,))])
    assert mine["error"] is None and mine["saved"].keys() == eager[0].saved.keys()
    for location, value in mine["saved"].items():
        assert value.shape[1] == 1  # the prompt's last position only
        close(value, eager[0].saved[location], f"{location} against the eager engine")
    assert mine["tokens"] == list(eager[0].outputs[0].token_ids)
    assert plain["tokens"] == list(eager[1].outputs[0].token_ids)
    equal_to_the_last_bits([plain], [bare["traced"][1]])  # its prompt's step ran eager too


def test_a_program_whose_hook_a_compiled_forward_skips_fails_by_name(ours) -> None:
    skipped = ours["hook skipped"]
    assert skipped["forwards"]["eager"] == 0
    failed, plain = skipped["outputs"]
    assert failed["error"] is not None and "layers.0.self_attn.attention_output" in failed["error"]
    assert "did not run" in failed["error"] and failed["saved"] == {}
    assert plain["error"] is None
