"""What interpretability costs on a compiled engine: each arm against vLLM's *default* engine.

Run with `python benchmarks/compiled_bench.py` in an environment holding the stack (the
`bench(package='vllm-runner')` session's), e.g. `--shape smollm2-135m --concurrency 64`.
It writes docs/benchmarks/compiled-<device>.md and a plot beside it (issue [K]).

Method. The engine a user would otherwise run is vLLM's default (`vllm.LLM(model)`: on the CPU
Dynamo and inductor, on a GPU also CUDA graphs); it runs in a process of its own, because our
`LLM` may set engine variables that a later engine of the same process would keep. So does the
eager bare engine (`enforce_eager=True`, the column every earlier benchmark compared against),
and so does ours (`LLM(enforce_eager=False, taps=..., graph_taps=...)`: every layer's output
tapped, the middle layer's served in the graph, so `Add` and `Save` there run with no Python in
the forward; tier 3). Each process
holds one in-process engine and runs the workloads the coordinator sends it; the coordinator
times nothing itself: each child reports how long its `generate` calls took. For each repeat
and arm, the default engine and the arm run the same fresh prompts back to back (the default
engine first in even repeats, second in odd ones); the ratio of a pair is default time / arm time
(1.0 = free). Medians and min-max over repeats.

Arms (the issue's): (a) no programs; (e) 10% of requests save one layer's `layer_output` (a tap);
(b) every request saves it; (d) every request steered at one layer (a tap); (ablate) every
request ablates one direction there (`ProjectOut`, in the graph too); (c) every request
saves every layer's `layer_output` (taps); (cg) the same on an engine of ours whose graph taps
are every layer's (tier 3 at every layer; its own process, started only for this arm); (call)
a `Call` at one layer on every request (a tap, the Python function run between compiled
pieces); (callrows) the same with `rowwise=True`, one call a step for every request; (call1)
the same as (call) on one request of each wave, so every step with it leaves the full
graph for the piecewise graphs with almost no Python: what the pieces themselves cost;
(untapped) every request saves one layer's `attention_output`, which no tap serves
(tier 1: those steps run eager); (probe) every request saves every layer's `layer_output` at
its prompt's last token, the usual probe: the taps' Python at the prompts' steps, the
generated tokens' steps as if no request had a program; (eager) the eager bare engine, no
programs; (twin) vLLM's default engine once more, in a process of its own: an A/A control,
whose ratio would be 1.0 with a method free of bias (a ratio of ours inside the twin's spread
is no cost we can show); (bare) our `LLM` with no taps declared and no programs: against (a),
what declaring taps costs steps without programs (the taps split the piecewise graphs that
prefill and mixed steps run); (taps) our `LLM` with every layer tapped but no graph tap, no
programs: between (bare) and (a), what the graph tap's in-graph work costs every step;
(nobreaks) our `LLM` as for (a) with `VLLM_INTERP_BREAK_AT_TAPS=0` (no full graphs captured
again, broken at the taps), no programs: what those captures cost every step.

The SAE arms (`--arms sf,ss,sc,sf32`, issue [P]) load random JumpReLU SAEs of `--sae-width`
features at the middle layer's output (the graph tap) into ours (`LLM(saes=...)`), one in bf16
and one in fp32 (the dtype SAELens saves; an SAE computes in its own): (sf) every request reads
the bf16 SAE's top 64 `Features` per token; (sf32) the same with the fp32 SAE; (ss) every
request steered by one feature (`SteerFeatures`: an `Add`, in the graph); (sc) every request
clamps one feature (`ClampFeatures`).

`--prompt-tokens N` gives every prompt N tokens (the shapes people run: 512), instead of 32-256;
`--dummy-weights` starts every engine with vLLM's `load_format="dummy"` from the shape's config
alone (speed depends on shapes, not trained values; an 8B model then needs no 16 GB on disk).

Each engine's core runs in its engine's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), where the
profilers see it; `--engine-core-apart` runs it as vLLM does by default, in a process of its own, so
saves collected cross processes as users' do (`vllm_runner.saves.wire`). Our engine reports the
seconds of each run spent collecting saves after the last step (the *collecting* column): a cost per
saved byte, apart from the steps' cost. Each engine's process also reports what it used of the host
in each run (`host_use.py`: CPU time of the thread that ran it and of the others, context switches,
threads, peak memory), for telling apart why one process runs the same host work slower than
another.

`--profile PATH` then runs the default engine and each arm once more under cProfile and once
under torch's profiler (kernels by device time, the device's busy share of the wall time): for
telling host work from device work when an arm is slower than another; `--profilers timeline`
instead records Python stacks and says, thread by thread, where the CUDA-graph replay's and the
step's wall time goes (`timeline.py`). With `--repeats 0` only
our engines start, and the arms are profiled, not timed (one engine start instead of two).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import multiprocessing
import os
import platform
import queue
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from host_use import TABLE_HEADER, HostUse, HostUseMeter, median_row  # noqa: E402 (the path)
from pairs import timed_pair  # noqa: E402 (the benchmarks folder is on the path now)
from profiles import PROFILERS  # noqa: E402

NAMES = {
    "a": "our LLM, no programs",
    "e": "10% of requests save one layer's layer_output (graph tap)",
    "b": "every request saves one layer's layer_output (graph tap)",
    "d": "every request steered at one layer (graph tap)",
    "ablate": "every request ablates one direction at one layer (graph tap)",
    "c": "every request saves every layer's layer_output (taps)",
    "cg": "every request saves every layer's layer_output (graph taps at every layer)",
    "call": "a Call at one layer on every request (tap)",
    "callrows": "a rowwise Call at one layer on every request (tap): one call a step",
    "call1": "a Call at one layer on one request of each wave (tap): the pieces' own cost",
    "untapped": "every request saves one layer's attention_output (no tap: eager steps)",
    "probe": "every request saves every layer's layer_output at its prompt's last token (taps)",
    "eager": "vLLM's eager engine (enforce_eager=True), no programs",
    "twin": "vLLM's default engine again, in a process of its own (A/A control)",
    "bare": "our LLM with no taps declared, no programs",
    "taps": "our LLM with every layer tapped but no graph tap, no programs",
    "nobreaks": "our LLM as for (a), without full graphs broken at the taps, no programs",
    "sf": "every request reads an SAE's top-64 Features per token at one layer (bf16 SAE)",
    "sf32": "every request reads an SAE's top-64 Features per token at one layer (fp32 SAE)",
    "ss": "every request steered by one SAE feature at one layer (SteerFeatures)",
    "sc": "every request clamps one SAE feature at one layer (ClampFeatures, bf16 SAE)",
}
#: The SAE arms' SAEs in ours, by name: both read the middle layer's output.
SAE_DTYPES = {"middle": "bfloat16", "middle32": "float32"}
SAE_ARMS = ("sf", "sf32", "ss", "sc")
#: What a run without `--arms` measures: every arm on our one engine (each arm of
#: `OWN_ENGINE` adds an engine start, ~65 s on a GPU, and a call there may run 10 minutes).
DEFAULT_ARMS = ("a", "e", "b", "d", "ablate", "c", "call", "callrows", "call1", "untapped",
                "probe")
# Arms with an engine of their own, by the engine's name: the rest run on `ours` (every layer
# tapped).
OWN_ENGINE = {"cg": "ours every layer", "eager": "eager", "twin": "twin", "bare": "bare",
              "taps": "ours taps only", "nobreaks": "ours no breaks"}
# The targets on a GPU (ratio to the default engine); on the CPU only (a) has one.
GPU_TARGETS = {"a": 0.98, "e": 0.95, "b": 0.93, "d": 0.93, "c": 0.5, "cg": 0.5, "call": 0.6,
               "sf": 0.90, "sc": 0.90, "ss": 0.97}
CPU_TARGETS = {"a": 0.98}
# How often a waiting coordinator looks whether its child still lives, and how long it waits.
POLL_SECONDS = 2.0
ANSWER_LIMIT_SECONDS = 3600.0


def double(value: Any, context: Any) -> Any:
    """The `call` arm's function: an edit any user could write, made in Python."""
    return value * 1.0


def programs(arm: str, requests: int, layers: int, hidden: int) -> list[list[Any]] | None:
    """The interventions of an arm, one list per request (None: none at all)."""
    import torch
    from vllm_runner import ops
    middle = layers // 2
    one = [ops.Save(f"layers.{middle}.layer_output")]
    if arm in ("a", "bare", "taps", "nobreaks"):
        return None
    if arm == "e":
        return [one if i % 10 == 0 else [] for i in range(requests)]
    if arm == "b":
        return [one] * requests
    if arm == "d":
        vector = torch.randn(hidden, generator=torch.Generator().manual_seed(0))
        return [[ops.Add(f"layers.{middle}.layer_output", vector, scale=0.5)]] * requests
    if arm == "ablate":
        direction = torch.randn(hidden, generator=torch.Generator().manual_seed(0))
        return [[ops.ProjectOut(f"layers.{middle}.layer_output", direction)]] * requests
    if arm in ("c", "cg"):
        return [[ops.Save("layers.*.layer_output")]] * requests
    if arm == "call1":
        return [[ops.Call(f"layers.{middle}.layer_output", double)] if i == 0 else []
                for i in range(requests)]
    if arm == "call":
        return [[ops.Call(f"layers.{middle}.layer_output", double)]] * requests
    if arm == "callrows":
        return [[ops.Call(f"layers.{middle}.layer_output", double, rowwise=True)]] * requests
    if arm == "untapped":
        return [[ops.Save(f"layers.{middle}.attention_output")]] * requests
    if arm == "probe":
        return [[ops.Save("layers.*.layer_output", positions=(-1,))]] * requests
    if arm in ("sf", "sf32"):
        return [[ops.Features(sae="middle" if arm == "sf" else "middle32", top_k=64)]] * requests
    if arm == "ss":
        return [[ops.SteerFeatures(sae="middle", features={7: 4.0})]] * requests
    if arm == "sc":
        return [[ops.ClampFeatures(sae="middle", features={7: 0.0})]] * requests
    raise ValueError(f"unknown arm {arm!r}")


def serve_engine(kind: str, model: str, settings: dict[str, Any],
                 taps: tuple[list[str], list[str]], saes: dict[str, str],
                 engine_core_apart: bool, jobs: Any, results: Any) -> None:
    """A child process: one engine (`default`, `eager` or `ours`, with `saes` if any), then one
    timed workload per job `(arm, prompts, width, max_tokens, profiler)`, its seconds sent back
    with the seconds our engine spent collecting saves in them (and, with a profiler of
    `PROFILERS`, its report). The engine core runs in this process unless `engine_core_apart`
    (vLLM's default)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine_core_apart else "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    exit_on_sigterm()  # `Engine.stop`: the `finally` below then shuts an apart core down
    collecting = [0.0]
    if kind == "ours no breaks":
        os.environ["VLLM_INTERP_BREAK_AT_TAPS"] = "0"
    if kind.startswith("ours"):
        from vllm_runner import LLM

        # "ours bare" is what a user who declares no taps runs.
        tapped = {} if kind == "ours bare" else {"taps": taps[0], "graph_taps": taps[1]}
        engine: Any = LLM(model, enforce_eager=False, **tapped, **settings,
                          **({"saes": saes} if saes else {}))
        engine._attach_saves = timed(engine._attach_saves, collecting)
    else:
        import vllm

        engine = vllm.LLM(model, enforce_eager=kind == "eager", **settings)
    config = engine.llm_engine.model_config
    layers = config.get_num_layers(engine.llm_engine.vllm_config.parallel_config)
    results.put(("ready", layers, config.get_hidden_size(), config.get_vocab_size()))
    try:
        while (job := jobs.get()) is not None:
            arm, prompts, width, max_tokens, profiler = job
            failed: list[str] = []
            saved = [0]
            workload = partial(run_workload, engine, kind.startswith("ours"), arm, prompts, width,
                               max_tokens, (layers, config.get_hidden_size()), failed, saved)
            collecting[0] = 0.0
            meter = HostUseMeter()
            report = PROFILERS[profiler](workload) if profiler else workload()
            use = meter.stop()
            if failed:
                results.put(("failed", failed[0]))
                return
            results.put(("took", use.wall, report, collecting[0], use, saved[0]))
        results.put(("forwards", engine.forwards() if kind.startswith("ours") else None))
    finally:
        # An engine core in a process of its own (`--engine-core-apart`) is a child of this one,
        # which joins it on exit: shut it down, or this process never ends.
        engine.llm_engine.engine_core.shutdown()


def timed(collect: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    """`collect` (`LLM._attach_saves`: the collection of a `generate`'s saves, after its last
    step) adding the seconds it takes to `spent[0]`: which share of an arm's time is moving
    saves to the caller, and which the steps (a cost per byte against one per step)."""
    def timed_collect(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return collect(*args)
        finally:
            spent[0] += time.perf_counter() - started
    return timed_collect


def run_workload(engine: Any, ours: bool, arm: str, prompts: list[list[int]], width: int,
                 max_tokens: int, shape: tuple[int, int], failed: list[str],
                 saved: list[int]) -> None:
    """`prompts` through `engine`, `width` at a time, with `arm`'s programs on our engine
    (`shape`: the model's layers and hidden size); the first failed request's error goes to
    `failed` and stops the run; the bytes of the saves that reached the caller are added to
    `saved[0]`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts]
    for first in range(0, len(requests), width):
        wave = requests[first:first + width]
        if not ours:
            engine.generate(wave, params, use_tqdm=False)
            continue
        outputs = engine.generate(wave, params, use_tqdm=False,
                                  interventions=programs(arm, len(wave), *shape))
        failed.extend(output.error for output in outputs if output.error)
        saved[0] += sum(tensor_bytes(output.saved) for output in outputs)
        if failed:
            return


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in `value`: a tensor, or a dict of them by name (a request's
    saves; a `Call`'s saved dict nests one more)."""
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    return int(value.nbytes)


class RunResult(NamedTuple):
    """One timed run in an engine's process: its seconds, of them the seconds our engine spent
    collecting saves, what the process used of the host meanwhile, and the bytes saved."""

    seconds: float
    collecting: float
    host_use: HostUse
    saved_bytes: int


class Engine:
    """A child process holding one engine, and the queues to it."""

    def __init__(self, kind: str, model: str, settings: dict[str, Any],
                 taps: tuple[list[str], list[str]] = ([], []), saes: dict[str, str] | None = None,
                 engine_core_apart: bool = False) -> None:
        context = multiprocessing.get_context("spawn")
        self.kind = kind
        self.jobs, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=serve_engine, name=f"engine-{kind}", args=(
            kind, model, settings, taps, saes or {}, engine_core_apart, self.jobs,
            self.results))
        self.process.start()
        started = time.perf_counter()
        try:
            _, self.layers, self.hidden, self.vocab = self.answer("ready")
        except BaseException:
            self.stop()  # one that did not answer in time still holds its share of the GPU
            raise
        print(f"{kind} engine ready in {time.perf_counter() - started:.0f} s", flush=True)

    def answer(self, expected: str) -> tuple[Any, ...]:
        """The child's next message, which must be `expected`. A child that died (an import
        error, a failed start) fails the benchmark within seconds instead of leaving it waiting
        for a message that will never come (a GPU call lost 570 s that way, 2026-12-02)."""
        waited = 0.0
        while True:
            try:
                found = self.results.get(timeout=POLL_SECONDS)
                break
            except queue.Empty:
                waited += POLL_SECONDS
                if not self.process.is_alive():
                    raise RuntimeError(
                        f"the {self.kind} engine's process ended (exit code "
                        f"{self.process.exitcode}) before answering {expected!r}; its "
                        "traceback is above") from None
                if waited >= ANSWER_LIMIT_SECONDS:
                    raise TimeoutError(f"the {self.kind} engine did not answer {expected!r} "
                                       f"in {ANSWER_LIMIT_SECONDS} s") from None
        if found[0] != expected:
            raise RuntimeError(f"the {self.kind} engine answered {found!r}")
        return tuple(found)

    def run(self, arm: str, prompts: list[list[int]], width: int, max_tokens: int
            ) -> RunResult:
        """One timed run of `arm` on `prompts`, `width` in flight."""
        self.jobs.put((arm, prompts, width, max_tokens, None))
        _, took, _, collecting, use, saved = self.answer("took")
        return RunResult(float(took), float(collecting), use, int(saved))

    def profile(self, arm: str, prompts: list[list[int]], width: int, max_tokens: int,
                profiler: str) -> str:
        """One untimed run of `arm` under a profiler of `PROFILERS`: its report."""
        self.jobs.put((arm, prompts, width, max_tokens, profiler))
        return str(self.answer("took")[2])

    def close(self) -> Any:
        self.jobs.put(None)
        forwards = self.answer("forwards")[1]
        self.process.join(timeout=120)
        return forwards

    def stop(self) -> None:
        """End the child (after a failure elsewhere): a child left waiting for jobs keeps this
        process from exiting (multiprocessing joins its children at exit) and its GPU memory
        from the next call (a GPU call hung that way until its limit, 2026-12-06). SIGTERM
        first, so that it shuts down an engine core of its own (`--engine-core-apart`), which
        a kill would leave running; a kill if it has not ended in 30 s."""
        self.jobs.cancel_join_thread()  # a job it will never read must not block our exit
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=30)


@contextlib.contextmanager
def stopped_on_failure(engines: dict[str, Engine]) -> Iterator[None]:
    """Within the block, an exception (an engine that failed to start or to run, a Ctrl-C)
    stops every engine in `engines` before it propagates, so the benchmark ends with its
    error instead of waiting on children that will never be asked for anything."""
    try:
        yield
    except BaseException:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut this short
        for engine in engines.values():
            engine.stop()
        raise


def exit_on_sigterm() -> None:
    """Make SIGTERM (`kill`, `timeout`, `Engine.stop`) raise `SystemExit` in this process, so
    that its cleanup runs (`stopped_on_failure`, `serve_engine`'s `finally`), where Python's
    default would end it on the spot."""
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))


def planned_engines(arms: list[str], profile_only: bool, taps: tuple[list[str], list[str]]
                    ) -> list[tuple[str, str, tuple[list[str], list[str]]]]:
    """The engines the arms need, in the order they start: (name in `OWN_ENGINE` or
    "default"/"ours", kind for `serve_engine`, taps). With `--repeats 0` only the arms' own."""
    no_taps: tuple[list[str], list[str]] = ([], [])
    planned = [] if profile_only else [("default", "default", no_taps)]
    if set(arms) - OWN_ENGINE.keys():
        planned.append(("ours", "ours", taps))
    own = {  # each arm of OWN_ENGINE: the kind its engine is and the taps it declares
        "cg": ("ours every layer", (taps[0], taps[0])),  # every layer a graph tap
        "eager": ("eager", no_taps),
        "twin": ("default twin", no_taps),  # the method's own bias: another process
        "bare": ("ours bare", no_taps),  # what declaring taps costs steps without programs
        "taps": ("ours taps only", (taps[0], [])),  # what the graph tap costs every step
        "nobreaks": ("ours no breaks", taps),  # what the broken captures cost every step
    }
    planned += [(OWN_ENGINE[arm], *own[arm]) for arm in own if arm in arms]
    return planned


#: The share of one GPU the engines' shares may add up to: each engine's CUDA context takes
#: memory besides its share (~1 GiB on an H100).
ENGINES_SHARE = 0.9


def check_gpu_memory(planned: list[tuple[str, str, Any]], utilization: float) -> None:
    """Refuse, before any engine starts, arms whose engines cannot all hold their share of one
    GPU at once: each takes `utilization` of it and its CUDA context besides (four engines at
    0.2 took 67 of 79 GiB of an H100, and a fifth could not start)."""
    if len(planned) * utilization <= ENGINES_SHARE:
        return
    names = ", ".join(name for name, _, _ in planned)
    raise SystemExit(
        f"{len(planned)} engines ({names}) at --gpu-memory-utilization {utilization} would "
        f"take {len(planned) * utilization:.0%} of the GPU before their CUDA contexts: give "
        f"fewer arms of their own engine, or --gpu-memory-utilization "
        f"{ENGINES_SHARE / len(planned):.2f}")


def main() -> None:
    import torch
    from random_models import add_model_arguments, random_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="every prompt this many tokens (default: 32-256, drawn per prompt)")
    parser.add_argument("--dummy-weights", action="store_true",
                        help="with --shape: write its config alone and start every engine with "
                             "vLLM's load_format='dummy'")
    parser.add_argument("--sae-width", type=int, default=16384,
                        help="features of the SAE arms' random SAEs (default: 16384)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed pairs per arm; 0 with --profile: only profile the arms")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma-separated, of {', '.join(NAMES)} (default: the issue's "
                             "arms and the calls; each arm of OWN_ENGINE starts one more engine)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--engine-core-apart", action="store_true",
                        help="every engine's core in a process of its own, as vLLM runs it by "
                             "default (saves then cross processes); by default it runs in the "
                             "engine's process, where the profilers see it")
    parser.add_argument("--out", default=None, help="default: docs/benchmarks/compiled-<device>.md")
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="after the timed repeats, run the default engine and each arm once "
                             "under cProfile and once under torch's profiler; reports to PATH")
    parser.add_argument("--profilers", default="python,device",
                        help=f"which of {', '.join(PROFILERS)} `--profile` runs ('timeline': "
                             "each thread's time in and around the CUDA-graph replay)")
    arguments = parser.parse_args()
    arms = arguments.arms.split(",")
    if unknown_profilers := set(arguments.profilers.split(",")) - PROFILERS.keys():
        raise SystemExit(f"unknown profilers {sorted(unknown_profilers)}; known: "
                         f"{', '.join(PROFILERS)}")
    profile_only = arguments.repeats == 0
    if profile_only and not arguments.profile:
        raise SystemExit("--repeats 0 times nothing: give --profile PATH to profile the arms")
    if unknown := [arm for arm in arms if arm not in NAMES]:
        raise SystemExit(f"unknown arms {unknown}; known: {', '.join(NAMES)}")

    on_gpu = torch.cuda.is_available()
    settings: dict[str, Any] = {"dtype": arguments.dtype, "seed": 0}
    if on_gpu:
        settings["gpu_memory_utilization"] = arguments.gpu_memory_utilization
    else:
        settings["kv_cache_memory_bytes"] = 1 << 30
    model = arguments.model
    if arguments.dummy_weights and not arguments.shape:
        raise SystemExit("--dummy-weights takes a --shape (a model's own weights are loaded)")
    if arguments.shape:
        model = random_checkpoint(arguments.shape, tempfile.mkdtemp(),
                                  getattr(torch, arguments.dtype), "cuda" if on_gpu else "cpu",
                                  weights=not arguments.dummy_weights)
        settings["skip_tokenizer_init"] = True
        if arguments.dummy_weights:
            settings["load_format"] = "dummy"
    if model is None:
        from vllm_runner.client.embedded import default_model

        model = default_model()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    middle = config.num_hidden_layers // 2
    taps = (["layers.*.layer_output"], [f"layers.{middle}.layer_output"])
    saes = {}
    if set(arms) & set(SAE_ARMS):
        from random_models import random_sae_folder

        saes = {name: random_sae_folder(config.hidden_size, arguments.sae_width, middle,
                                        getattr(torch, dtype))
                for name, dtype in SAE_DTYPES.items()}
    planned = planned_engines(arms, profile_only, taps)
    if on_gpu:
        check_gpu_memory(planned, arguments.gpu_memory_utilization)
    engines: dict[str, Engine] = {}
    # A SIGTERM to this process alone (a `kill`; `timeout` signals the whole group) stops
    # its engines too, through `stopped_on_failure`.
    exit_on_sigterm()
    with stopped_on_failure(engines):
        # One engine at a time starts (start-up compiles, and would compete for the cores).
        for name, kind, engine_taps in planned:
            engines[name] = Engine(kind, model, settings, engine_taps,
                                   saes if kind == "ours" else None,
                                   arguments.engine_core_apart)
        measure(arguments, arms, engines, config, model, on_gpu, profile_only)


def measure(arguments: argparse.Namespace, arms: list[str], engines: dict[str, Engine],
            config: Any, model: str, on_gpu: bool, profile_only: bool) -> None:
    """The timed pairs of every arm against the default engine (a report after each repeat),
    the profiles asked for, and the final report with our engine's forwards by path."""
    import torch

    generator = torch.Generator().manual_seed(0)

    def fresh_prompts() -> list[list[int]]:
        # New prompts for every pair: no engine has them in its prefix cache.
        lengths = [arguments.prompt_tokens] * arguments.requests if arguments.prompt_tokens \
            else torch.randint(32, 257, (arguments.requests,), generator=generator).tolist()
        return [torch.randint(0, config.vocab_size, (int(length),), generator=generator).tolist()
                for length in lengths]

    def arm_engine_of(arm: str) -> Engine:
        return engines[OWN_ENGINE.get(arm, "ours")]

    def run_arm(arm: str, prompts: list[list[int]]) -> float:
        took, collecting, use, _ = arm_engine_of(arm).run(arm, prompts, arguments.concurrency,
                                                          arguments.max_tokens)
        collection[arm].append(collecting)
        host_use[arm].append(use)
        return took

    def run_default(arm: str, prompts: list[list[int]]) -> float:
        took, _, use, _ = engines["default"].run("a", prompts, arguments.concurrency,
                                                 arguments.max_tokens)
        default_host_use[arm].append(use)
        return took

    warm = fresh_prompts()
    for engine in engines.values():
        engine.run("a", warm, arguments.concurrency, arguments.max_tokens)
    ratios: dict[str, list[float]] = {arm: [] for arm in arms}
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    collection: dict[str, list[float]] = {arm: [] for arm in arms}
    default_seconds: dict[str, list[float]] = {arm: [] for arm in arms}  # each arm's pairs
    host_use: dict[str, list[HostUse]] = {arm: [] for arm in arms}
    default_host_use: dict[str, list[HostUse]] = {arm: [] for arm in arms}
    device = torch.cuda.get_device_name() if on_gpu else f"{platform.machine()}, " \
                                                           f"{os.cpu_count()} cores"
    out = Path(arguments.out or ROOT / "docs" / "benchmarks" /
               f"compiled-{'gpu' if on_gpu else 'cpu'}.md")
    out.parent.mkdir(parents=True, exist_ok=True)

    def publish(done: int, forwards: dict[str, int] | None) -> str:
        # After every repeat: a run cut short (the GPU's 10-minute calls) still leaves a report.
        timings = Timings(ratios, seconds, collection, default_seconds, host_use,
                          default_host_use)
        report = render(arguments, arms, timings,
                        forwards, device, model, on_gpu, out.with_suffix(".png").name, done)
        out.write_text(report)
        plot(arms, ratios, out.with_suffix(".png"), device)
        return report

    for repeat in range(arguments.repeats):
        for arm in arms:
            prompts = fresh_prompts()
            base, took = timed_pair(repeat, partial(run_default, arm, prompts),
                                    partial(run_arm, arm, prompts))
            default_seconds[arm].append(base)
            seconds[arm].append(took)
            ratios[arm].append(base / took)
            print(f"repeat {repeat + 1}/{arguments.repeats} {arm:>8}: default {base:6.2f} s, "
                  f"arm {took:6.2f} s (collecting {collection[arm][-1]:.3f} s), "
                  f"ratio {base / took:.3f}", flush=True)
        publish(repeat + 1, None)
    if arguments.profile:
        profile_arms(arms, arm_engine_of, engines.get("default"), fresh_prompts, arguments,
                     Path(arguments.profile))
    if profile_only:
        for engine in engines.values():
            engine.close()
        return
    forwards = {kind: engine.close() for kind, engine in engines.items()}
    print(publish(arguments.repeats, forwards.get("ours")))
    if "ours every layer" in forwards:
        print(f"forwards of ours with every layer a graph tap: {forwards['ours every layer']}")


def profile_arms(arms: list[str], engine_of: Callable[[str], Engine], default: Engine | None,
                 fresh_prompts: Callable[[], list[list[int]]], arguments: argparse.Namespace,
                 path: Path) -> None:
    """The default engine and each arm once under each profiler (`PROFILERS`), on fresh prompts
    of the timed runs' size, into one report: for finding what makes an arm slower than another
    (e.g. d against b: host work, device work, or a wait)."""
    sections = []
    for arm in ["default", *arms] if default is not None else arms:
        engine = default if arm == "default" and default is not None else engine_of(arm)
        for profiler in arguments.profilers.split(","):
            print(f"profiling {arm} ({profiler})", flush=True)
            report = engine.profile("a" if arm == "default" else arm, fresh_prompts(),
                                    arguments.concurrency, arguments.max_tokens, profiler)
            sections.append(f"## {arm}: {NAMES.get(arm, 'vLLM default engine')} ({profiler})"
                            f"\n\n```\n{report}\n```\n")
            path.write_text("\n".join(sections))  # a run cut short keeps what it profiled
    print(f"profiles written to {path}")


@dataclass(frozen=True)
class Timings:
    """What the repeats measured, by arm: each pair's ratio (default / arm), the arm's seconds,
    the part of them our engine spent collecting saves, and the default engine's seconds in the
    same pairs."""

    ratios: dict[str, list[float]]
    seconds: dict[str, list[float]]
    collection: dict[str, list[float]]
    default_seconds: dict[str, list[float]]
    host_use: dict[str, list[HostUse]]  # the arm's engine's process, in the arm's runs
    default_host_use: dict[str, list[HostUse]]  # the default engine's, in the arm's pairs

    def fastest_ratio(self, arm: str) -> float:
        """The default engine's fastest run over the arm's fastest: on a host whose runs swing
        between a fast and a slow mode (the H200's: 0.41 and 0.6 s for the same work), the two
        least disturbed runs."""
        return min(self.default_seconds[arm]) / min(self.seconds[arm])


def render(arguments: argparse.Namespace, arms: list[str], timings: Timings,
           forwards: dict[str, int] | None, device: str, model: str, on_gpu: bool,
           plot_name: str, done: int) -> str:
    """The Markdown report of the `done` repeats measured so far (of `arguments.repeats`), with
    our engine's forwards by path once the run has ended (`None` before)."""
    import torch
    import vllm

    targets = GPU_TARGETS if on_gpu else CPU_TARGETS
    name = f"random {arguments.shape}" if arguments.shape else Path(model).name
    lines = [
        "# Interpretability on a compiled engine, against vLLM's default engine",
        "",
        f"Written by `benchmarks/compiled_bench.py` on {datetime.date.today()} ({device}, "
        f"torch {torch.__version__}, vLLM {vllm.__version__}); model `{name}`, "
        f"{arguments.dtype}" + (" (vLLM's dummy weights)" if arguments.dummy_weights else "") +
        f"; {arguments.requests} requests per run, {arguments.concurrency} in "
        f"flight, prompts of {arguments.prompt_tokens or '32-256'} random tokens, "
        f"{arguments.max_tokens} generated each; "
        f"{arguments.repeats} repeats" + ("" if done == arguments.repeats else
                                          f" (**{done} done**: the run stopped there)") +
        ". Each engine in a process of its own: vLLM's default "
        "engine (compiled" + (", CUDA graphs" if on_gpu else ": Dynamo and inductor") + "), "
        "ours (`LLM(enforce_eager=False, taps=[every layer's layer_output], "
        "graph_taps=[the middle layer's])`); those of the arms that have one of their own: "
        "for cg ours with every layer's a graph tap, for taps ours with no graph tap, for "
        "nobreaks ours without the full graphs broken at the taps "
        "(`VLLM_INTERP_BREAK_AT_TAPS=0`), for bare ours with no taps, for twin vLLM's default "
        "engine again, for eager vLLM's eager engine; " + (
            f"ours with two random JumpReLU SAEs of {arguments.sae_width} features at the "
            "middle layer's output, one bf16, one fp32 (the SAE arms'); "
            if set(arms) & set(SAE_ARMS) else "") + (
            "each engine's core in a process of its own, as vLLM runs it by default (saves "
            "cross processes). " if arguments.engine_core_apart else
            "each engine's core in the engine's process (saves do not cross processes). ") +
        "A pair runs the same "
        "fresh prompts on the default engine and the arm, order alternating; ratio = default "
        "time / arm time "
        "(1.0 = free). Medians, min-max over repeats; *fastest* is the default engine's fastest "
        "run in the arm's pairs over the arm's fastest; *collecting* the median seconds of a run "
        "our `LLM` spent moving saves to the caller after the last step.",
        "",
        "Default engine: median "
        f"{statistics.median(itertools.chain(*timings.default_seconds.values())):.2f} s per run.",
        "",
        "| arm | what | median s | collecting s | ratio vs default | min-max | fastest | "
        "target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        ratios = timings.ratios[arm]
        ratio = statistics.median(ratios)
        target = targets.get(arm)
        verdict = "" if target is None else f"{'met' if ratio >= target else 'NOT met'} " \
                                            f"(≥ {target})"
        lines.append(f"| {arm} | {NAMES[arm]} | {statistics.median(timings.seconds[arm]):.2f} | "
                     f"{statistics.median(timings.collection[arm]):.3f} | {ratio:.3f} | "
                     f"{min(ratios):.3f}-{max(ratios):.3f} | {timings.fastest_ratio(arm):.3f} | "
                     f"{verdict} |")
    lines += [] if not set(arms) - OWN_ENGINE.keys() else [
        "",
        "Our engine's forwards over the whole run, by path (`LLM.forwards()`): "
        f"{forwards if forwards is not None else 'not collected (the run stopped early)'}. "
        "`taps` counts compiled forwards whose programs were served by taps' Python; "
        "`in_graph` those served from the graph's buffers alone (arms b, d, e at the middle "
        "layer); `eager` the forwards of steps whose programs acted where no tap serves (the "
        "`untapped` arm's); `tap_breaks` those of the `taps` forwards that replayed a full "
        "CUDA graph broken at the taps (the rest ran the piecewise graphs), and "
        "`tap_breaks_joined` those of them whose segments ran joined around the taps their "
        "step did not need.",
    ]
    lines += ["", "What each engine's process used of the host in a run (medians over the arm's "
              "pairs; *timed thread*: the one that ran `generate` and, in process, the engine's "
              "steps; *other threads*: the rest of the process; `benchmarks/host_use.py`):", "",
              TABLE_HEADER]
    for arm in arms:
        if timings.host_use[arm]:
            lines += [f"| {arm} | {OWN_ENGINE.get(arm, 'ours')} | "
                      f"{median_row(timings.host_use[arm])} |",
                      f"| {arm} | default | {median_row(timings.default_host_use[arm])} |"]
    lines += [
        "",
        f"![ratios]({plot_name})",
        "",
    ]
    return "\n".join(lines)


def plot(arms: list[str], ratios: dict[str, list[float]], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 1.2 + 0.45 * len(arms)))
    medians = [statistics.median(ratios[arm]) for arm in arms]
    low = [median - min(ratios[arm]) for arm, median in zip(arms, medians, strict=True)]
    high = [max(ratios[arm]) - median for arm, median in zip(arms, medians, strict=True)]
    axes.barh([NAMES[arm] for arm in arms], medians, xerr=[low, high], color="#4c72b0")
    axes.axvline(1.0, color="black", linewidth=0.8)
    axes.invert_yaxis()
    axes.set_xlabel("throughput ratio to vLLM's default engine (1.0 = free; bars: min-max)")
    axes.set_title(f"Compiled engine, {device}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    main()
