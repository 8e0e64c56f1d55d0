"""The in-place trap: values we hand out must not change after we hand them out.

On GPU, vLLM's fused kernels (add + RMSNorm, and others) rewrite a layer's tensors in place
after later layers run, so a reference kept from a hook is overwritten (seen on the H200 in 50
of 50 steps). This check runs concurrent requests with chunked prefill, each saving every
standard value of every layer and keeping every value handed to a `Call`, together with a clone
taken at the moment it was handed over. It asserts:

1. in `lease` mode (the default), every kept value still equals its clone after generation;
2. every saved value equals the clones taken at read time, row by row;
3. as a control, in `view` mode (the engine's own rows, documented as "may be overwritten"),
   it counts how many kept values no longer equal their clones — on GPU this is where the trap
   shows; on CPU it may be zero;
4. (1) and (2) again with one program shared by every request, so saves take the path that
   reads a value once for all of them (`vllm_runner.runtime.row_serving.serve_together`).

With `VLLM_INTERP_DEVICE_SAVES_MIB=0` every step's saves move to the host before the next step
(`SaveStore.spill`), so (2) and (4) check that path too. With `--engine taps` the engine is
vLLM's compiled one with every value checked here a tap (issue [K]): the values are handed out
from inside the compiled graph, where the compiler may reuse a tensor's memory after the tap.
There every layer's output is a graph tap too, and a last pass saves only those, inside the
graph (the save arena), against the rows the lease pass saved.

Usage: python benchmarks/gpu/inplace_check.py --dtype bfloat16 [--engine eager|taps]
       [--shape smollm2-135m] [--out F]
Exit status 1 if (1) or (2) fails anywhere.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # KEPT lives in this process
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch

HERE = Path(__file__).resolve().parent
VALUES = ("layer_input", "layer_mid", "layer_output", "self_attn.attention_input",
          "self_attn.attention_queries", "self_attn.attention_keys",
          "self_attn.attention_values", "self_attn.attention_head_outputs",
          "self_attn.attention_output", "mlp.mlp_input", "mlp.mlp_neurons", "mlp.mlp_output")
PATTERNS = ("token_embeddings", "logits", *(f"layers.*.{value}" for value in VALUES))
# With `--engine taps`, the graph taps (every layer's output), whose saves wait in the arena.
GRAPH_TAPS = "layers.*.layer_output"
IN_GRAPH_TOLERANCE = 1e-2
# The tokens axis of each value as handed out (nnterp layout, batch first).
HEAD_MAJOR = ("attention_queries", "attention_keys", "attention_values")

# (mode, request, location) -> [(the value as handed over, its clone then, its positions)]
KEPT: dict[tuple[str, int, str], list[tuple[torch.Tensor, torch.Tensor, list[int]]]] = \
    defaultdict(list)


def keep(mode: str, request: int, value: torch.Tensor, ctx) -> None:
    """A `Call` that keeps the value it was lent, and a clone of it taken now."""
    KEPT[(mode, request, ctx.location)].append(
        (value, value.detach().clone(), ctx.positions.tolist()))


# Prompt length -> request index, for `keep_shared` (all requests then run one program).
REQUEST_OF_LENGTH: dict[int, int] = {}


def keep_shared(value: torch.Tensor, ctx) -> None:
    """`keep` for a program every request shares: the request is known by its prompt length."""
    keep("shared", REQUEST_OF_LENGTH[ctx.prompt_length], value, ctx)


def token_axis(location: str) -> int:
    return 2 if location.rsplit(".", 1)[-1] in HEAD_MAJOR else 1


def rows_at_read_time(entries: list, axis: int) -> tuple[list[int], torch.Tensor]:
    """The clones' rows by absolute position (a later step's row wins), in position order."""
    by_position = {}
    for _, clone, positions in entries:
        for offset, position in enumerate(positions):
            by_position[position] = clone.select(axis, offset)
    order = sorted(by_position)
    return order, torch.stack([by_position[p] for p in order], dim=axis)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    parser.add_argument("--engine", default="eager", choices=["eager", "taps"],
                        help="eager (enforce_eager=True), or vLLM's compiled engine with every "
                             "value checked a tap")
    arguments = parser.parse_args()

    import vllm
    from random_models import random_checkpoint
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_runner import LLM, ops
    dtype = getattr(torch, arguments.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_checkpoint(arguments.shape, tempfile.mkdtemp(), dtype, device)
    # A 64-token budget spreads each prompt over several steps shared with other requests. The
    # KV cache is sized outright (a few times what 8 x 512 tokens need), so the engine does not
    # profile free memory that another process on the GPU may be freeing.
    # `logits` is read after the model on every path: it needs no tap.
    engine = {"enforce_eager": True} if arguments.engine == "eager" else {
        "enforce_eager": False, "taps": [p for p in PATTERNS if p != "logits"],
        "graph_taps": [GRAPH_TAPS]}
    llm = LLM(model, dtype=arguments.dtype, skip_tokenizer_init=True, seed=0,
              max_num_batched_tokens=64, max_num_seqs=arguments.requests,
              gpu_memory_utilization=0.3, kv_cache_memory_bytes=1 << 30, max_model_len=512,
              **engine)
    generator = torch.Generator().manual_seed(0)
    # Lengths differ, so a shared program's `Call` can tell the requests apart.
    lengths = (torch.randperm(80, generator=generator)[:arguments.requests] + 20).tolist()
    REQUEST_OF_LENGTH.update((length, r) for r, length in enumerate(lengths))
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(
        0, llm.vocab_size, (length,), generator=generator).tolist()) for length in lengths]
    params = SamplingParams(max_tokens=arguments.max_tokens, temperature=0.0, ignore_eos=True)

    results = {}
    lease_outputs: list = []
    saves = [ops.Save(p) for p in PATTERNS]
    shared = [*saves, *(ops.Call(p, keep_shared, reads="lease") for p in PATTERNS)]
    for mode in ("lease", "view", "shared"):
        programs = [shared] * len(prompts) if mode == "shared" else [
            [*saves, *(ops.Call(p, functools.partial(keep, mode, r), reads=mode) for p in PATTERNS)]
            for r in range(len(prompts))]
        outputs = llm.generate(prompts, params, interventions=programs, use_tqdm=False)
        errors = [o.error for o in outputs if o.error]
        if errors:
            raise SystemExit(f"a program failed: {errors[0]}")
        results[mode] = compare(mode, outputs)
        if mode == "lease":  # the in-graph pass's reference
            lease_outputs = outputs
    report = render(results, arguments, vllm.__version__, device)
    in_graph_ok = True
    if arguments.engine == "taps":
        before = llm.forwards()["in_graph"]
        outputs = llm.generate(prompts, params, interventions=[[ops.Save(GRAPH_TAPS)]] *
                               len(prompts), use_tqdm=False)
        in_graph = llm.forwards()["in_graph"] - before
        line, in_graph_ok = compare_in_graph(lease_outputs, outputs, in_graph)
        report += "\n" + line + "\n"
    forwards = llm.forwards()
    report += f"\nForwards by path (`LLM.forwards()`): {forwards}.\n"
    print(report)
    if arguments.out:
        Path(arguments.out).write_text(report)
    if arguments.engine == "taps" and forwards["eager"]:
        print("FAILED: with every value a tap, no step should have run the plain module tree")
        return 1
    return 0 if in_graph_ok and all(
        c["kept_equal"] == c["kept"] and c["saved_equal"] == c["saved"]
        for mode in ("lease", "shared") for c in results[mode].values()) else 1


def compare_in_graph(lease: list, in_graph: list, forwards: int) -> tuple[str, bool]:
    """Every layer's output saved inside the graph (graph taps at every layer: the rows go
    from the graph's ring into the save arena after each forward and wait there) against the same
    rows saved by the lease pass, which equal their clones taken at read time (checked above).
    The same prompts take the same steps, so rows agree up to the last bits of kernels that may
    differ between a graph replayed with taps' Python and one without (`IN_GRAPH_TOLERANCE`,
    relative to the value's largest magnitude); a row overwritten after it was handed over
    differs by the value's own size. Whether it holds, and the line that says so."""
    pairs = equal = 0
    worst = 0.0
    for ours, reference in zip(in_graph, lease, strict=True):
        if ours.error:
            return f"In-graph saves: a request failed: {ours.error}", False
        for location, expected in reference.saved.items():
            if not location.endswith(".layer_output"):
                continue
            got = ours.saved.get(location)
            pairs += 1
            if got is None or got.shape != expected.shape:
                return (f"In-graph saves: {location} is {None if got is None else got.shape}, "
                        f"expected {tuple(expected.shape)}"), False
            equal += torch.equal(got, expected)
            scale = float(expected.float().abs().max()) or 1.0
            worst = max(worst, float((got.float() - expected.float()).abs().max()) / scale)
    ok = pairs > 0 and forwards > 0 and worst <= IN_GRAPH_TOLERANCE
    return (f"In-graph saves (every layer's `layer_output` a graph tap, {forwards} forwards served "
            f"in the graph): {equal}/{pairs} (request, layer) pairs equal to the lease pass's "
            f"saves bit for bit, worst relative difference {worst:.2e} (limit "
            f"{IN_GRAPH_TOLERANCE}): {'ok' if ok else 'FAILED'}."), ok


def compare(mode: str, outputs: list) -> dict[str, dict[str, int]]:
    """Per value name: how many (request, location) pairs kept/saved, and how many still equal
    their clones."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for (kept_mode, request, location), entries in KEPT.items():
        if kept_mode != mode:
            continue
        name = location.rsplit(".", 1)[-1]
        count = counts[name]
        count["kept"] += 1
        count["kept_equal"] += all(torch.equal(value, clone) for value, clone, _ in entries)
        saved = outputs[request].saved.get(location)
        if saved is None:
            continue
        axis = token_axis(location)
        _, rows = rows_at_read_time(entries, axis)
        count["saved"] += 1
        n = saved.shape[axis]
        count["saved_equal"] += (rows.shape[axis] >= n
                                 and torch.equal(saved, rows.narrow(axis, 0, n).cpu()))
    KEPT.clear()
    return counts


def render(results: dict, arguments, vllm_version: str, device: str) -> str:
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    limit = os.environ.get("VLLM_INTERP_DEVICE_SAVES_MIB")
    spill = f"; saves moved to the host past {limit} MiB (`VLLM_INTERP_DEVICE_SAVES_MIB`)" \
        if limit is not None else ""
    engine = "eager" if arguments.engine == "eager" else "compiled, every value a tap"
    lines = [f"### {arguments.dtype}, {engine}, random {arguments.shape}, {where}, "
             f"vLLM {vllm_version}",
             "",
             f"{arguments.requests} concurrent requests (20-99 prompt tokens, 64-token step "
             f"budget, {arguments.max_tokens} generated), every value of every layer saved and "
             "kept by a `Call`; counts are (request, location) pairs equal to their clone "
             f"taken at read time{spill}. Shared: one program for every request (saves read "
             "once for all).",
             "",
             "| value | pairs | lease: kept = clone | saved = clone "
             "| shared: kept = clone | shared: saved = clone | view (control): kept = clone |",
             "|---|---|---|---|---|---|---|"]
    for name in sorted(results["lease"]):
        lease, view = results["lease"][name], results["view"].get(name, {})
        shared = results["shared"].get(name, {})
        lines.append(f"| `{name}` | {lease['kept']} | {lease['kept_equal']}/{lease['kept']} | "
                     f"{lease['saved_equal']}/{lease['saved']} | "
                     f"{shared.get('kept_equal', 0)}/{shared.get('kept', 0)} | "
                     f"{shared.get('saved_equal', 0)}/{shared.get('saved', 0)} | "
                     f"{view.get('kept_equal', 0)}/{view.get('kept', 0)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    # Run as the module `inplace_check`, not `__main__`: `keep` then travels to the worker by
    # reference and fills this very KEPT (the engine runs in this process).
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    import inplace_check

    raise SystemExit(inplace_check.main())
