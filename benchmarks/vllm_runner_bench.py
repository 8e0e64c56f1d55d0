"""What interpretability costs inside vLLM: each arm against the bare engine, side by side.

Run with `nox -s "bench(package='vllm-runner')"` (arguments after `--`, e.g. `-- --repeats 5`).
It rewrites docs/benchmarks/eager-cpu.md and its plot (docs/benchmarks/vllm-runner.png);
docs/benchmarks.md summarises it beside the other benchmarks. On a GPU, benchmarks/gpu/check.sh
runs it with a random model of a real shape and `--graphs`.

Method (docs/benchmarks.md): one process holds a bare `vllm.LLM` and our `LLM`, with the same
model and engine settings (eager, in-process engines so no idle engine process competes for the
cores).
For each repeat and each arm, the bare engine and the arm run the same fresh workload back to
back (bare first in even repeats, the arm first in odd ones), so slow drift of the machine and
order effects hit both sides of a ratio alike. The ratio of a pair is bare time / arm time
(throughput ratio, 1.0 = free); each arm reports the median
ratio and its min-max over repeats. The workload: prompts of random tokens, 32-256 long, each
generating exactly `--max-tokens` tokens (`ignore_eos`); at concurrency c (`--concurrency
1,16,64`) a run sends max(c, `--min-requests`) prompts in waves of c submitted at once.

Arms: (a) our LLM, no interventions; (b) Save one layer's layer_output on every request;
(c) Save every layer's layer_output; (d) Add steering at one layer on every request; (e) Save one
layer on 10% of requests; (f) Save one layer's attention_probabilities; (g) Save every layer's
mlp_neurons; (hf) transformers' batched `generate` with a forward hook capturing one layer —
what users run today — compared with the bare engine the same way; (graphs, `--graphs`) vLLM's
default engine with CUDA graphs and compilation, which hooks cannot run inside. Asked for by
name (`--arms`), in a random JumpReLU SAE's feature space at the middle layer's output
(`--sae-width` features, loaded with `LLM.load_saes`; speed depends on its shape, not its
values): (sf) `Features`, the top 64 per token, every request; (ss) `SteerFeatures` by one
feature, every request; (sc) `ClampFeatures` of one feature, every request.

A separate process then measures peak memory while saving every layer (`--memory`).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

import torch
import vllm
from pairs import timed_pair
from profiles import python_profile
from random_models import add_model_arguments, random_checkpoint, random_sae_folder
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import LLM, ops

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks" / "eager-cpu.md"
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
    "graphs": "vLLM's default engine (CUDA graphs, compiled), no interventions",
    "sf": "an SAE's top-64 Features at one layer, every request",
    "ss": "SteerFeatures by one SAE feature at one layer, every request",
    "sc": "ClampFeatures of one SAE feature at one layer, every request",
}
SAE_ARMS = ("sf", "ss", "sc")
SAE_NAME = "middle"


@dataclass(frozen=True)
class Measured:
    """One concurrency level's pairs: per arm the ratios (bare time / arm time) and times."""

    ratios: dict[str, list[float]]
    seconds: dict[str, list[float]]
    bare_seconds: list[float]
    generated: int  # tokens generated per run


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
    if arm == "sf":
        return [[ops.Features(sae=SAE_NAME, top_k=64)]] * requests
    if arm == "ss":
        return [[ops.SteerFeatures(sae=SAE_NAME, features={7: 4.0})]] * requests
    if arm == "sc":
        return [[ops.ClampFeatures(sae=SAE_NAME, features={7: 0.0})]] * requests
    raise ValueError(f"unknown arm {arm!r}")


def timed(run: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


_HF_MODELS: dict[str, torch.nn.Module] = {}


def hf_runner(model_dir: str, requests: list, max_tokens: int, dtype: str,
              width: int) -> Callable[[], object]:
    """transformers' batched greedy generate (batches of `width`, left-padded) with one layer's
    output captured, on the GPU when there is one."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF_MODELS:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        _HF_MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    model = _HF_MODELS[model_dir]
    layer = model.model.layers[len(model.model.layers) // 2]
    pad = model.config.pad_token_id or 0
    captured: list[torch.Tensor] = []

    def batch(prompts: list[list[int]]) -> None:
        longest = max(map(len, prompts))
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts],
                           device=model.device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts],
                            device=model.device)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                       min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)

    def run() -> None:
        prompts = [request["prompt_token_ids"] for request in requests]
        captured.clear()
        handle = layer.register_forward_hook(
            lambda module, args, output: captured.append(
                (output[0] if isinstance(output, tuple) else output).detach().clone()))
        try:
            with torch.inference_mode():
                for start in range(0, len(prompts), width):
                    batch(prompts[start:start + width])
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        finally:
            handle.remove()
    return run


def profile_arms(arms: list[str], runs: dict[str, Callable[[], object]], path: Path) -> None:
    """Where each arm's time goes (cProfile, in-process engine: our hooks included), for finding
    what a slow arm spends its time on; with a GPU, waits for the device show as the calls that
    wait (`.cpu()`, `.item()`, `.tolist()`)."""
    sections = []
    for arm in arms:
        start = time.perf_counter()
        found = python_profile(runs[arm])
        sections.append(f"\n### arm {arm}: {time.perf_counter() - start:.2f} s under cProfile\n"
                        f"{found}")
    path.write_text("".join(sections))
    print(f"profile written to {path}")


def concurrency_levels(text: str) -> list[int]:
    levels = [int(level) for level in text.split(",")]
    if any(level < 1 for level in levels):
        raise SystemExit(f"--concurrency takes positive integers, got {text!r}")
    return levels


def engine_settings(arguments: argparse.Namespace) -> dict:
    """Settings every engine of the run shares (ours, the bare ones)."""
    settings = dict(dtype=arguments.dtype, seed=0)
    if torch.cuda.is_available():
        # Up to three engines and transformers share one GPU in this process.
        settings["gpu_memory_utilization"] = arguments.gpu_memory_utilization
    if arguments.shape:
        settings["skip_tokenizer_init"] = True
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--concurrency", default="1,16,64",
                        help="requests in flight, comma-separated (e.g. 1,16,64)")
    parser.add_argument("--min-requests", type=int, default=4,
                        help="each run sends at least this many requests, in waves of the "
                             "concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--arms", default="a,b,c,d,e,f,g,hf")
    parser.add_argument("--sae-width", type=int, default=16384,
                        help="features of the SAE arms' random SAE (default: 16384)")
    parser.add_argument("--graphs", action="store_true",
                        help="also time vLLM's default engine (CUDA graphs, compilation) "
                             "against the eager bare engine (GPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--plot", default=str(PLOT))
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--memory", action="store_true",
                        help="instead: peak memory while saving every layer, run after run")
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="instead of timing: run each arm once under cProfile after the "
                             "warm-up and write where its time went to PATH")
    parser.add_argument("--requests-memory", type=int, default=64)
    parser.add_argument("--skip-memory", action="store_true",
                        help="do not append the memory measurement (a separate process)")
    arguments = parser.parse_args()
    if arguments.memory:
        memory(arguments)
        return
    arms = arguments.arms.split(",") + (["graphs"] if arguments.graphs else [])
    unknown = [arm for arm in arms if arm not in NAMES]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {', '.join(NAMES)}")
    levels = concurrency_levels(arguments.concurrency)

    settings = engine_settings(arguments)
    model = arguments.model
    if arguments.shape:
        model = random_checkpoint(arguments.shape, tempfile.mkdtemp(),
                                  getattr(torch, arguments.dtype),
                                  "cuda" if torch.cuda.is_available() else "cpu")
    # Eager like the bare engine it is paired with: since the default flip a GPU `LLM` compiles
    # unless told otherwise (compiled_bench.py measures ours compiled).
    ours = LLM(model, enforce_eager=True, **settings)
    model_dir = ours.llm_engine.model_config.model
    if any(arm in SAE_ARMS for arm in arms):
        ours.load_saes({SAE_NAME: random_sae_folder(ours.hidden_size, arguments.sae_width,
                                                    ours.num_layers // 2)})
    bare = vllm.LLM(model_dir, enforce_eager=True, **settings)
    default = vllm.LLM(model_dir, **settings) if "graphs" in arms else None
    generator = torch.Generator().manual_seed(0)
    vocab = ours.vocab_size
    params = SamplingParams(max_tokens=arguments.max_tokens, temperature=0.0, ignore_eos=True)

    def fresh_prompts(count: int) -> list[TokensPrompt]:
        # New prompts for every pair: neither engine has them in its prefix cache (requests
        # with a program never read it; a bare engine would, on a repeated prompt).
        return [TokensPrompt(prompt_token_ids=torch.randint(
            0, vocab, (int(length),), generator=generator).tolist())
            for length in torch.randint(32, 257, (count,), generator=generator)]

    def in_waves(engine_generate: Callable, requests: list, width: int) -> None:
        for start in range(0, len(requests), width):
            engine_generate(requests[start:start + width])

    def plain(engine: vllm.LLM, requests: list, width: int) -> Callable[[], object]:
        """A run of `engine` without interventions (the bare or the default engine)."""
        return lambda: in_waves(lambda wave: engine.generate(wave, params, use_tqdm=False),
                                requests, width)

    def runner_for(arm: str, requests: list, width: int) -> Callable[[], object]:
        if arm == "hf":
            return hf_runner(model_dir, requests, arguments.max_tokens, arguments.dtype, width)
        if arm == "graphs":
            return plain(default, requests, width)

        def run() -> None:
            def wave_run(wave: list) -> None:
                interventions = programs(arm, len(wave), ours.num_layers, ours.hidden_size)
                outputs = ours.generate(wave, params, interventions=interventions,
                                        use_tqdm=False)
                assert all(o.error is None for o in outputs), outputs[0].error
            in_waves(wave_run, requests, width)
        return run

    measured = {}
    for width in levels:
        count = max(width, arguments.min_requests)
        warm = fresh_prompts(count)
        # Warm every engine (and the allocator, and transformers) before measuring.
        plain(bare, warm, width)()
        for arm in arms:
            if arm != "hf":
                runner_for(arm, warm, width)()
        if arguments.profile:
            profile_arms(arms, {arm: runner_for(arm, fresh_prompts(count), width)
                                for arm in arms}, Path(arguments.profile))
            return
        ratios: dict[str, list[float]] = {arm: [] for arm in arms}
        seconds: dict[str, list[float]] = {arm: [] for arm in arms}
        bare_seconds: list[float] = []
        for repeat in range(arguments.repeats):
            for arm in arms:
                requests = fresh_prompts(count)
                arm_run, bare_run = runner_for(arm, requests, width), plain(bare, requests, width)
                base, took = timed_pair(repeat, partial(timed, bare_run), partial(timed, arm_run))
                bare_seconds.append(base)
                seconds[arm].append(took)
                ratios[arm].append(base / took)
                print(f"concurrency {width} repeat {repeat + 1}/{arguments.repeats} {arm:>6}: "
                      f"bare {base:6.2f} s, arm {took:6.2f} s, ratio {base / took:.3f}",
                      flush=True)
            measured[width] = Measured(ratios, seconds, bare_seconds,
                                       count * arguments.max_tokens)
            # Written after every repeat: a run cut short (the GPU's 10-minute calls) still
            # leaves a report of what it measured.
            publish(arguments, arms, measured, model_dir)
    # The page and plot were written after the last repeat; only the memory section is new.
    report = render(arguments, arms, measured, model_dir)
    if not arguments.skip_memory and not arguments.shape and not torch.cuda.is_available():
        report += memory_section(arguments)
        if not arguments.no_write:
            Path(arguments.results).write_text(report)
    print(report)


def publish(arguments: argparse.Namespace, arms: list[str], measured: dict[int, Measured],
            model_dir: str) -> str:
    """Render what was measured so far and, unless `--no-write`, write the page and its plot."""
    report = render(arguments, arms, measured, model_dir)
    if not arguments.no_write:
        Path(arguments.results).parent.mkdir(parents=True, exist_ok=True)
        Path(arguments.results).write_text(report)
        plot(arms, measured, Path(arguments.plot))
    return report


def _status_gib(field: str) -> float:
    """A memory figure of this process from /proc/self/status (`VmRSS`, `VmHWM`), in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 2**30
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Start a new peak (Linux: writing 5 to clear_refs resets VmHWM to the current RSS)."""
    Path("/proc/self/clear_refs").write_text("5")


def memory(arguments: argparse.Namespace, runs: int = 5) -> None:
    """Resident memory of this process (client and in-process worker) while every request saves
    every layer's output, run after run: each run's peak must stay bounded by one `generate`'s
    saves, and what remains after it must not grow with what earlier runs saved (the worker
    frees each request's saves when they are collected)."""
    ours = LLM(arguments.model, dtype="float32", seed=0)
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    program = [ops.Save("layers.*.layer_output")]
    gc.collect()
    print(f"start: resident {_status_gib('VmRSS'):.2f} GiB after start-up (model, KV cache, "
          f"start-up peak {_status_gib('VmHWM'):.2f} GiB); then {arguments.requests_memory} "
          "requests x 256 prompt tokens per run, every layer's layer_output saved")
    for run in range(1, runs + 1):
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(
            0, ours.vocab_size, (256,), generator=generator).tolist())
            for _ in range(arguments.requests_memory)]
        before = _status_gib("VmRSS")
        _reset_peak()
        outputs = ours.generate(prompts, params, interventions=program, use_tqdm=False)
        saved = sum(value.numel() * value.element_size()
                    for output in outputs for value in output.saved.values()) / 2**30
        peak = _status_gib("VmHWM")
        del outputs
        gc.collect()
        print(f"run {run}: saved {saved:.2f} GiB; resident before {before:.2f} GiB, peak "
              f"during the run +{peak - before:.2f} GiB, after freeing the outputs "
              f"{_status_gib('VmRSS'):.2f} GiB", flush=True)


def memory_section(arguments: argparse.Namespace) -> str:
    """The memory measurement, run in a fresh process (a process's peak resident memory only
    ever grows, so it cannot share one with the throughput runs)."""
    command = [sys.executable, __file__, "--memory", "--requests-memory",
               str(arguments.requests_memory)]
    if arguments.model:
        command += ["--model", arguments.model]
    print("measuring memory in a fresh process ...", flush=True)
    lines = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    lines = [line for line in lines.splitlines() if line.startswith(("run ", "start"))]
    return "\n".join([
        "", "## Memory while saving every layer", "",
        f"A fresh process (`--memory`) sends {arguments.requests_memory} requests x 256 prompt "
        "tokens, each saving every layer's `layer_output`, five times in a row. Each run's peak "
        "resident memory (client and in-process worker, Linux `VmHWM` reset before the run) must "
        "stay bounded by one `generate`'s saves, and what stays resident must not grow with "
        "what earlier runs saved:", "", "```",
        *lines, "```", ""])


def render(arguments: argparse.Namespace, arms: list[str], measured: dict[int, Measured],
           model_dir: str) -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        f"{platform.machine()}, {os.cpu_count()} cores"
    model = f"random {arguments.shape}" if arguments.shape else Path(model_dir).name
    lines = [
        "# Cost of interpretability against the bare engine",
        "",
        f"Written by `benchmarks/vllm_runner_bench.py` on {datetime.date.today()} ({device}, "
        f"torch {torch.__version__}, vLLM {vllm.__version__}); model `{model}`, "
        f"{arguments.dtype}, in-process engines, ours and the bare one eager. Prompts of "
        f"32-256 random tokens, {arguments.max_tokens} generated tokens each; at concurrency "
        f"c each run sends max(c, {arguments.min_requests}) requests in waves of c. "
        f"{min(len(r.bare_seconds) // len(arms) for r in measured.values())} repeats; "
        "each arm is paired with a bare-engine run on the same "
        "fresh prompts, order alternating; the ratio of a pair is bare time / arm time "
        "(1.0 = free). Medians, min-max over repeats.",
        "",
    ]
    top = max(measured)
    for width, result in measured.items():
        bare = statistics.median(result.bare_seconds)
        lines += [
            f"## Concurrency {width}", "",
            f"Bare engine: median {bare:.2f} s per run ({result.generated / bare:.0f} "
            "generated tokens/s).", "",
            "| arm | what | median s | ratio vs bare (median) | min-max | target |",
            "|---|---|---|---|---|---|",
        ]
        for arm in arms:
            ratios = result.ratios[arm]
            median = statistics.median(ratios)
            target = TARGETS.get(arm) if width == top else None
            verdict = "" if target is None else (
                f"{'met' if median >= target else 'NOT met'} (≥ {target})")
            lines.append(f"| {arm} | {NAMES[arm]} | {statistics.median(result.seconds[arm]):.2f}"
                         f" | {median:.3f} | {min(ratios):.3f}-{max(ratios):.3f} | {verdict} |")
        if "hf" in arms and "b" in arms:
            speedup = (statistics.median(result.seconds["hf"])
                       / statistics.median(result.seconds["b"]))
            engine = statistics.median(result.seconds["hf"]) / bare
            lines += ["", f"Arm (b) is {speedup:.1f}x as fast as transformers capturing the "
                      f"same layer (target ≥ 5x at the highest concurrency); the bare engine "
                      f"alone is {engine:.1f}x as fast as transformers here, what a free arm "
                      "would reach."]
        if "a" in arms:
            lines += ["", "Arm (a) runs none of the per-step work of the others (a dictionary "
                      "lookup per request); its spread, "
                      f"{min(result.ratios['a']):.3f}-{max(result.ratios['a']):.3f}, is the "
                      "run-to-run noise of this machine."]
        if "graphs" in arms:
            default = statistics.median(result.seconds["graphs"])
            lines += ["", f"vLLM's default engine is {bare / default:.2f}x as fast as the eager "
                      "bare engine; against it, arm (a) runs at "
                      f"{default / statistics.median(result.seconds.get('a', [bare])):.2f} "
                      "and arm (b) at "
                      f"{default / statistics.median(result.seconds.get('b', [bare])):.2f} "
                      "of its throughput."]
        lines.append("")
    lines += [f"![ratios]({Path(arguments.plot).relative_to(Path(arguments.results).parent)})"
              if Path(arguments.plot).is_relative_to(Path(arguments.results).parent)
              else "", ""]
    return "\n".join(lines)


def plot(arms: list[str], measured: dict[int, Measured], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(9, 4))
    width = 0.8 / len(measured)
    for level, (concurrency, result) in enumerate(measured.items()):
        medians = [statistics.median(result.ratios[arm]) for arm in arms]
        low = [m - min(result.ratios[arm]) for m, arm in zip(medians, arms, strict=True)]
        high = [max(result.ratios[arm]) - m for m, arm in zip(medians, arms, strict=True)]
        axes.bar([i + (level - (len(measured) - 1) / 2) * width for i in range(len(arms))],
                 medians, width, yerr=[low, high], capsize=3,
                 label=f"concurrency {concurrency}")
    for index, arm in enumerate(arms):
        if arm in TARGETS:
            axes.hlines(TARGETS[arm], index - 0.4, index + 0.4, colors="#c44e52")
    axes.set_xticks(range(len(arms)), arms)
    axes.axhline(1.0, color="gray", linewidth=0.8)
    axes.set_ylabel("throughput / bare engine")
    axes.set_title("Each arm against the bare engine (red: target at the highest concurrency)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


if __name__ == "__main__":
    main()
