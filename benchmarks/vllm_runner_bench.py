"""What interpretability costs inside vLLM: each arm against the bare engine, side by side.

Run with `nox -s "bench(package='vllm-runner')"` (arguments after `--`, e.g. `-- --repeats 5`).
It rewrites docs/benchmarks/vllm-runner.md and its plot.

Method (DESIGN §7): one process holds a bare `vllm.LLM` and our `LLM`, with the same model and
engine settings (eager, fp32, in-process engines so no idle engine process competes for the
cores). For each repeat and each arm, the bare engine and the arm run the same fresh workload
back to back (bare first in even repeats, the arm first in odd ones), so slow drift of the
machine and order effects hit both sides of a ratio alike. The ratio
of a pair is bare time / arm time (throughput ratio, 1.0 = free); each arm reports the median
ratio and its min-max over repeats. The workload: `--requests` prompts of random tokens, 32-256
long, each generating exactly `--max-tokens` tokens (`ignore_eos`), all submitted at once
(concurrency = requests).

Arms: (a) our LLM, no interventions; (b) Save one layer's layer_output on every request;
(c) Save every layer's layer_output; (d) Add steering at one layer on every request; (e) Save one
layer on 10% of requests; (f) Save one layer's attention_probabilities; (g) Save every layer's
mlp_neurons; (hf) transformers' batched `generate` with a forward hook capturing one layer —
what users run today — compared with the bare engine the same way.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

import torch
import vllm
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import LLM, ops

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks" / "vllm-runner.md"
PLOT = ROOT / "docs" / "benchmarks" / "vllm-runner.png"
TARGETS = {"a": 0.99, "b": 0.97, "c": 0.80, "d": 0.98, "e": 0.99}
NAMES = {
    "a": "our LLM, no interventions",
    "b": "Save one layer's layer_output, every request",
    "c": "Save every layer's layer_output, every request",
    "d": "Add steering at one layer, every request",
    "e": "Save one layer on 10% of requests",
    "f": "Save one layer's attention_probabilities, every request",
    "g": "Save every layer's mlp_neurons, every request",
    "hf": "transformers generate + a hook capturing one layer",
}


def programs(arm: str, requests: int, layers: int, hidden: int) -> list[list] | None:
    """The interventions of an arm, one list per request (None: no interventions at all)."""
    middle = layers // 2
    one = [ops.Save(f"layers.{middle}.layer_output")]
    if arm == "a":
        return None
    if arm == "b":
        return [one] * requests
    if arm == "c":
        return [[ops.Save("layers.*.layer_output")]] * requests
    if arm == "d":
        vector = torch.randn(hidden, generator=torch.Generator().manual_seed(0))
        return [[ops.Add(f"layers.{middle}.layer_output", vector, scale=0.5)]] * requests
    if arm == "e":
        return [one if i % 10 == 0 else [] for i in range(requests)]
    if arm == "f":
        return [[ops.Save(f"layers.{middle}.attention_probabilities")]] * requests
    if arm == "g":
        return [[ops.Save("layers.*.mlp_neurons")]] * requests
    raise ValueError(f"unknown arm {arm!r}")


def timed(run: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def hf_runner(model_dir: str, requests: list, max_tokens: int) -> Callable[[], object]:
    """transformers' batched greedy generate, left-padded, with one layer's output captured."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layer = model.model.layers[len(model.model.layers) // 2]
    pad = model.config.pad_token_id or 0
    captured: list[torch.Tensor] = []

    def run() -> None:
        prompts = [request["prompt_token_ids"] for request in requests]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        captured.clear()
        handle = layer.register_forward_hook(
            lambda module, args, output: captured.append(
                (output[0] if isinstance(output, tuple) else output).detach().clone()))
        try:
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                               min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        finally:
            handle.remove()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arms", default="a,b,c,d,e,f,g,hf")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--memory", action="store_true",
                        help="instead: peak memory while saving every layer, run after run")
    arguments = parser.parse_args()
    arms = arguments.arms.split(",")
    if arguments.memory:
        memory(arguments)
        return

    ours = LLM(arguments.model, dtype="float32", seed=0)
    model_dir = ours.llm_engine.model_config.model
    bare = vllm.LLM(model_dir, dtype="float32", seed=0, enforce_eager=True)
    generator = torch.Generator().manual_seed(0)
    vocab = ours.vocab_size

    def fresh_prompts() -> list[list[int]]:
        # New prompts for every pair: neither engine has them in its prefix cache (requests
        # with a program never read it; a bare engine would, on a repeated prompt).
        return [torch.randint(0, vocab, (int(length),), generator=generator).tolist()
                for length in torch.randint(32, 257, (arguments.requests,),
                                            generator=generator)]

    requests = [TokensPrompt(prompt_token_ids=p) for p in fresh_prompts()]
    params = SamplingParams(max_tokens=arguments.max_tokens, temperature=0.0, ignore_eos=True)

    def bare_run() -> None:
        bare.generate(requests, params, use_tqdm=False)

    runners: dict[str, Callable[[], object]] = {}
    for arm in arms:
        if arm == "hf":
            runners[arm] = hf_runner(model_dir, requests, arguments.max_tokens)
        else:
            interventions = programs(arm, len(requests), ours.num_layers, ours.hidden_size)

            def run(interventions=interventions) -> None:
                outputs = ours.generate(requests, params, interventions=interventions,
                                        use_tqdm=False)
                assert all(o.error is None for o in outputs), outputs[0].error
            runners[arm] = run

    bare_run()  # warm both engines and the allocator before measuring
    for arm in arms:
        if arm != "hf":
            runners[arm]()
    ratios: dict[str, list[float]] = {arm: [] for arm in arms}
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    bare_seconds: list[float] = []
    for repeat in range(arguments.repeats):
        for arm in arms:
            requests[:] = [TokensPrompt(prompt_token_ids=p) for p in fresh_prompts()]
            # Alternate which side of a pair runs first, so order effects cancel out.
            if repeat % 2 == 0:
                base, took = timed(bare_run), timed(runners[arm])
            else:
                took, base = timed(runners[arm]), timed(bare_run)
            bare_seconds.append(base)
            seconds[arm].append(took)
            ratios[arm].append(base / took)
            print(f"repeat {repeat + 1}/{arguments.repeats} {arm:>2}: bare {base:6.2f} s, "
                  f"arm {took:6.2f} s, ratio {base / took:.3f}", flush=True)
    generated = arguments.requests * arguments.max_tokens
    report = render(arguments, arms, ratios, seconds, bare_seconds, generated, model_dir)
    print(report)
    if not arguments.no_write:
        RESULTS.write_text(report)
        plot(arms, ratios)


def memory(arguments: argparse.Namespace, runs: int = 5) -> None:
    """Peak resident memory of this process (client and in-process worker) while every request
    saves every layer's output: it must stay bounded by one `generate`'s saves, not grow with
    what earlier runs saved (the worker frees each request's saves when they are collected)."""
    import resource

    ours = LLM(arguments.model, dtype="float32", seed=0)
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    program = [ops.Save("layers.*.layer_output")]
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"{arguments.requests} requests x 256 prompt tokens, every layer's layer_output; "
          f"peak RSS after start-up (model, KV cache) {baseline / 2**30:.2f} GiB")
    for run in range(1, runs + 1):
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(
            0, ours.vocab_size, (256,), generator=generator).tolist())
            for _ in range(arguments.requests)]
        outputs = ours.generate(prompts, params, interventions=program, use_tqdm=False)
        saved = sum(value.numel() * value.element_size()
                    for output in outputs for value in output.saved.values())
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(f"run {run}: saved {saved / 2**30:.2f} GiB, peak RSS so far "
              f"{peak / 2**30:.2f} GiB", flush=True)
        del outputs
        gc.collect()


def render(arguments, arms, ratios, seconds, bare_seconds, generated, model_dir) -> str:
    lines = [
        "# vllm-runner: cost against the bare engine",
        "",
        f"Written by `benchmarks/vllm_runner_bench.py` on {datetime.date.today()} "
        f"({platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"vLLM {vllm.__version__}); model `{Path(model_dir).name}`, fp32, eager, in-process "
        f"engines; {arguments.requests} requests of 32-256 random tokens submitted at once, "
        f"{arguments.max_tokens} generated tokens each; {arguments.repeats} repeats, each arm "
        "paired with a bare-engine run on the same fresh prompts (order alternating).",
        "",
        f"Bare engine: median {statistics.median(bare_seconds):.2f} s per run "
        f"({generated / statistics.median(bare_seconds):.0f} generated tokens/s).",
        "",
        "| arm | what | median s | throughput ratio vs bare (median) | min-max | target |",
        "|---|---|---|---|---|---|",
    ]
    for arm in arms:
        target = TARGETS.get(arm)
        verdict = "" if target is None else (
            f"{'met' if statistics.median(ratios[arm]) >= target else 'NOT met'} (≥ {target})")
        lines.append(f"| {arm} | {NAMES[arm]} | {statistics.median(seconds[arm]):.2f} | "
                     f"{statistics.median(ratios[arm]):.3f} | {min(ratios[arm]):.3f}-"
                     f"{max(ratios[arm]):.3f} | {verdict} |")
    if "hf" in arms and "b" in arms:
        speedup = statistics.median(seconds["hf"]) / statistics.median(seconds["b"])
        lines += ["", f"Arm (b) is {speedup:.1f}x faster than transformers capturing the same "
                  "layer (target ≥ 5x)."]
    lines += ["", "![ratios](vllm-runner.png)", ""]
    return "\n".join(lines)


def plot(arms: list[str], ratios: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 4))
    medians = [statistics.median(ratios[arm]) for arm in arms]
    low = [m - min(ratios[arm]) for m, arm in zip(medians, arms, strict=True)]
    high = [max(ratios[arm]) - m for m, arm in zip(medians, arms, strict=True)]
    axes.bar(arms, medians, yerr=[low, high], capsize=4, color="#4c72b0")
    for index, arm in enumerate(arms):
        if arm in TARGETS:
            axes.hlines(TARGETS[arm], index - 0.4, index + 0.4, colors="#c44e52")
    axes.axhline(1.0, color="gray", linewidth=0.8)
    axes.set_ylabel("throughput / bare engine")
    axes.set_title("Cost of each arm against the bare engine (red: target)")
    figure.tight_layout()
    figure.savefig(PLOT, dpi=120)
    pyplot.close(figure)


if __name__ == "__main__":
    main()
