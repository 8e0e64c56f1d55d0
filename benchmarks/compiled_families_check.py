"""A check, not a test (~1 min per family on 2 cores, too long for CI): for every family case of
the vllm-envoys equivalence suite, our engine compiled with every value of its catalogue tapped
(`LLM(enforce_eager=False, taps=...)`) against our eager engine on the same tiny random model.
Each family must save the same values (the script prints the worst relative error, within
1e-4 in float32 and 1e-1 in bfloat16, the envoys suite's tolerances), generate the same tokens
and run no step eager unless a tap was refused (then its steps run eager). Run it before
claiming a family works compiled:

    python benchmarks/compiled_families_check.py [--parallel N] [CASE ...]

(in an environment holding the stack and the envoys suite's test dependencies); it exits 1 if
any family differs or fails. Each family runs in the dtype of its suite case (on a GPU,
`VLLM_INTERP_ORACLE_DEVICE=cuda`, DeepSeek-V2 in bfloat16: vLLM 0.33 has no float32 latent
attention on CUDA); `--parallel N` checks N families side by side (each its own engine
processes; on the GPU: `benchmarks/gpu/check.sh families_compiled`). On a GPU under vLLM's V2
runner, a family whose taps served must also have replayed the full CUDA graphs broken at the
taps at least once (`tap_breaks`), unless `VLLM_INTERP_BREAK_AT_TAPS=0` or V1 was chosen: else
the check passed without the path it is there for. Last runs: 2026-12-02, vLLM 0.32 (CPU):
all 19 cases equal (worst 1.9e-6), tokens equal, no eager step; 2026-12-06, vLLM 0.33 on an
H100 (V2, `357d994`): 18 of 18 cases agree, every family with served taps on the broken graphs
(docs/gpu.md; that run came before the `tap_breaks` requirement, which its output meets).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages" / "vllm-envoys" / "tests"))
os.environ.setdefault("VLLM_INTERP_ORACLE_DEVICE", "cpu")

ENGINE = r'''
import json, os, sys, torch
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import LLM, TapsRefused, ops
path, engine, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
taps, dtype = json.loads(sys.argv[4]), sys.argv[5]
settings = dict(skip_tokenizer_init=True, dtype=dtype, kv_cache_memory_bytes=64 << 20,
                max_model_len=128, max_num_seqs=4, max_num_batched_tokens=8, seed=0, **engine)
if torch.cuda.is_available():  # vLLM checks this share is free at start: engines side by side
    settings["gpu_memory_utilization"] = 0.05
# Both spelled out: on a GPU our LLM compiles unless told otherwise.
compiled = {"enforce_eager": True} if taps is None else {"enforce_eager": False, "taps": taps}
refused = {}
try:
    llm = LLM(path, **settings, **compiled)
except TapsRefused as error:  # e.g. values computed inside vLLM's fused MoE op on a GPU
    refused = error.refused
    compiled["taps"] = [tap for tap in taps if tap not in refused]
    llm = LLM(path, **settings, **compiled)
catalogue = [location for location, why in llm.support().items() if why is None]
prompts = [[5, 17, 99, 3, 42, 7, 8, 9, 10, 11, 12], [91, 45, 12]]
outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                       SamplingParams(max_tokens=3, temperature=0.0),
                       interventions=[[ops.Save(location) for location in catalogue], []],
                       use_tqdm=False)
torch.save({"catalogue": catalogue, "saved": outputs[0].saved, "error": outputs[0].error,
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "forwards": llm.forwards(), "refused": refused}, out)
'''


# The envoys suite's tolerances (test_equivalence.TOLERANCES), relative to a value's largest.
TOLERANCES = {"float32": 1e-4, "bfloat16": 1e-1}


def run_engine(folder: str, engine: str, taps: list[str] | None, dtype: str) -> dict:
    """One engine of ours in a process of its own (eager, or compiled with `taps`): its saves
    of every catalogue value for one request, both requests' tokens and its forwards."""
    out = os.path.join(folder, "eager.pt" if taps is None else "compiled.pt")
    subprocess.run([sys.executable, "-c", ENGINE, folder, engine, out, json.dumps(taps), dtype],
                   check=True, capture_output=True, text=True, timeout=900)
    return torch.load(out, weights_only=False)


def worst_error(eager: dict, compiled: dict) -> tuple[float, str]:
    """The largest error relative to a value's largest, and where; values missing or of
    another shape compiled are infinitely wrong, and all of them are named."""
    found = []
    mismatched = []
    for location, expected in eager["saved"].items():
        got = compiled["saved"].get(location)
        if got is None or got.shape != expected.shape:
            mismatched.append(location)
            continue
        scale = max(float(expected[expected.isfinite()].abs().max()), 1e-6)
        difference = (got - expected).abs().nan_to_num(0.0)
        found.append((float(difference.max()) / scale, location))
    if mismatched:
        return float("inf"), f"shapes differ at {'; '.join(mismatched)}"
    if not found:
        return float("inf"), "the eager engine saved nothing"
    return max(found)


def breaks_expected() -> bool:
    """Whether steps served by taps' Python should replay full graphs broken at the taps: on a
    GPU under V2 (vLLM's choice there) with the broken captures left on."""
    return (torch.cuda.is_available() and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0"
            and os.environ.get("VLLM_INTERP_BREAK_AT_TAPS") != "0")


def check_family(case: Any) -> bool:
    """Build `case`'s random model, run it eager and compiled with every value tapped, print one
    line saying whether they agree; True when they do."""
    from conftest import random_model

    model = random_model(case)  # the envoys suite's own model of this family
    folder = tempfile.mkdtemp()
    model.save_pretrained(folder, safe_serialization=True)
    engine = json.dumps(dict(case.engine))
    try:
        eager = run_engine(folder, engine, None, case.dtype)
        taps = [location for location in eager["catalogue"]
                if location not in ("logits", "next_token_probs")]
        compiled = run_engine(folder, engine, taps, case.dtype)
    except subprocess.CalledProcessError as error:
        print(f"{case.name}: FAILED\n{error.stderr[-3000:]}", flush=True)
        return False
    # A refused tap leaves its location to the module tree: those steps run eager, and only
    # then.
    refused = compiled["refused"]
    forwards = compiled["forwards"]
    unbroken = forwards["taps"] > 0 and forwards["tap_breaks"] == 0 and breaks_expected()
    same = (eager["tokens"] == compiled["tokens"] and eager["error"] is None
            and compiled["error"] is None and (forwards["eager"] == 0) == (not refused)
            and not unbroken)
    error, where = worst_error(eager, compiled)
    agree = same and error <= TOLERANCES[case.dtype]
    print(f"{case.name} ({case.dtype}): {'ok' if agree else 'DIFFERS'}; worst relative error "
          f"{error:.1e} ({where}); forwards {forwards}", flush=True)
    if unbroken:
        print(f"{case.name}: no step replayed the graphs broken at the taps", flush=True)
    if refused:
        print(f"{case.name}: taps refused (their steps ran eager): {', '.join(refused)}",
              flush=True)
    for run, result in (("eager", eager), ("compiled", compiled)):
        if result["error"] is not None:
            print(f"{case.name}: the {run} request failed: {result['error']}", flush=True)
    return agree


def main() -> None:
    from conftest import CASES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="family case names (default: all)")
    parser.add_argument("--parallel", type=int, default=1,
                        help="families checked side by side (each its own engine processes)")
    arguments = parser.parse_args()
    known = {case.name for case in CASES}
    if unknown := [name for name in arguments.cases if name not in known]:
        raise SystemExit(f"unknown family cases {unknown}; known: {', '.join(sorted(known))}")
    chosen = [case for case in CASES if not arguments.cases or case.name in arguments.cases]
    # Threads only wait on the engines' processes; the models are built one at a time each.
    with ThreadPoolExecutor(max_workers=max(1, arguments.parallel)) as pool:
        results = list(pool.map(check_family, chosen))
    print(f"{sum(results)} of {len(results)} families agree", flush=True)
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
