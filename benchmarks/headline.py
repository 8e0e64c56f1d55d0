"""Headline numbers: what interpretability costs at the shapes people run, against vLLM's
default engine (docs/benchmarks.md's top table).

On a lent GPU, one shape a call: `benchmarks/gpu/check.sh headline llama-3.1-8b` (then
`qwen3-30b-a3b-12l`) measures and writes `$OUT/headline/<shape>.json`; here,
`python benchmarks/headline.py --render DIR` puts every result in DIR into the table
between the markers of docs/benchmarks.md and draws docs/benchmarks/headline.png.

The workload is the one the peers publish at: 256 requests of 512 random tokens, 128 generated
each (`ignore_eos`), all in flight, new prompts for every run (no engine has them in its prefix
cache), the model's shape in bfloat16 with vLLM's dummy weights (speed depends on shapes, not
trained values). vLLM's default engine (`vllm.LLM(model)`: compiled, CUDA graphs) and ours run
side by side, each in a process of its own with a share of the GPU, and run the same prompts
back to back, in alternating order; the ratio of a pair is the default engine's seconds over
ours (1.0 = free). After the arms, ours gives its share back and a second default engine (the
*twin*, an A/A control) runs the same pairs: the method's own noise.

Ours is what our guide tells a user to start for this work: `LLM(model, enforce_eager=False,
taps=["layers.*.layer_output"], graph_taps=[the middle layer's], saes={...})` — every layer's
residual tapped (for the probe), the layer a user steers and saves a graph tap, one SAE there.
Each arm is what a user writes (`benchmarks/compiled_bench.py`'s `programs`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

#: The shapes of the table, with the name a reader knows them by.
SHAPES = {
    "llama-3.1-8b": "Llama-3.1-8B",
    "qwen3-30b-a3b-12l": "Qwen3-30B-A3B, 12 of its 48 layers (MoE)",
}
#: The shape the targets are set for (the issue's); the other shapes' ratios are not judged.
TARGET_SHAPE = "llama-3.1-8b"


@dataclass(frozen=True)
class Arm:
    """One row of the table: what every request does, `compiled_bench.programs`' name for it,
    and the issue's target (ratio to vLLM's default engine; None: none set)."""

    what: str
    program: str
    target: float | None = None


ARMS = {
    "none": Arm("no programs", "a", 0.98),
    "steer": Arm("steered at one layer (`Add`)", "d", 0.97),
    "probe": Arm("saves every layer's residual at its last prompt token", "probe", 0.95),
    "save10": Arm("one request in ten saves one layer's residual", "e", 0.97),
    "extract": Arm("saves one layer's residual at every position", "b", 0.85),
    "call": Arm("a `Call` (a Python function of the user's) at one layer", "call", 0.8),
    "call_rowwise": Arm("the same `Call` with `rowwise=True`", "callrows"),
    "sae_features": Arm("reads an SAE's top-64 `Features` (65,536 wide, bf16)", "sf", 0.90),
    "sae_steer": Arm("steered by one SAE feature (`SteerFeatures`)", "ss", 0.97),
    "sae_clamp": Arm("clamps one SAE feature (`ClampFeatures`)", "sc", 0.90),
}
TWIN = "twin"
TWIN_WHAT = "vLLM's default engine against itself (A/A control)"
#: Arms whose runs save on every request: their bytes a run and GB/s to the host are reported.
SAVING = ("extract",)
SAE_WIDTH = 65536

#: The peers' own published figures, for the arms they can run (not measured by us).
PEERS = [
    ("interp-engine 1.14.2", "vLLM 0.28, B200 / H100; Qwen3-4B, Llama-3.1-8B",
     "its static taps (`vllm-static`) against plain graph vLLM, 8 streams: 0.87 at "
     "Llama-3.1-8B (1,520 vs 1,751 tok/s), 0.90 at Qwen3-4B; one stream: 0.94 and 0.88; its "
     "hooked default 4-11x slower", "its PERFORMANCE.md (1.3.4) and README (1.14.2)"),
    ("EasySteer", "vLLM 0.26 fork; R1-Distill-Qwen-1.5B, 256 requests, 128 tokens",
     "every layer steered in the graph: 0.76 (25.3k vs 33.2k tok/s)", "README"),
    ("nnsight 0.8.1 (vLLM backend)", "8B on one GPU",
     "declared taps: 0.96 of vanilla vLLM", "its docs"),
    ("vllm-lens 1.3.0", "Llama-3.3-70B TP4, eager",
     "one layer captured: +12% wall against *eager* vLLM (eager alone is 2.5-3.5x slower "
     "than vLLM's default)", "its notebook"),
    ("DMI", "Qwen3-4B, A100", "0.4-6.8% overhead offline, ~6% online", "arXiv 2605.11093"),
]


@dataclass
class ArmResult:
    """What the repeats of one arm measured: each pair's ratio and both sides' seconds, the
    seconds ours spent collecting saves after the last step, and the bytes saved a run."""

    ratios: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    default_seconds: list[float] = field(default_factory=list)
    collecting: list[float] = field(default_factory=list)
    saved_bytes: list[int] = field(default_factory=list)


def host_copy_limit() -> float:
    """GB/s of a 1 GiB copy from the GPU into pinned host memory: the ceiling of any save that
    reaches the host (measured in a process of its own, so this one holds no CUDA context)."""
    import torch

    size = 1 << 30
    source = torch.empty(size, dtype=torch.uint8, device="cuda")
    target = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    target.copy_(source)
    torch.cuda.synchronize()
    took = []
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        took.append(time.perf_counter() - started)
    return size / min(took) / 1e9


def in_a_process(function: Callable[[], Any]) -> Any:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function).result()


def measure(arguments: argparse.Namespace) -> None:
    """The arms and the twin at one shape, the result file written after every pair (a call
    cut short keeps what it measured)."""
    import torch
    import vllm
    from compiled_bench import SAE_ARMS, Engine, RunResult, exit_on_sigterm, stopped_on_failure
    from pairs import timed_pair
    from random_models import random_checkpoint, random_sae_folder

    arms = arguments.arms.split(",")
    on_gpu = torch.cuda.is_available()
    model = random_checkpoint(arguments.shape, tempfile.mkdtemp(), torch.bfloat16,
                              weights=False)
    config = json.loads((Path(model) / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    middle = layers // 2
    taps = (["layers.*.layer_output"], [f"layers.{middle}.layer_output"])
    saes = {"middle": random_sae_folder(hidden, SAE_WIDTH, middle, torch.bfloat16)} \
        if any(ARMS[arm].program in SAE_ARMS for arm in arms) else {}
    settings: dict[str, Any] = {"dtype": "bfloat16", "seed": 0, "load_format": "dummy",
                                "skip_tokenizer_init": True}
    if on_gpu:
        settings["gpu_memory_utilization"] = arguments.gpu_memory_utilization
    else:
        settings["kv_cache_memory_bytes"] = 1 << 30
    out = Path(arguments.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "shape": arguments.shape, "name": SHAPES.get(arguments.shape, arguments.shape),
        "commit": arguments.commit, "date": str(datetime.date.today()),
        "device": torch.cuda.get_device_name() if on_gpu else "CPU",
        "vllm": vllm.__version__, "torch": torch.__version__,
        "workload": {"requests": arguments.requests, "prompt_tokens": arguments.prompt_tokens,
                     "max_tokens": arguments.max_tokens, "in_flight": arguments.requests,
                     "gpu_memory_utilization": arguments.gpu_memory_utilization,
                     "repeats": arguments.repeats, "sae_width": SAE_WIDTH},
        "host_copy_gbps": in_a_process(host_copy_limit) if on_gpu else None,
        "arms": {},
    }
    results = {arm: ArmResult() for arm in [*arms, *([TWIN] if arguments.twin else [])]}
    generator = torch.Generator().manual_seed(0)

    def fresh_prompts() -> list[list[int]]:
        return torch.randint(0, config["vocab_size"], (arguments.requests,
                             arguments.prompt_tokens), generator=generator).tolist()

    def publish() -> None:
        result["arms"] = {arm: asdict(found) for arm, found in results.items() if found.ratios}
        out.write_text(json.dumps(result, indent=1))

    def pairs(engines: dict[str, Engine], arm: str, engine: str, program: str) -> None:
        for repeat in range(arguments.repeats):
            prompts = fresh_prompts()
            runs: dict[str, RunResult] = {}
            base, took = timed_pair(
                repeat, partial(run_side, engines, "default", "a", prompts, runs),
                partial(run_side, engines, engine, program, prompts, runs))
            found = results[arm]
            found.ratios.append(base / took)
            found.seconds.append(took)
            found.default_seconds.append(base)
            found.collecting.append(runs[engine].collecting)
            found.saved_bytes.append(runs[engine].saved_bytes)
            print(f"{arm:>13} {repeat + 1}/{arguments.repeats}: default {base:6.2f} s, "
                  f"ours {took:6.2f} s, ratio {base / took:.3f}", flush=True)
            publish()

    def run_side(engines: dict[str, Engine], name: str, program: str, prompts: list[list[int]],
                 runs: dict[str, RunResult]) -> float:
        runs[name] = engines[name].run(program, prompts, arguments.requests,
                                       arguments.max_tokens)
        return runs[name].seconds

    exit_on_sigterm()
    engines: dict[str, Engine] = {}
    with stopped_on_failure(engines):
        engines["default"] = Engine("default", model, settings)
        engines["ours"] = Engine("ours", model, settings, taps, saes)
        warm = fresh_prompts()
        for engine in engines.values():
            engine.run("a", warm, arguments.requests, arguments.max_tokens)
        # Repeat-major would mix the arms' order; arm-major keeps each arm's pairs together
        # and the result file complete for every arm it names.
        for arm in arms:
            pairs(engines, arm, "ours", ARMS[arm].program)
        result["forwards"] = engines.pop("ours").close()
        if arguments.twin:
            engines["twin"] = Engine("default twin", model, settings)
            engines["twin"].run("a", warm, arguments.requests, arguments.max_tokens)
            pairs(engines, TWIN, "twin", "a")
        for engine in list(engines.values()):
            engine.close()
    publish()
    print(f"wrote {out}")


def ratio_cell(found: dict[str, Any]) -> str:
    ratios = found["ratios"]
    return f"**{statistics.median(ratios):.2f}** ({min(ratios):.2f}-{max(ratios):.2f})"


def verdict(arm: str, found: dict[str, Any] | None) -> str:
    target = ARMS[arm].target if arm in ARMS else None
    if target is None or found is None:
        return ""
    return "met" if statistics.median(found["ratios"]) >= target else "**not met**"


def merged(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results by shape, in `SHAPES`' order: the arms of every run of a shape together (a
    shape's arms may take more than one GPU call), with each run's machine and commit."""
    shapes: dict[str, dict[str, Any]] = {}
    for found in results:
        shape = shapes.setdefault(found["shape"], {**found, "arms": {}, "runs": []})
        shape["arms"].update(found["arms"])
        shape["runs"].append(found)
    order = list(SHAPES)
    return sorted(shapes.values(), key=lambda shape: order.index(shape["shape"])
                  if shape["shape"] in order else len(order))


def render(results: list[dict[str, Any]]) -> str:
    """The headline table (Markdown) of the results: a column per shape, and beside the target
    shape's whether each arm meets its target; then where and how each shape's runs ran."""
    shapes = merged(results)
    arms = [arm for arm in [*ARMS, TWIN] if any(arm in shape["arms"] for shape in shapes)]
    lines = ["| arm | what every request does | target | " + " | ".join(
                 f"{shape['name']} | met" if shape["shape"] == TARGET_SHAPE else shape["name"]
                 for shape in shapes) + " |",
             "|---|---|---|" + "".join("---|---|" if shape["shape"] == TARGET_SHAPE else "---|"
                                       for shape in shapes)]
    for arm in arms:
        what = TWIN_WHAT if arm == TWIN else ARMS[arm].what
        target = "" if arm == TWIN or ARMS[arm].target is None else f"≥ {ARMS[arm].target}"
        cells = []
        for shape in shapes:
            found = shape["arms"].get(arm)
            cells.append(ratio_cell(found) if found else "—")
            if shape["shape"] == TARGET_SHAPE:
                cells.append(verdict(arm, found))
        lines.append(f"| {arm} | {what} | {target} | " + " | ".join(cells) + " |")
    lines += ["", f"Ratio: the median over the repeats (min-max). The targets are set for the "
              f"{SHAPES[TARGET_SHAPE]} shape. Where and how each ran:", ""]
    for shape in shapes:
        lines.append(f"- **{shape['name']}**:")
        for run in shape["runs"]:
            lines.append(f"  - {run_line(run)}")
    return "\n".join(lines) + "\n"


def run_line(run: dict[str, Any]) -> str:
    """One GPU run of a shape: its machine, releases and commit, the default engine's speed,
    and for the saving arms their bytes against the host-copy ceiling."""
    workload = run["workload"]
    default = statistics.median(
        second for arm in run["arms"].values() for second in arm["default_seconds"])
    tokens = workload["requests"] * (workload["prompt_tokens"] + workload["max_tokens"])
    line = (f"{', '.join(run['arms'])}: {run['device']}, vLLM {run['vllm']}, torch "
            f"{run['torch']}, commit {run['commit']}, {run['date']}; {workload['repeats']} "
            f"repeats; vLLM's default engine {default:.2f} s a run ({tokens / default:,.0f} "
            "tokens/s, prompt and generated)")
    for arm in SAVING:
        if arm in run["arms"]:
            saved = statistics.median(run["arms"][arm]["saved_bytes"])
            seconds = statistics.median(run["arms"][arm]["seconds"])
            collecting = statistics.median(run["arms"][arm]["collecting"])
            line += (f"; {arm} saves {saved / 1e9:.2f} GB a run: {saved / seconds / 1e9:.2f} "
                     f"GB/s over its run, {collecting:.2f} s of the run collecting after the last "
                     "step")
    if run.get("host_copy_gbps"):
        line += f"; one GPU-to-pinned-host copy: {run['host_copy_gbps']:.1f} GB/s"
    return line + "."


def render_peers() -> str:
    lines = ["| peer | where they measured | their figure | source |", "|---|---|---|---|"]
    lines += [f"| {peer} | {where} | {figure} | {source} |"
              for peer, where, figure, source in PEERS]
    return "\n".join(lines) + "\n"


START = "<!-- headline table: benchmarks/headline.py --render -->"
END = "<!-- end of headline table -->"


def write_table(results_folder: Path, page: Path) -> None:
    """Put the table of every result in `results_folder` between the markers of `page`, and
    its plot beside the page's benchmark folder."""
    results = [json.loads(path.read_text()) for path in sorted(results_folder.glob("*.json"))]
    if not results:
        raise SystemExit(f"no results (*.json) in {results_folder}")
    text = page.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{page} has no headline markers ({START} ... {END})")
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    page.write_text(f"{head}{START}\n{render(results)}\nTheir own figures, for the arms they "
                    f"can run (not measured by us):\n\n{render_peers()}{END}{tail}")
    plot(results, page.parent / "benchmarks" / "headline.png")
    print(f"wrote the table of {len(results)} shapes into {page}")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = merged(results)
    arms = [arm for arm in [*ARMS, TWIN] if any(arm in found["arms"] for found in results)]
    figure, axes = plt.subplots(figsize=(10, 2.2 + 0.5 * len(arms)))
    height = 0.8 / len(results)
    for index, found in enumerate(results):
        rows = [(position, found["arms"][arm]["ratios"]) for position, arm in enumerate(arms)
                if arm in found["arms"]]
        medians = [statistics.median(ratios) for _, ratios in rows]
        below = [median - min(ratios) for median, (_, ratios) in zip(medians, rows, strict=True)]
        above = [max(ratios) - median for median, (_, ratios) in zip(medians, rows, strict=True)]
        axes.barh([position + index * height for position, _ in rows], medians, height=height,
                  xerr=[below, above], label=f"{found['name']} ({found['device']})")
    for position, arm in enumerate(arms):
        target = ARMS[arm].target if arm in ARMS else None
        if target is not None:
            axes.plot([target, target], [position - 0.1, position + 0.8], color="black",
                      linewidth=1.5)
    axes.set_yticks([position + 0.4 - height / 2 for position in range(len(arms))], arms)
    axes.axvline(1.0, color="grey", linewidth=0.8)
    lowest = min(min(arm["ratios"]) for found in results for arm in found["arms"].values())
    axes.set_xlim(min(0.5, lowest - 0.05), 1.1)
    axes.invert_yaxis()
    axes.set_xlabel("throughput ratio to vLLM's default engine (1.0 = free; bars: min-max; "
                    "black ticks: targets)")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def commit_here() -> str:
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, check=False)
    return found.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(set(SHAPES) | {"tiny", "tiny-moe"}),
                        default="llama-3.1-8b", help="tiny, tiny-moe: a quick run on a CPU")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--no-twin", dest="twin", action="store_false",
                        help="leave out the A/A control (a second default engine)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=256, help="all in flight")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.42,
                        help="each engine's share: two side by side on one GPU")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's)")
    parser.add_argument("--out", default=None, help="default: headline-<shape>.json here")
    parser.add_argument("--render", metavar="RESULTS", default=None,
                        help="measure nothing: put the results (*.json) in RESULTS into "
                             "docs/benchmarks.md's headline table")
    arguments = parser.parse_args()
    if arguments.render:
        write_table(Path(arguments.render), ROOT / "docs" / "benchmarks.md")
        return
    if unknown := [arm for arm in arguments.arms.split(",") if arm not in ARMS]:
        raise SystemExit(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    arguments.commit = arguments.commit or commit_here()
    arguments.out = arguments.out or f"headline-{arguments.shape}.json"
    measure(arguments)


if __name__ == "__main__":
    main()
