"""A soak of `vllm-interp serve`: a long mixed load, its memory, files and latency sampled as it
runs, and checks that nothing grows, nothing good fails and plain requests are vLLM's.

Run: `python benchmarks/soak.py` (the embedded SmolLM2-135M-Instruct; 10,000 requests, 64 in
flight, 2-6 tokens generated each; writes docs/benchmarks/soak.md and soak.png), `--check` to
exit non-zero where a bound is passed. CI runs `nox -s soak`: 1,000 requests of 2-3 generated
tokens, sampled every 10 s, the kept saves' TTL 20 s, with the same bounds but the first 40% of
the samples as warm-up (~400 requests), `--check` (the noxfile's `SOAK_CI`).

The load, drawn with a fixed seed, through the `openai` client: a third of the requests plain
(greedy completions, some chats, some `n=2` sampled), the rest with a program: a layer saved
inline or kept under an id (fetched at once, after a delay within the saves' TTL, or never),
steering by a vector sent inline or registered by name, a logit lens, streamed or not, chats
and completions. Every interval the script records the server's processes (the API server and
the engine core: resident memory, open files), `/dev/shm`'s files and bytes of ours, the kept
saves' bytes (`/v1/interp/held`), the interval's latency p50/p99 and errors by kind.

Checks: no good request fails; after the warm-up (`--warm-up`, the first fifth of the samples)
resident memory rises at most `--memory-bound-mib` (256) above its highest in the warm-up and
open files by at most 8 (a leak shows as the peaks climbing: the engine's memory swings between
heap trims, `vllm_runner.engine.heap`); when the
load is over nothing is held (requests, bytes, `/dev/shm` files of ours) and, after the TTL, no
kept saves; every save fetched late within its TTL is read; and the plain greedy requests'
tokens equal a bare `vllm serve`'s (same model and settings) for the same prompts, sent the
same way after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from openai import APIStatusError, AsyncOpenAI
from server_bench import Server

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "docs" / "benchmarks" / "soak.md"
SHM_PREFIX = "vllm-interp-"  # vllm_runner.saves.shm_files' files
MODEL_NAME = "bench"  # server_bench.Server's --served-model-name


@dataclass
class Request:
    """One request of the load: what it sends and how its answer is checked."""

    index: int
    prompt: list[int]
    chat: bool
    stream: bool
    max_tokens: int
    interventions: list[dict[str, Any]] | None = None
    saves: str = "inline"  # "inline", or "id": fetched "now", "late" or "never"
    fetch: str = "now"
    n: int = 1


@dataclass
class Sample:
    """One interval's record."""

    at_s: float
    done: int
    server_mib: float  # resident memory of the API server's process
    engine_mib: float  # of the engine core's process (and any other child)
    open_files: int
    shm_files: int
    shm_mib: float
    kept_mib: float
    p50_ms: float | None
    p99_ms: float | None
    errors: dict[str, int] = field(default_factory=dict)


def draw_load(count: int, config: dict[str, Any], most_tokens: int, seed: int
              ) -> list[Request]:
    """The requests, a fixed mix drawn with `seed`, for a model of `config` (its config.json),
    each generating 2 to `most_tokens` tokens."""
    rng = random.Random(seed)
    vocab, hidden, depth = (config["vocab_size"], config["hidden_size"],
                            config["num_hidden_layers"])
    layers = ["layers.1.layer_output", f"layers.{depth // 2}.layer_output",
              f"layers.{depth - 2}.mlp_output"]
    load = []
    for index in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(8, 32))]
        request = Request(index, prompt, chat=rng.random() < 0.25, stream=rng.random() < 0.3,
                          max_tokens=rng.randint(2, most_tokens))
        if index % 3 == 0:  # plain; a few sampled twice
            request.n = 2 if rng.random() < 0.15 else 1
            load.append(request)
            continue
        ops: list[dict[str, Any]] = []
        if rng.random() < 0.6:
            ops.append({"op": "save", "location": rng.choice(layers),
                        **({"positions": [-1]} if rng.random() < 0.5 else {})})
        if rng.random() < 0.4:
            vector = ({"name": "soak-steer"} if rng.random() < 0.5 else
                      [round(rng.gauss(0, 1), 3) for _ in range(hidden)])
            ops.append({"op": "add", "location": rng.choice(layers), "vector": vector,
                        "scale": 2.0})
        if rng.random() < 0.3 or not ops:
            ops.append({"op": "lens", "location": rng.choice(layers), "top_k": 5})
        request.interventions = ops
        if any(op["op"] == "save" for op in ops) and rng.random() < 0.5:
            request.saves = "id"
            request.fetch = rng.choice(["now", "late", "never"])
        load.append(request)
    return load


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def shm_usage() -> tuple[int, int]:
    """(files, bytes) of ours in /dev/shm."""
    files = [entry for entry in os.scandir("/dev/shm") if entry.name.startswith(SHM_PREFIX)]
    sizes = []
    for entry in files:
        with contextlib.suppress(FileNotFoundError):  # removed since the listing
            sizes.append(entry.stat().st_size)
    return len(sizes), sum(sizes)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.load(answer)


class Soak:
    """The load against one server, sampled every `interval` seconds."""

    def __init__(self, server: Server, load: list[Request], concurrency: int,
                 interval: float, ttl: float) -> None:
        self.server, self.load = server, load
        self.concurrency, self.interval, self.ttl = concurrency, interval, ttl
        self.client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                  max_retries=0, timeout=600)
        self.latencies: list[float] = []
        self.errors: Counter[str] = Counter()
        self.failed: list[str] = []  # good requests that failed, described
        self.plain_tokens: dict[int, list[int]] = {}
        self.late: list[tuple[float, str]] = []  # (when to fetch, id)
        self.late_read = self.late_missing = 0
        self.done = 0
        self.samples: list[Sample] = []
        self.started = time.monotonic()

    async def run(self) -> None:
        gate = asyncio.Semaphore(self.concurrency)
        sampler = asyncio.create_task(self.sample_every())
        late = asyncio.create_task(self.fetch_late())

        async def one(request: Request) -> None:
            async with gate:
                started = time.monotonic()
                try:
                    await self.send(request)
                except Exception as error:  # a good request must not fail: recorded
                    kind = type(error).__name__ + (f" {error.status_code}" if isinstance(
                        error, APIStatusError) else "")
                    self.errors[kind] += 1
                    self.failed.append(f"request {request.index}: {kind}: {str(error)[:300]}")
                self.latencies.append(time.monotonic() - started)
                self.done += 1

        await asyncio.gather(*(one(request) for request in self.load))
        await late
        sampler.cancel()
        await self.client.close()

    async def send(self, request: Request) -> None:
        extra: dict[str, Any] = {"return_token_ids": True}
        if request.interventions is not None:
            extra.update(interventions=request.interventions, interp_saves=request.saves)
        options = dict(model=MODEL_NAME, max_tokens=request.max_tokens, n=request.n,
                       temperature=0.0 if request.n == 1 else 1.0, seed=request.index,
                       stream=request.stream, extra_body=extra)
        if request.chat:
            messages = [{"role": "user", "content": " ".join(map(str, request.prompt))}]
            answer = await self.client.chat.completions.create(messages=messages, **options)
        else:
            answer = await self.client.completions.create(prompt=request.prompt, **options)
        if request.stream:
            chunks = [chunk async for chunk in answer]
            last = [chunk for chunk in chunks if chunk.choices]
            choices = [last[-1].choices[0]] if last else []
            tokens = [token for chunk in chunks for choice in chunk.choices
                      for token in (choice.model_extra or {}).get("token_ids") or []]
        else:
            choices = answer.choices
            tokens = list((choices[0].model_extra or {}).get("token_ids") or [])
        if len(choices) != (request.n if not request.stream else 1):
            raise RuntimeError(f"{len(choices)} choices for n={request.n}")
        if request.interventions is None:
            if request.n == 1 and not request.chat:
                self.plain_tokens[request.index] = tokens
            return
        interp = (choices[0].model_extra or {}).get("interp")
        if interp is None or interp.get("error") is not None:
            raise RuntimeError(f"interp {interp if interp is None else interp.get('error')}")
        if request.saves == "id" and interp.get("saves_id"):
            if request.fetch == "now":
                await asyncio.to_thread(self.fetch, interp["saves_id"])
            elif request.fetch == "late":
                self.late.append((time.monotonic() + random.uniform(0, self.ttl / 2),
                                  interp["saves_id"]))

    def fetch(self, saves_id: str) -> None:
        with urllib.request.urlopen(f"{self.server.url}/v1/interp/saves/{saves_id}",
                                    timeout=60) as answer:
            if not answer.read():
                raise RuntimeError(f"saves {saves_id} were empty")

    async def fetch_late(self) -> None:
        """Fetch the saves kept for later once their time comes (within their TTL)."""
        while self.done < len(self.load) or self.late:
            due = [item for item in self.late if item[0] <= time.monotonic()]
            for item in due:
                self.late.remove(item)
                try:
                    await asyncio.to_thread(self.fetch, item[1])
                    self.late_read += 1
                except urllib.error.HTTPError as error:
                    self.late_missing += 1
                    self.failed.append(f"late fetch of {item[1]}: {error.code}")
            await asyncio.sleep(0.2)

    async def sample_every(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.samples.append(await asyncio.to_thread(self.sample))

    def sample(self) -> Sample:
        server, *engine = tree(self.server.process.pid)
        processes = [server, *engine]
        files = sum(process.num_fds() for process in processes)
        shm_files, shm_bytes = shm_usage()
        kept = get_json(f"{self.server.url}/v1/interp/held")["kept_bytes"]
        latencies, self.latencies = sorted(self.latencies), []
        errors, self.errors = dict(self.errors), Counter()

        def quantile(q: float) -> float | None:
            return (1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))]
                    if latencies else None)

        return Sample(time.monotonic() - self.started, self.done,
                      server.memory_info().rss / 2**20,
                      sum(process.memory_info().rss for process in engine) / 2**20, files,
                      shm_files, shm_bytes / 2**20, kept / 2**20, quantile(0.5), quantile(0.99),
                      errors)


async def plain_on(server: Server, load: list[Request], concurrency: int
                   ) -> dict[int, list[int]]:
    """The plain greedy completions of `load` on `server`: tokens by request index."""
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=600)
    gate = asyncio.Semaphore(concurrency)
    found: dict[int, list[int]] = {}

    async def one(request: Request) -> None:
        async with gate:
            answer = await client.completions.create(
                model=MODEL_NAME, prompt=request.prompt, max_tokens=request.max_tokens,
                temperature=0.0, seed=request.index, extra_body={"return_token_ids": True})
            found[request.index] = list(answer.choices[0].model_extra["token_ids"])

    await asyncio.gather(*(one(request) for request in load))
    await client.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=6,
                        help="each request generates 2 to this many tokens")
    parser.add_argument("--interval", type=float, default=60.0,
                        help="seconds between samples")
    parser.add_argument("--ttl", type=float, default=120.0, help="the kept saves' TTL (s)")
    parser.add_argument("--memory-bound-mib", type=float, default=256.0,
                        help="the most resident memory may rise above the warm-up's highest")
    parser.add_argument("--warm-up", type=float, default=0.2,
                        help="the share of the samples that is warm-up (memory may grow)")
    parser.add_argument("--check", action="store_true", help="exit 1 where a bound is passed")
    parser.add_argument("--out", type=Path, default=RESULTS)
    arguments = parser.parse_args()
    model, settings = arguments.model, ["--enforce-eager", "--max-model-len", "512",
                                        "--max-num-seqs", str(arguments.concurrency),
                                        "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0"]
    if model is None:
        from vllm_runner.client.embedded import default_model

        model = default_model()
        settings += ["--dtype", "float32"]
    config = json.loads((Path(model) / "config.json").read_text())
    load = draw_load(arguments.requests, config, arguments.max_tokens, seed=0)
    vectors = Path(tempfile.mkdtemp(prefix="soak-vectors-"))  # removed at the end
    ours = Server(True, model, [*settings, "--interp-vectors", str(vectors),
                                "--interp-saves-ttl-s", str(arguments.ttl),
                                "--interp-saves-budget-mib", "512"])
    try:
        shm_before = shm_usage()
        steer = json.dumps([0.01 * (i % 7) for i in range(config["hidden_size"])]).encode()
        urllib.request.urlopen(urllib.request.Request(
            f"{ours.url}/v1/interp/vectors/soak-steer", data=steer, method="PUT",
            headers={"Content-Type": "application/json"}), timeout=60).read()
        soak = Soak(ours, load, arguments.concurrency, arguments.interval, arguments.ttl)
        asyncio.run(soak.run())
        soak.samples.append(soak.sample())  # the end of the load
        deadline = time.monotonic() + 60
        while (held := get_json(f"{ours.url}/v1/interp/held"))["requests"] and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        ended = time.monotonic()
        # The oracle starts while every kept save's TTL passes (ours idle meanwhile).
        bare = Server(False, model, settings)
        try:
            time.sleep(max(0.0, ended + arguments.ttl + 1 - time.monotonic()))
            after = get_json(f"{ours.url}/v1/interp/held")
            soak.samples.append(soak.sample())  # after the TTL
            shm_after = shm_usage()
            ours.stop()
            plain = [request for request in load if request.index in soak.plain_tokens]
            expected = asyncio.run(plain_on(bare, plain, arguments.concurrency))
        finally:
            bare.stop()
    finally:
        ours.stop()
        shutil.rmtree(vectors, ignore_errors=True)
    differing = [index for index, tokens in soak.plain_tokens.items()
                 if tokens != expected[index]]
    checks = judge(arguments, soak, held, after, shm_before, shm_after, differing, len(plain))
    report = render(arguments, model, soak, checks)
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(report)
    plot(soak.samples, arguments.out.with_suffix(".png"))
    print(report)
    if arguments.check and not all(passed for _, passed in checks):
        sys.exit(1)


def judge(arguments: argparse.Namespace, soak: Soak, held: dict[str, int],
          after: dict[str, int], shm_before: tuple[int, int], shm_after: tuple[int, int],
          differing: list[int], plain: int) -> list[tuple[str, bool]]:
    """Each check, described with what was measured, and whether it passed."""
    samples = soak.samples
    first = max(1, int(len(samples) * arguments.warm_up))
    warm_up, after_warm_up = samples[:first], samples[first:] or samples[-1:]
    # Against the warm-up's highest: the engine's memory swings between heap trims, and a leak
    # shows as the peaks climbing, not as a peak above a trough that happened to be sampled.
    grown = max(sample.server_mib + sample.engine_mib for sample in after_warm_up
                ) - max(sample.server_mib + sample.engine_mib for sample in warm_up)
    files = max(sample.open_files for sample in after_warm_up) - max(
        sample.open_files for sample in warm_up)
    return [
        (f"no good request failed ({len(soak.failed)} failed"
         + (f"; first: {soak.failed[0]}" if soak.failed else "") + ")", not soak.failed),
        (f"resident memory (server and engine) rose {grown:.0f} MiB above its highest in the "
         f"warm-up (the first {first} samples, {warm_up[-1].done} requests; bound "
         f"{arguments.memory_bound_mib:.0f})",
         grown <= arguments.memory_bound_mib),
        (f"open files after the warm-up grew by {files} (bound 8)", files <= 8),
        (f"nothing held when the load was over: {held}", held["requests"] == 0
         and held["bytes"] == 0),
        (f"no kept saves after their TTL: {after['kept_bytes']} bytes", after["kept_bytes"] == 0),
        (f"/dev/shm files of ours: {shm_before[0]} before, {shm_after[0]} after",
         shm_after[0] <= shm_before[0]),
        (f"saves fetched late within their TTL: {soak.late_read} read, {soak.late_missing} "
         "missing", soak.late_missing == 0),
        (f"plain greedy completions equal to a bare vllm serve's: {plain - len(differing)} of "
         f"{plain}" + (f" (differ: {differing[:10]})" if differing else ""), not differing),
    ]


def render(arguments: argparse.Namespace, model: str, soak: Soak,
           checks: list[tuple[str, bool]]) -> str:
    total = soak.samples[-1].at_s if soak.samples else 0.0
    lines = [
        "# A soak of the server", "",
        f"Written by `benchmarks/soak.py` on {datetime.date.today()} ({platform.machine()}, "
        f"{os.cpu_count()} cores); model `{Path(model).name}`; {arguments.requests} requests, "
        f"{arguments.concurrency} in flight, sampled every {arguments.interval:g} s; kept "
        f"saves' TTL {arguments.ttl:g} s; {total:.0f} s in all. The method is the script's "
        "docstring.", "",
        "| check | passed |", "|---|---|",
        *[f"| {what} | {'yes' if passed else '**no**'} |" for what, passed in checks], "",
        "| at s | done | server MiB | engine MiB | open files | /dev/shm files | /dev/shm MiB | "
        "kept MiB | p50 ms | p99 ms | errors |", "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sample in soak.samples:
        def ms(value: float | None) -> str:
            return "—" if value is None else f"{value:.0f}"
        lines.append(f"| {sample.at_s:.0f} | {sample.done} | {sample.server_mib:.0f} | "
                     f"{sample.engine_mib:.0f} | "
                     f"{sample.open_files} | {sample.shm_files} | {sample.shm_mib:.1f} | "
                     f"{sample.kept_mib:.2f} | {ms(sample.p50_ms)} | {ms(sample.p99_ms)} | "
                     f"{sample.errors or ''} |")
    lines += ["", f"![the soak, sample by sample]({arguments.out.with_suffix('.png').name})", ""]
    return "\n".join(lines)


def plot(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    at = [sample.at_s for sample in samples]
    figure, axes = plt.subplots(2, 2, figsize=(11, 6), sharex=True)
    series = [("resident memory, MiB (server; engine)", None),
              ("open files", [s.open_files for s in samples]),
              ("kept saves, MiB; /dev/shm of ours, MiB", None),
              ("latency, ms (p50, p99)", None)]
    for axis, (title, values) in zip(axes.flat, series, strict=True):
        axis.set_title(title, fontsize=9)
        if values is not None:
            axis.plot(at, values, marker=".")
    axes[0, 0].plot(at, [s.server_mib for s in samples], marker=".", label="API server")
    axes[0, 0].plot(at, [s.engine_mib for s in samples], marker=".", label="engine core")
    axes[0, 0].legend(fontsize=8)
    axes[1, 0].plot(at, [s.kept_mib for s in samples], marker=".", label="kept")
    axes[1, 0].plot(at, [s.shm_mib for s in samples], marker=".", label="/dev/shm")
    axes[1, 0].legend(fontsize=8)
    axes[1, 1].plot(at, [s.p50_ms if s.p50_ms is not None else float("nan") for s in samples],
                    marker=".", label="p50")
    axes[1, 1].plot(at, [s.p99_ms if s.p99_ms is not None else float("nan") for s in samples],
                    marker=".", label="p99")
    axes[1, 1].legend(fontsize=8)
    for axis in axes[1]:
        axis.set_xlabel("seconds")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
