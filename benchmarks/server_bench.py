"""The server's cost: `vllm-interp serve` against a bare vLLM server on the same model and settings.

Run: `python benchmarks/server_bench.py [--model DIR] [--repeats 3]` (default model: the embedded
SmolLM2-135M-Instruct); writes docs/benchmarks/server.md.

Method: one server at a time on 127.0.0.1 (two side by side would share the cores). Each repeat
starts the bare server — vLLM's own `serve` with the same engine settings, eager — runs the
load, stops it, then starts ours and runs the same load twice: (a) no interventions, (b) every
request saves one layer's `layer_output` and gets it by id (`interp_saves: "id"`), fetching the
safetensors file inside the timed run. The load: `--requests` prompts of random tokens (32-128
long), each generating exactly `--max-tokens` tokens, at most `--concurrency` in flight, sent
with the `openai` client. A ratio is bare time / arm time (1.0 = free), per repeat; the report
gives the median and min-max. The order alternates between repeats (bare first in even ones).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch
from openai import AsyncOpenAI

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "docs" / "benchmarks" / "server.md"
LAYER = "layers.15.layer_output"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """A server process until `stop` (ours: `vllm-interp serve`; bare: vLLM's `serve` alone)."""

    def __init__(self, ours: bool, model: str, settings: list[str]) -> None:
        self.port = free_port()
        launcher = ([str(Path(sys.executable).parent / "vllm-interp"), "serve"] if ours else
                    [sys.executable, "-m", "vllm_runner.server.main", "serve"])
        command = [*launcher, model, "--host", "127.0.0.1", "--port", str(self.port),
                   "--served-model-name", "bench", *settings]
        environment = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
        if not ours:
            environment.pop("VLLM_PLUGINS", None)
        self.log = open(f"/tmp/server-bench-{self.port}.log", "w")  # noqa: SIM115
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=environment)
        deadline = time.monotonic() + 600
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"no server after 600 s; see {self.log.name}") from None
                time.sleep(1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(length),), generator=generator).tolist()
            for length in torch.randint(32, 129, (count,), generator=generator)]


async def load(url: str, work: list[list[int]], max_tokens: int, concurrency: int,
               save: bool) -> float:
    """Seconds to serve `work` with at most `concurrency` requests in flight."""
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    extra = ({"interp_saves": "id", "interventions": [{"op": "save", "location": LAYER}]}
             if save else {})

    async def one(prompt: list[int]) -> None:
        async with gate:
            response = await client.completions.create(
                model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                extra_body={"ignore_eos": True, **extra})
            if save:
                interp = response.choices[0].model_extra["interp"]
                assert interp["error"] is None, interp["error"]
                fetch = f"{url}/v1/interp/saves/{interp['saves_id']}"
                data = await asyncio.to_thread(lambda: urllib.request.urlopen(fetch).read())
                assert len(data) >= interp["saves_bytes"]

    start = time.perf_counter()
    await asyncio.gather(*(one(prompt) for prompt in work))
    took = time.perf_counter() - start
    await client.close()
    return took


def measure(server: Server, arms: list[tuple[str, bool]], work: list[list[int]],
            arguments: argparse.Namespace) -> dict[str, float]:
    warm = work[: arguments.concurrency]
    asyncio.run(load(server.url, warm, arguments.max_tokens, arguments.concurrency, False))
    return {name: asyncio.run(load(server.url, work, arguments.max_tokens, arguments.concurrency,
                                   save)) for name, save in arms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--results", type=Path, default=RESULTS)
    arguments = parser.parse_args()
    model = arguments.model
    # The same engine settings on both sides; the KV cache sized (vLLM's CPU default asks for
    # most of the NUMA node and can fail to start).
    settings = ["--enforce-eager", "--max-model-len", "512", "--max-num-seqs",
                str(arguments.concurrency), "--kv-cache-memory-bytes", str(1 << 30)]
    if model is None:
        from vllm_runner.client.embedded import default_model

        model = default_model()
        settings += ["--dtype", "float32"]
    ours_arms = [("a", False), ("b", True)]
    times: dict[str, list[float]] = {"bare": [], "a": [], "b": []}
    for repeat in range(arguments.repeats):
        work = prompts(arguments.requests, 49152 if arguments.model is None else 256, repeat)
        order = [False, True] if repeat % 2 == 0 else [True, False]
        for ours in order:
            server = Server(ours, model, settings)
            try:
                took = measure(server, ours_arms if ours else [("bare", False)], work,
                               arguments)
            finally:
                server.stop()
            for name, seconds in took.items():
                times[name].append(seconds)
                print(f"repeat {repeat + 1}/{arguments.repeats} {name:>4}: {seconds:.2f} s",
                      flush=True)
    write(arguments, model, times)


def write(arguments: argparse.Namespace, model: str, times: dict[str, list[float]]) -> None:
    generated = arguments.requests * arguments.max_tokens
    lines = [
        "# The server's cost against a bare vLLM server", "",
        f"Written by `benchmarks/server_bench.py` on {datetime.date.today()} "
        f"({platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}); model "
        f"`{Path(model).name}`. {arguments.requests} requests of 32-128 random tokens, "
        f"{arguments.max_tokens} generated each, {arguments.concurrency} in flight, through the "
        f"`openai` client; {arguments.repeats} repeats, one server at a time, order "
        "alternating; ratio = bare time / arm time per repeat (1.0 = free).", "",
        f"Bare server: median {statistics.median(times['bare']):.2f} s "
        f"({generated / statistics.median(times['bare']):.0f} generated tokens/s).", "",
        "| arm | what | median s | ratio vs bare (median) | min-max | target |",
        "|---|---|---|---|---|---|"]
    for name, what, target in [("a", "`vllm-interp serve`, no interventions", 0.98),
                               ("b", f"every request saves `{LAYER}`, fetched by id", 0.9)]:
        ratios = [bare / arm for bare, arm in zip(times["bare"], times[name], strict=True)]
        median = statistics.median(ratios)
        met = "met" if median >= target else "NOT met"
        lines.append(f"| {name} | {what} | {statistics.median(times[name]):.2f} | {median:.3f} "
                     f"| {min(ratios):.3f}-{max(ratios):.3f} | {met} (≥ {target}) |")
    arguments.results.parent.mkdir(parents=True, exist_ok=True)
    arguments.results.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
