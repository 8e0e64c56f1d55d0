"""The `vllm-interp` command: `--help` for each subcommand, `support`'s table, bad arguments
refused before any engine starts, and `demo` end to end on the embedded model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from vllm_runner.cli import build_parser, support_table

COMMAND = [sys.executable, "-m", "vllm_runner.cli"]


@pytest.mark.parametrize("subcommand", ["demo", "extract", "support"])
def test_every_subcommand_has_help(subcommand: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([subcommand, "--help"])
    assert exit_info.value.code == 0
    assert "--model" in capsys.readouterr().out


def test_bad_positions_are_refused_by_the_parser(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["extract", "--prompts", "p", "--save", "x", "--out", "o",
                                   "--positions", "last"])
    assert "comma-separated integers" in capsys.readouterr().err


def test_support_table_groups_layers_and_gives_reasons(llm) -> None:
    table = support_table(llm.support())
    lines = {line.split()[0]: line for line in table.splitlines()[1:] if not line.startswith(" ")}
    assert lines["layer_output"].split()[-1] == "0-2"
    assert lines["logits"].split()[-1] == "model"
    assert lines["mlp.mlp_activation"].split()[-1] == "-"
    assert "not gated" not in table and "this MLP is gated" in table


def test_demo_runs_end_to_end_on_the_embedded_model(tmp_path) -> None:
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                   "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_INTERP_CACHE": str(tmp_path / "cache")}
    completed = subprocess.run([*COMMAND, "demo", "--out", str(tmp_path / "demo")],
                               env=environment, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "1. Steering at layers." in completed.stdout
    assert "2. Logit lens" in completed.stdout
    for figure in ("logit_lens.png", "attention_pattern.png"):
        data = (tmp_path / "demo" / figure).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000, figure
    print(completed.stdout)
