"""Benchmark a tpfragments visit against a bare collective of the same tensor.

Run with `nox -s "bench(package='tpfragments')"` (gloo on CPU, 2 processes), or
`python benchmarks/tpfragments_bench.py --backend nccl` on a machine with 2 GPUs. It rewrites its
backend's section of docs/benchmarks/tpfragments.md with the numbers, the date, the machine and
the versions. It is not a test: nothing here asserts a time.

The question, from the tpfragments issue: what does a visit cost beyond the collective it must
run? A visit is `Fragments.whole` (one all-gather, or one all-reduce for partial sums, plus the
local copy into the whole's layout) and `back` (free when nothing was edited; a local split
when something was). The baseline is the bare collective on the same piece: the least any
gather of the value can cost. Bytes are counted from what the visit hands its collectives, so
"same collective, same bytes" is measured, not assumed.

Timing: every rank runs the same sequence; rank 0 times blocks of calls, and the three variants
(bare, read-only visit, edited visit) are interleaved block by block so that load from other
processes affects them alike. Reported numbers are medians over blocks.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import tpfragments
from tpfragments import Fragments, Group, Part, Partial, Rule, Shard, Stacked

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks" / "tpfragments.md"
TOKENS = (1, 16, 256)
HEADER = """# tpfragments benchmark

Written by `benchmarks/tpfragments_bench.py` (`nox -s "bench(package='tpfragments')"` for the
gloo/CPU section; `--backend nccl` on a machine with two GPUs for the NCCL section). Do not edit
the sections by hand: each run replaces its own backend's section.

A *visit* is what a runner does at a hook point whose value is sharded: `Fragments.whole` (one
collective, then a local copy into the whole's layout) and `back`. The baseline is a bare
collective on the same piece — `all_gather` for sharded values, `all_reduce` for partial sums —
the least any gather of that value can cost. "Bytes to collective" is counted from the tensors
the visit hands its collectives (per rank, per visit); a rank then receives
`(ranks - 1) x` that for an all-gather.
"""


def cases() -> list[tuple[str, Rule, int]]:
    """(name, rule, width of the logical value): shapes of a Llama-3-8B-like layer."""
    heads, kv_heads, head = 32, 8, 128
    return [
        ("MLP neurons, Shard(-1)", Shard(-1), 14336),
        ("fused QKV (GQA 32/8), Stacked", Stacked([Part(heads * head, units=heads),
                                                   Part(kv_heads * head, units=kv_heads),
                                                   Part(kv_heads * head, units=kv_heads)]),
         (heads + 2 * kv_heads) * head),
        ("down_proj partial sum, Partial", Partial(), 4096),
    ]


def _counted(group: Group, payload: Counter) -> Group:
    """`group` with the bytes handed to each collective counted."""

    def all_gather(tensor: torch.Tensor) -> torch.Tensor:
        payload["bytes"] += tensor.numel() * tensor.element_size()
        payload["calls"] += 1
        return group.all_gather(tensor)

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        payload["bytes"] += tensor.numel() * tensor.element_size()
        payload["calls"] += 1
        return group.all_reduce(tensor)

    return Group(group.rank, group.size, all_gather=all_gather, all_reduce=all_reduce,
                 name="counted")


def _bare(rule: Rule, piece: torch.Tensor, size: int) -> Callable[[], object]:
    """The bare collective a visit cannot avoid: all-gather (or all-reduce) of the piece."""
    if isinstance(rule, Partial):
        def reduce() -> object:
            buffer = piece.clone()
            dist.all_reduce(buffer)
            return buffer
        return reduce

    single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def gather() -> object:
        out = piece.new_empty((size * piece.shape[0], *piece.shape[1:]))
        single(out, piece)
        return out
    return gather


def _bare_and_copy(rule: Rule, piece: torch.Tensor, size: int) -> Callable[[], object]:
    """The bare collective plus one copy into `[tokens, width]`: the least a usable whole costs.

    For sharded values the all-gather's output is rank-major (`[ranks * tokens, width/ranks]`);
    any whole `[tokens, width]` needs one more copy. (For `Stacked`, this plain concatenation
    is the interleaved, wrong layout, at the cost a right one must at least pay.) A partial
    sum's all-reduce is already whole.
    """
    bare = _bare(rule, piece, size)
    if isinstance(rule, Partial):
        return bare

    def gather_and_copy() -> object:
        stacked = bare().view(size, *piece.shape)
        return torch.cat(stacked.unbind(0), dim=-1)
    return gather_and_copy


def _blocks(fns: dict[str, Callable[[], object]], calls: int, repeats: int,
            synchronize: Callable[[], None]) -> dict[str, float]:
    """Median seconds per call of each function, timed in interleaved blocks of `calls`."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    synchronize()
    for _ in range(repeats):
        for name, fn in fns.items():
            synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            synchronize()
            samples[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(values) for name, values in samples.items()}


def worker(rank: int, size: int, port: int, backend: str, repeats: int, results: object) -> None:
    """One rank: run every case, rank 0 reporting its timings."""
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # one core per rank, as vLLM binds CPU workers
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    for name, rule, width in cases():
        for tokens in TOKENS:
            generator = torch.Generator().manual_seed(tokens)
            logical = torch.randn(tokens, width, generator=generator)
            piece = (torch.randn(tokens, width, generator=torch.Generator().manual_seed(rank))
                     if isinstance(rule, Partial) else rule.split(logical, rank, size))
            piece = piece.to(device)
            payload: Counter = Counter()
            group = _counted(Group.from_torch(), payload)
            fragments = Fragments({"value": (rule, group)})

            def read_only(fragments: Fragments = fragments, piece: torch.Tensor = piece) -> object:
                with torch.inference_mode():
                    _, back = fragments.whole("value", piece)
                    return back()

            def edited(fragments: Fragments = fragments, piece: torch.Tensor = piece) -> object:
                with torch.inference_mode():
                    whole, back = fragments.whole("value", piece)
                    whole[0].add_(1.0)
                    return back()

            read_only()
            per_visit = dict(payload)
            calls = 20 if tokens * width < 1_000_000 else 5
            timings = _blocks({"bare": _bare(rule, piece, size),
                               "copy": _bare_and_copy(rule, piece, size),
                               "read": read_only, "edit": edited}, calls, repeats, synchronize)
            rows.append({
                "case": name, "tokens": tokens,
                "whole_bytes": tokens * width * piece.element_size(),
                "collective_bytes": per_visit["bytes"], "collectives": per_visit["calls"],
                "bare": timings["bare"], "copy": timings["copy"], "read": timings["read"],
                "edit": timings["edit"],
                "baseline": "all_reduce" if isinstance(rule, Partial) else "all_gather",
            })
    dist.destroy_process_group()
    if rank == 0:
        results.put(rows)


def local_costs(size: int, repeats: int) -> list[dict]:
    """The visit's own work with the communication taken out, in one process.

    The collectives are stand-ins that hand back what the other ranks would have sent (an
    all-gather returns the stacked pieces; an all-reduce adds the other ranks' partials), so
    these numbers are tpfragments' local cost per visit, free of the network's jitter.
    """
    torch.set_num_threads(1)
    rows = []
    for name, rule, width in cases():
        for tokens in TOKENS:
            logical = torch.randn(tokens, width, generator=torch.Generator().manual_seed(tokens))
            if isinstance(rule, Partial):
                pieces = [torch.randn(tokens, width) for _ in range(size)]
            else:
                pieces = rule.pieces(logical, size)
            stacked = torch.stack(pieces)
            others = sum(pieces[1:])
            group = Group(0, size, all_gather=lambda tensor, stacked=stacked: stacked,
                          all_reduce=lambda tensor, others=others: tensor.add_(others))
            fragments = Fragments({"value": (rule, group)})

            def read_only(fragments: Fragments = fragments, piece=pieces[0]) -> object:
                with torch.inference_mode():
                    _, back = fragments.whole("value", piece)
                    return back()

            def edited(fragments: Fragments = fragments, piece=pieces[0]) -> object:
                with torch.inference_mode():
                    whole, back = fragments.whole("value", piece)
                    whole[0].add_(1.0)
                    return back()

            calls = 50 if tokens * width < 1_000_000 else 5
            timings = _blocks({"read": read_only, "edit": edited}, calls, repeats, lambda: None)
            rows.append({"case": name, "tokens": tokens, **timings})
    return rows


def _local_table(rows: list[dict]) -> list[str]:
    lines = ["| value | tokens | visit, read µs | visit, edited µs |", "|---|---|---|---|"]
    lines += [f"| {row['case']} | {row['tokens']} | {row['read'] * 1e6:,.1f} | "
              f"{row['edit'] * 1e6:,.1f} |" for row in rows]
    return lines


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _machine(backend: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    if backend == "nccl":
        text = f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}; host: {text}"
    return text


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError


def _table(rows: list[dict]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    header = ("value", "tokens", "whole", "collectives / visit", "bytes to collective / rank",
              "bare collective µs", "bare + one copy µs", "visit, read µs", "÷ bare",
              "÷ bare + copy", "visit, edited µs", "÷ bare")
    body = []
    for row in rows:
        body.append((
            row["case"], str(row["tokens"]), _size(row["whole_bytes"]),
            f"{row['collectives']} {row['baseline']}", _size(row["collective_bytes"]),
            f"{row['bare'] * 1e6:,.1f}", f"{row['copy'] * 1e6:,.1f}",
            f"{row['read'] * 1e6:,.1f}", f"{row['read'] / row['bare']:.2f}",
            f"{row['read'] / row['copy']:.2f}", f"{row['edit'] * 1e6:,.1f}",
            f"{row['edit'] / row['bare']:.2f}",
        ))
    return header, body


def _section(backend: str, size: int, repeats: int, rows: list[dict], local: list[dict],
             load: float) -> str:
    header, body = _table(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    device = "CUDA" if backend == "nccl" else "CPU"
    threads = "; one CPU thread per rank" if device == "CPU" else ""
    return f"""<!-- results:{backend} -->
## {backend} on {device}, {size} ranks

- Date: {datetime.date.today().isoformat()}
- Machine: {_machine(backend)}
- torch {torch.__version__}, tpfragments {tpfragments.__version__}
- Medians over {repeats} interleaved blocks{threads}
- Load average when the run started: {load:.2f} (other work shares the machine; gloo's loopback
  latency varies by hundreds of µs, so compare within a row and read small differences as noise)

### Per visit, against the bare collective

{chr(10).join(lines)}

"bare + one copy" adds the one copy any whole `[tokens, width]` needs after a rank-major
all-gather (for partial sums it is the bare all-reduce again). "visit, read" is `whole` + an
unedited `back()` (which hands the engine its own tensor, no copy). "visit, edited" adds an
in-place edit of one row and the split of the edited whole (for `Partial`: the element-wise
merge that keeps untouched partials). The visit hands its collective exactly the piece a bare
collective would move; the difference in time is the local work: the copy into the whole's
layout (and, for `Partial`, a copy of the piece for the all-reduce and a private snapshot of
the sum).

### The visit's own work, without communication

The same visits in one process, with stand-in collectives that return what the other ranks would
send: what tpfragments adds to the collective, free of network jitter.

{chr(10).join(_local_table(local))}
<!-- /results:{backend} -->
"""


def _write(path: Path, backend: str, section: str) -> None:
    text = path.read_text() if path.exists() else HEADER
    begin, end = f"<!-- results:{backend} -->", f"<!-- /results:{backend} -->"
    if begin in text and end in text:
        before, rest = text.split(begin, 1)
        text = before + section.rstrip("\n") + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.spawn(worker, args=(args.ranks, _free_port(), args.backend, args.repeats, results),
             nprocs=args.ranks)
    rows = results.get()
    local = local_costs(args.ranks, args.repeats)
    section = _section(args.backend, args.ranks, args.repeats, rows, local, load)
    _write(args.output, args.backend, section)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(section)
    else:
        header, body = _table(rows)
        table = Table(title=f"tpfragments visit vs bare collective ({args.backend})")
        for column in header:
            table.add_column(column)
        for row in body:
            table.add_row(*row)
        Console().print(table)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
