"""What the runtime's host work costs per step, without the forward: issue [K]'s bound.

On a GPU the compiled engine is host-bound for small models (~3 ms a step for 64 decodes of
SmolLM2-135M on the H200), so every microsecond of Python a step with programs adds costs
throughput one for one. A whole generate on this CPU is too noisy (±20% run to run) to see
tens of microseconds, so this times only what the V2 adapter and the runtime do per step —
`engine.v2_runner.scheduled_step` (with the adapter's `RepeatedSchedule`), the CUDA-graph
choice's checks, `Runtime.begin_step` and
`end_step` — on decode steps of N requests, with the runtime of a real (tiny, in-process)
engine, and the collection of their saves at the end:

    python benchmarks/step_host_work.py [--requests 64] [--steps 128]

It prints microseconds per step for each arm (the fastest of `--repeats`, and the median), and
per request for the collection. Last results: docs/cuda-graphs-design.md ("What it costs
now").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def arm_ops(arm: str, layers: int, hidden: int) -> list[Any]:
    """One request's ops in an arm (the same for every request, as in `compiled_bench`)."""
    import torch
    from vllm_runner import ops
    middle = f"layers.{layers // 2}.layer_output"
    return {"save": [ops.Save(middle)],
            "steer": [ops.Add(middle, torch.ones(hidden), scale=0.5)],
            "ablate": [ops.ProjectOut(middle, torch.ones(hidden))],
            "save every layer": [ops.Save("layers.*.layer_output")],
            "none": []}[arm]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--arms", default="none,save,steer,ablate,save every layer")
    parser.add_argument("--profile", action="store_true",
                        help="print each arm's costliest functions per step (cProfile)")
    parser.add_argument("--shape", default="thin-30",
                        help="a shape of random_models.SHAPES (default: 30 layers, as SmolLM2's)")
    arguments = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the runtime lives in this process

    import torch
    from random_models import SHAPES, random_checkpoint
    from vllm_runner import LLM
    from vllm_runner.engine.repeated_schedule import RepeatedSchedule
    from vllm_runner.engine.v2_runner import scheduled_step
    from vllm_runner.ops.program import encode, encode_ops, program_digest
    from vllm_runner.saves.collection import finished_request

    shape = SHAPES[arguments.shape]
    layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
    model = random_checkpoint(arguments.shape, tempfile.mkdtemp(), torch.float32)
    llm = LLM(model, skip_tokenizer_init=True, enforce_eager=False,
              taps=["layers.*.layer_output"], graph_taps=["layers.*.layer_output"],
              kv_cache_memory_bytes=64 << 20, max_model_len=512, max_num_seqs=arguments.requests)
    runtime = llm.collective_rpc(lambda worker: worker.model_runner.interp)[0]
    count, prompt = arguments.requests, 32

    def one_run(arm: str) -> tuple[float, float]:
        ops = arm_ops(arm, layers, hidden)
        data = encode_ops(ops)
        digest = program_digest(data)
        ids = [f"request-{arm}-{i}" for i in range(count)]
        programs = {} if not ops else {
            request: (encode(f"program-{request}", data, digest), prompt) for request in ids}
        offsets = np.arange(count + 1, dtype=np.int32)
        repeated = RepeatedSchedule()  # as the adapter keeps it: decode steps reuse the list
        started = time.perf_counter()
        for step in range(arguments.steps):
            batch = SimpleNamespace(req_ids=ids, num_reqs=count, query_start_loc_np=offsets,
                                    num_computed_tokens_np=np.full(count, prompt + step),
                                    num_tokens_after_padding=count)
            layout, scheduled = scheduled_step(runtime, programs, batch, repeated)
            travelling = [kept[0] for kept in programs.values()]
            runtime.graph_need(travelling)
            runtime.begin_step(layout, scheduled)
            runtime.end_step()
        per_step = (time.perf_counter() - started) / arguments.steps
        started = time.perf_counter()
        runtime.collect([finished_request(f"program-{request}", prompt, arguments.steps + 1)
                         for request in programs])
        per_request = (time.perf_counter() - started) / max(len(programs), 1)
        return per_step, per_request

    # (Saving at plain taps needs the forward: without one, their programs fail as never served.)
    for arm in arguments.arms.split(","):
        runs = [one_run(arm) for _ in range(arguments.repeats + 1)][1:]  # the first warms up
        if arguments.profile:
            print_profile(arm, one_run)
        # The fastest repeat is the least disturbed by this machine's other load (±50% here).
        step, collect = (min(run[index] for run in runs) * 1e6 for index in (0, 1))
        median = statistics.median(run[0] for run in runs) * 1e6
        print(f"{arm:>16}: {step:8.0f} µs a step of {count} decodes (median {median:.0f}), "
              f"collection {collect:6.0f} µs a request", flush=True)


def print_profile(arm: str, one_run: Any) -> None:
    """`arm`'s steps once more under cProfile (`profiles.python_profile`)."""
    from profiles import python_profile

    print(f"--- {arm}: cProfile of one run (steps and collection)")
    print(python_profile(lambda: one_run(arm)))


if __name__ == "__main__":
    main()
