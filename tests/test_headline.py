"""benchmarks/headline.py's table: the GPU runs' result files become docs/benchmarks.md's top
table, a shape's arms merged over the calls that measured them, targets judged on medians, and
nothing of the page outside the markers touched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import headline  # noqa: E402 (the benchmarks folder is on the path now)


def _arm(ratios: list[float], saved: int = 0) -> dict[str, Any]:
    return {"ratios": ratios, "seconds": [2.0] * len(ratios), "default_seconds": [1.6, 1.5, 1.7],
            "collecting": [0.1] * len(ratios), "saved_bytes": [saved] * len(ratios)}


def _run(arms: dict[str, Any], commit: str, shape: str = "llama-3.1-8b") -> dict[str, Any]:
    return {"shape": shape, "name": headline.SHAPES[shape], "commit": commit, "date": "2026-12-07",
            "device": "NVIDIA H100 80GB HBM3", "vllm": "0.34.0", "torch": "2.14.0+cu130",
            "workload": {"requests": 256, "prompt_tokens": 512, "max_tokens": 128,
                         "repeats": 3}, "host_copy_gbps": 50.0, "arms": arms}


def test_the_table_merges_a_shapes_calls_and_judges_medians_against_targets() -> None:
    first = _run({"none": _arm([0.99, 0.97, 1.01]),
                  "extract": _arm([0.8, 0.9, 0.84], 4_000_000_000)}, "abc1234")
    second = _run({"steer": _arm([0.9, 0.95, 0.96]), "twin": _arm([1.0, 0.98, 1.02])}, "def5678")
    moe = _run({"none": _arm([0.96, 0.97, 0.98])}, "abc1234", "qwen3-30b-a3b-12l")
    table = headline.render([moe, second, first])
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()
            if line.startswith("| ")}
    # One column pair per shape, in SHAPES' order whatever the files' order.
    assert rows["arm"].index("Llama-3.1-8B") < rows["arm"].index("Qwen3-30B-A3B")
    # Only the target shape's ratios are judged: the targets are set for it.
    assert rows["none"].endswith("| **0.99** (0.97-1.01) | met | **0.97** (0.96-0.98) |")
    assert rows["extract"].endswith("| **0.84** (0.80-0.90) | **not met** | — |")
    assert "**0.95** (0.90-0.96) | **not met**" in rows["steer"]
    assert "A/A control" in rows["twin"] and "**1.00** (0.98-1.02)" in rows["twin"]
    assert "probe" not in rows  # measured by no run
    # Each call's run is named with its commit; the saving arm's bytes against the copy ceiling.
    assert "none, extract: NVIDIA H100 80GB HBM3, vLLM 0.34.0" in table
    assert "commit abc1234" in table and "commit def5678" in table
    assert "extract saves 4.00 GB a run: 2.00 GB/s over its run" in table
    assert "GPU-to-pinned-host copy: 50.0 GB/s" in table


def test_rendering_replaces_only_the_table_between_the_markers(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "llama-3.1-8b-a.json").write_text(json.dumps(_run({"none": _arm([1.0] * 3)},
                                                                 "abc1234")))
    page = tmp_path / "docs" / "benchmarks.md"
    (page.parent / "benchmarks").mkdir(parents=True)
    page.write_text(f"# Before\n\n{headline.START}\nold table\n{headline.END}\n\n## After\n")
    headline.write_table(results, page)
    text = page.read_text()
    assert text.startswith(f"# Before\n\n{headline.START}\n| arm |")
    assert text.endswith(f"{headline.END}\n\n## After\n")
    assert "old table" not in text and "interp-engine 1.14.2" in text  # theirs, marked
    assert (page.parent / "benchmarks" / "headline.png").stat().st_size > 0


def test_a_page_without_markers_or_a_folder_without_results_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="no results"):
        headline.write_table(tmp_path, page)
    (tmp_path / "run.json").write_text(json.dumps(_run({"none": _arm([1.0] * 3)}, "abc")))
    with pytest.raises(SystemExit, match="no headline markers"):
        headline.write_table(tmp_path, page)
    assert page.read_text() == "# no markers\n"


def test_an_unknown_arm_is_refused_by_name_before_anything_starts() -> None:
    ran = subprocess.run([sys.executable, str(BENCHMARKS / "headline.py"), "--arms", "none,stear"],
                         capture_output=True, text=True, check=False, timeout=300)
    assert ran.returncode != 0
    assert "unknown arms ['stear']" in ran.stderr
