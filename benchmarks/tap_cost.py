"""What one tap's Python costs per step: the host time a `Save` (or a `Call`) at a plain tap adds.

Issue [K]'s arm (c), every request saving every layer through the taps' Python, is bounded by
this host time: on a GPU a CUDA-graph step of a small model takes a few milliseconds, and each
tap's Python runs between the pieces of the graph at every step. The model here is a thin
random Llama (`random_models`' `thin-30`: hidden 64, 30 layers), so the forward itself costs
little and the difference between generating with and without a `Save` at every layer is
mostly our Python:

    python benchmarks/tap_cost.py [--requests 64] [--profile] [--shape thin-30]
        [--op save|save-last|call|call-read|call-rowwise|lens|lens-last|steer-decode]

(in an environment holding the stack; on the GPU `benchmarks/gpu/check.sh python3
benchmarks/tap_cost.py`). It prints, per repeat, both runs' seconds and the cost per tap call
(the difference over forwards x layers; it includes each request's share of collection at the
end), and with `--profile` where our code spends it. `--op call` runs a `Call` at every layer
whose function returns an edited copy (`value * 1.0`: read, edit, check, write back for every
request), `--op call-read` one that only reads (nothing written): issue [K]'s `call` arm, whose
cost is this per-request Python at every step. `--op call-rowwise` is `--op call` with
`rowwise=True`: one call a step for every request; `--op lens` a logit lens (top 5) at every
layer; `--op steer-decode` an `Add` on generated tokens only (`steps="decode"`); `--op
save-last` a `Save` of the prompt's last token (`positions=(-1,)`, the usual probe: its cost
falls on the prompts' steps), `--op lens-last` the logit lens there. Results:
docs/cuda-graphs-design.md.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from typing import Any


def edited_copy(value: Any, context: Any) -> Any:
    """`--op call`'s function: an edit any user could write (a new tensor, written back)."""
    return value * 1.0


def only_read(value: Any, context: Any) -> None:
    """`--op call-read`'s function: reads the value, changes nothing (nothing is written)."""
    value.sum()


OPS = {"save": lambda ops, hidden: ops.Save("layers.*.layer_output"),
       "call": lambda ops, hidden: ops.Call("layers.*.layer_output", edited_copy),
       "call-read": lambda ops, hidden: ops.Call("layers.*.layer_output", only_read),
       "call-rowwise": lambda ops, hidden: ops.Call("layers.*.layer_output", edited_copy,
                                                    rowwise=True),
       "lens": lambda ops, hidden: ops.Lens("layers.*.layer_output", top_k=5),
       "steer-decode": lambda ops, hidden: ops.Add("layers.*.layer_output", hidden, 0.1,
                                                   steps="decode"),
       "save-last": lambda ops, hidden: ops.Save("layers.*.layer_output", positions=(-1,)),
       "lens-last": lambda ops, hidden: ops.Lens("layers.*.layer_output", top_k=5,
                                                 positions=(-1,))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--op", choices=sorted(OPS), default="save",
                        help="what every request runs at every layer (default: save)")
    parser.add_argument("--profile", action="store_true", help="also profile one saving run")
    parser.add_argument("--shape", default="thin-30",
                        help="random_models' shape (default thin-30; a lens needs a real "
                             "vocabulary to cost what it does: smollm2-135m)")
    arguments = parser.parse_args()

    import torch
    from random_models import SHAPES, random_checkpoint
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_runner import LLM, ops
    model = random_checkpoint(arguments.shape, tempfile.mkdtemp(), torch.float32)
    layers = SHAPES[arguments.shape]["num_hidden_layers"]
    llm = LLM(model, skip_tokenizer_init=True, enforce_eager=False,
              taps=["layers.*.layer_output"], kv_cache_memory_bytes=256 << 20,
              max_model_len=256, seed=0)
    params = SamplingParams(max_tokens=arguments.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 250 + 1 for j in range(24)])
               for i in range(arguments.requests)]
    vector = torch.ones(SHAPES[arguments.shape]["hidden_size"])
    saving = [[OPS[arguments.op](ops, vector)]] * arguments.requests

    def forward_count() -> int:
        by_path = llm.forwards()
        return sum(by_path[path] for path in ("compiled", "taps", "in_graph", "eager"))

    def timed(programs: Any) -> tuple[float, int]:
        before = forward_count()  # "tap_breaks" counts some of the "taps" forwards again
        start = time.perf_counter()
        llm.generate(prompts, params, interventions=programs, use_tqdm=False)
        return time.perf_counter() - start, forward_count() - before

    timed(saving)  # warm: the first steps of each batch size
    for repeat in range(arguments.repeats):
        plain, forwards = timed(None)
        saved, _ = timed(saving)
        per_call = (saved - plain) / (forwards * layers)
        print(f"repeat {repeat}: without programs {plain:.3f} s, {arguments.op} at every layer "
              f"{saved:.3f} s ({forwards} forwards): {per_call * 1e6:.0f} us per tap call for "
              f"{arguments.requests} requests", flush=True)
    if arguments.profile:
        profile = cProfile.Profile()
        profile.enable()
        timed(saving)
        profile.disable()
        report = io.StringIO()
        pstats.Stats(profile, stream=report).sort_stats("cumtime").print_stats(
            "vllm_runner|tokenspan|vllm_envoys", 30)
        print(report.getvalue())


if __name__ == "__main__":
    main()
