"""Benchmark tokenspan's per-call costs and its multi-request path against a per-request loop.

Run with `nox -s "bench(package='tokenspan')"` (or `python benchmarks/tokenspan_bench.py` where
tokenspan is installed). It rewrites docs/benchmarks/tokenspan.md with the numbers, the date, the
machine and the versions. Timings are medians from `torch.utils.benchmark` (blocked autorange),
so they are comparable within one run; compare ratios, not absolute times, across machines.

Two questions, from the tokenspan issue:
1. Does an unmodified lease + commit cost no more than one copy of the span?
2. Is the vectorised multi-span path at least 10x faster than a Python loop over requests
   (256 requests on an [8192, 4096] slab)? The loop is plain torch slicing, the strongest loop
   a user could write, not tokenspan's own per-span calls.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from collections.abc import Callable
from pathlib import Path

import tokenspan
import torch
import torch.utils.benchmark as tbench
from rich.console import Console
from rich.table import Table
from tokenspan import StepLayout, lease, narrow, widen

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks" / "tokenspan.md"
ROWS, HIDDEN, REQUESTS = 8192, 4096, 256


def median_seconds(fn: Callable[[], object], min_run_time: float) -> float:
    """Median wall time of one call, from torch's blocked autorange timer."""
    timer = tbench.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def per_call_costs(slab: torch.Tensor, min_run_time: float) -> list[tuple[str, ...]]:
    """Narrow, copy, lease and widen on spans of a decode token, a chunk and a long prefill."""
    rows = []
    for span_rows in (1, 32, 512):
        layout = StepLayout.from_counts(["other", "me"], [ROWS - span_rows, span_rows])
        span = layout["me"]
        edit = torch.randn(span_rows, HIDDEN, device=slab.device)

        def unmodified_lease(span=span, layout=layout) -> None:
            lease(slab, span, layout).commit()

        def edited_lease(span=span, layout=layout) -> None:
            lent = lease(slab, span, layout)
            lent.value.mul_(1.0)
            lent.commit()

        def copy_once_fn(span=span) -> torch.Tensor:
            return slab[span.start:span.stop].clone()

        def narrow_view(span=span, layout=layout) -> torch.Tensor:
            return narrow(slab, span, layout)

        def narrow_copy(span=span, layout=layout) -> torch.Tensor:
            return narrow(slab, span, layout, copy=True)

        def widen_edit(span=span, layout=layout, edit=edit) -> None:
            widen(slab, span, layout, edit)

        copy_once = median_seconds(copy_once_fn, min_run_time)
        timings = {
            "narrow (view)": median_seconds(narrow_view, min_run_time),
            "narrow (copy)": median_seconds(narrow_copy, min_run_time),
            "lease + commit, unmodified": median_seconds(unmodified_lease, min_run_time),
            "lease + edit + commit": median_seconds(edited_lease, min_run_time),
            "widen": median_seconds(widen_edit, min_run_time),
        }
        for name, seconds in timings.items():
            rows.append((f"{span_rows}", name, f"{seconds * 1e6:,.1f}",
                         f"{seconds / copy_once:.2f}"))
        rows.append((f"{span_rows}", "baseline: `slab[a:b].clone()`", f"{copy_once * 1e6:,.1f}",
                     "1.00"))
    return rows


def vectorised_against_loop(slab: torch.Tensor, min_run_time: float) -> list[tuple[str, ...]]:
    """Ops over 256 requests: one tokenspan Selection against a Python loop over requests.

    A runner builds a step's selections once and applies them at every hooked layer, so the
    build (once per step) and the apply (once per layer) are timed apart; the speed-up is the
    loop against the apply.
    """
    device = slab.device
    counts = [ROWS // REQUESTS] * REQUESTS
    firsts = [100 + 7 * i for i in range(REQUESTS)]
    keys = [f"req-{i}" for i in range(REQUESTS)]
    layout = StepLayout.from_counts(keys, counts, firsts)
    spans = [layout[key] for key in keys]
    half, half_spans = keys[::2], spans[::2]
    last = {key: [span.last_position] for key, span in zip(keys, spans, strict=True)}
    vectors = torch.randn(REQUESTS, HIDDEN, device=device)
    one_vector = torch.randn(HIDDEN, device=device)
    last_rows = layout.select(last, device=device)
    half_rows = layout.select(half, device=device)

    def loop_save_last() -> list[torch.Tensor]:
        return [slab[s.stop - 1:s.stop].clone() for s in spans]

    def loop_set_last() -> None:
        for i, s in enumerate(spans):
            slab[s.stop - 1] = vectors[i]

    def loop_steer_last() -> None:
        for i, s in enumerate(spans):
            slab[s.stop - 1] += vectors[i]

    def loop_steer_all() -> None:
        for s in half_spans:
            slab[s.start:s.stop] += one_vector

    def loop_split() -> list[torch.Tensor]:
        return [slab[s.start:s.stop] for s in spans]

    def loop_rows() -> torch.Tensor:
        return torch.cat([torch.arange(s.start, s.stop, device=device) for s in half_spans])

    def loop_positions() -> torch.Tensor:
        return torch.cat([s.positions(device) for s in spans])

    cases = [
        ("save the last token of each request", loop_save_last,
         lambda: last_rows.split(last_rows.gather(slab)), lambda: layout.select(last, device)),
        ("set each request's last token to its own vector", loop_set_last,
         lambda: last_rows.scatter(slab, vectors), lambda: layout.select(last, device)),
        ("add a per-request vector at each last token", loop_steer_last,
         lambda: last_rows.add(slab, last_rows.per_row(vectors)),
         lambda: layout.select(last, device)),
        ("add one vector to every row of 128 requests", loop_steer_all,
         lambda: half_rows.add(slab, one_vector), lambda: layout.select(half, device)),
        ("split the slab into per-request views", loop_split, lambda: layout.split(slab), None),
        ("row index of 128 of 256 requests", loop_rows, lambda: layout.select(half, device).rows,
         None),
        ("absolute position of every row", loop_positions, lambda: layout.positions(device),
         None),
    ]
    rows = []
    for name, loop, vectorised, build in cases:
        loop_s = median_seconds(loop, min_run_time)
        vector_s = median_seconds(vectorised, min_run_time)
        build_s = median_seconds(build, min_run_time) if build is not None else None
        rows.append((name, f"{loop_s * 1e6:,.1f}", f"{vector_s * 1e6:,.1f}",
                     f"{loop_s / vector_s:.1f}x",
                     "(included)" if build_s is None else f"{build_s * 1e6:,.1f}"))
    return rows


def markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def show(console: Console, title: str, header: tuple[str, ...],
         rows: list[tuple[str, ...]]) -> None:
    table = Table(title=title)
    for column in header:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def device_description(device: torch.device) -> str:
    """The hardware a section was measured on, for the results page."""
    cpu = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (host: {cpu})"
    return f"{cpu}, {torch.get_num_threads()} torch threads"


def results_section(device: torch.device, per_call: list, vectorised: list) -> str:
    """The markdown for one device's results, fenced by markers so other devices' survive."""
    return f"""<!-- results:{device.type} -->
## On {device.type.upper()}

- Date: {datetime.date.today().isoformat()}
- Hardware: {device_description(device)}
- torch {torch.__version__}, tokenspan {tokenspan.__version__}
- Slab: [{ROWS}, {HIDDEN}] float32 ({ROWS * HIDDEN * 4 / 2**20:.0f} MiB)

### Per-call cost

A request's span at the end of the slab. The last column divides by one plain copy of the span
(`slab[a:b].clone()`); the target is that an unmodified lease + commit costs no more than that.

{markdown_table(PER_CALL_HEADER, per_call)}

### Vectorised over {REQUESTS} requests against a loop

{REQUESTS} requests of {ROWS // REQUESTS} rows each. The loop is plain torch slicing per request.
The tokenspan column applies a prebuilt `Selection` (as a runner does at each hooked layer); the
last column is the cost of building it, paid once per step. Target: at least 10x.

{markdown_table(VECTOR_HEADER, vectorised)}
<!-- /results:{device.type} -->
"""


PAGE_HEAD = """# tokenspan benchmark

Written by `benchmarks/tokenspan_bench.py` (`nox -s "bench(package='tokenspan')"` for the CPU
section; `--device cuda` on a GPU machine for the CUDA section). Do not edit the sections by hand:
each run replaces its own device's section. Timings are medians of `torch.utils.benchmark`'s
blocked autorange.
"""

PER_CALL_HEADER = ("span rows", "operation", "median µs", "÷ one copy of the span")
VECTOR_HEADER = ("operation", "loop µs", "tokenspan µs", "speed-up",
                 "selection build µs (once per step)")


def write_section(path: Path, device: torch.device, section: str) -> None:
    """Replace this device's section of the results page, keeping every other section."""
    page = path.read_text() if path.exists() else PAGE_HEAD
    begin, end = f"<!-- results:{device.type} -->", f"<!-- /results:{device.type} -->"
    if begin in page and end in page:
        page = page[: page.index(begin)] + section.rstrip("\n") + page[page.index(end) + len(end):]
    else:
        page = page.rstrip("\n") + "\n\n" + section
    path.write_text(page.rstrip("\n") + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="where the slab lives: cpu or cuda")
    parser.add_argument("--min-run-time", type=float, default=1.0,
                        help="seconds each timing runs for (more is steadier)")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help=f"results page to update (default: {RESULTS.relative_to(ROOT)})")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs alone")
    args = parser.parse_args()

    console = Console()
    device = torch.device(args.device)
    torch.manual_seed(0)
    slab = torch.randn(ROWS, HIDDEN, device=device)
    console.print(f"slab [{ROWS}, {HIDDEN}] float32 on {device_description(device)}, "
                  f"torch {torch.__version__}")
    with console.status("per-call costs"):
        per_call = per_call_costs(slab, args.min_run_time)
    show(console, "Per-call cost", PER_CALL_HEADER, per_call)
    with console.status(f"vectorised against a loop over {REQUESTS} requests"):
        vectorised = vectorised_against_loop(slab, args.min_run_time)
    show(console, "Vectorised against a loop", VECTOR_HEADER, vectorised)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_section(args.out, device, results_section(device, per_call, vectorised))
        console.print(f"updated the {device.type} section of {args.out}")


if __name__ == "__main__":
    main()
