"""A check, not a test (~1 min per family on 2 cores, too long for CI): for every family case of
the vllm-envoys equivalence suite, our engine compiled with every value of its catalogue tapped
(`LLM(enforce_eager=False, taps=...)`) against our eager engine on the same tiny random model.
Each family must save the same values (the script prints the worst relative error), generate
the same tokens and run no step eager. Run it before claiming a family works compiled:

    python benchmarks/compiled_families_check.py [CASE ...]

(in an environment holding the stack and the envoys suite's test dependencies). Last run
2026-12-02, vLLM 0.32 (CPU): all 19 cases equal (worst 1.9e-6), tokens equal, no eager step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages" / "vllm-envoys" / "tests"))
os.environ.setdefault("VLLM_INTERP_ORACLE_DEVICE", "cpu")

ENGINE = r'''
import json, os, sys, torch
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import LLM, ops

path, engine, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
taps = json.loads(sys.argv[4])
settings = dict(skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=64 << 20,
                max_model_len=128, max_num_seqs=4, max_num_batched_tokens=8, seed=0, **engine)
compiled = {} if taps is None else {"enforce_eager": False, "taps": taps}
llm = LLM(path, **settings, **compiled)
catalogue = [location for location, why in llm.support().items() if why is None]
prompts = [[5, 17, 99, 3, 42, 7, 8, 9, 10, 11, 12], [91, 45, 12]]
outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                       SamplingParams(max_tokens=3, temperature=0.0),
                       interventions=[[ops.Save(location) for location in catalogue], []],
                       use_tqdm=False)
torch.save({"catalogue": catalogue, "saved": outputs[0].saved, "error": outputs[0].error,
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "forwards": llm.forwards()}, out)
'''


def run_engine(folder: str, engine: str, taps: list[str] | None) -> dict:
    out = os.path.join(folder, "eager.pt" if taps is None else "compiled.pt")
    subprocess.run([sys.executable, "-c", ENGINE, folder, engine, out, json.dumps(taps)],
                   check=True, capture_output=True, text=True, timeout=900)
    return torch.load(out, weights_only=False)


def worst_error(eager: dict, compiled: dict) -> tuple[float, str]:
    found = []
    for location, expected in eager["saved"].items():
        scale = max(float(expected[expected.isfinite()].abs().max()), 1e-6)
        difference = (compiled["saved"][location] - expected).abs().nan_to_num(0.0)
        found.append((float(difference.max()) / scale, location))
    return max(found)


def main() -> None:
    from conftest import CASES

    wanted = set(sys.argv[1:])
    for case in CASES:
        if wanted and case.name not in wanted:
            continue
        torch.manual_seed(0)
        model = case.model(case.config())
        with torch.no_grad():  # as the envoys suite widens its random models
            for name, parameter in model.named_parameters():
                if parameter.dim() > 1:
                    parameter.normal_(0.0, 0.08)
                if name.endswith("sinks"):
                    parameter.normal_(0.0, 1.0)
        folder = tempfile.mkdtemp()
        model.save_pretrained(folder, safe_serialization=True)
        engine = json.dumps(dict(case.engine))
        try:
            eager = run_engine(folder, engine, None)
            taps = [location for location in eager["catalogue"]
                    if location not in ("logits", "next_token_probs")]
            compiled = run_engine(folder, engine, taps)
        except subprocess.CalledProcessError as error:
            print(f"{case.name}: FAILED\n{error.stderr[-3000:]}", flush=True)
            continue
        same = (eager["tokens"] == compiled["tokens"] and eager["error"] is None
                and compiled["error"] is None and compiled["forwards"]["eager"] == 0)
        error, where = worst_error(eager, compiled)
        print(f"{case.name}: {'ok' if same and error <= 1e-4 else 'DIFFERS'}; worst relative "
              f"error {error:.1e} ({where}); forwards {compiled['forwards']}", flush=True)


if __name__ == "__main__":
    main()
