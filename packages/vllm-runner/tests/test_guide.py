"""The user guide's examples run as a user runs them: every ```python block of
docs/vllm-runner.md, in order, saved as one script and run with `python guide.py`, and pasted
into Python's interactive prompt — on the tiny model (as `MODEL`), with no environment variable
the guide does not set — so the page cannot drift from the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import python_blocks, user_environment

GUIDE = Path(__file__).parents[3] / "docs" / "vllm-runner.md"
DONE = "GUIDE OK"


@pytest.mark.parametrize("how", ["script", "interactive"])
def test_every_guide_example_runs(model_dir: str, tmp_path, how) -> None:
    blocks = python_blocks(GUIDE)
    assert len(blocks) >= 10, "the guide lost its examples"
    # Blocks end with a blank line: at the >>> prompt, that is what ends an indented block.
    text = f"MODEL = {model_dir!r}\n\n" + "\n".join(blocks) + f"\nprint({DONE!r})\n"
    (tmp_path / "guide.py").write_text(text)
    command = [sys.executable, "guide.py"] if how == "script" else [sys.executable, "-i"]
    completed = subprocess.run(command, input=None if how == "script" else text, cwd=tmp_path,
                               env=user_environment(), capture_output=True, text=True,
                               timeout=600)
    assert DONE in completed.stdout and "Traceback" not in completed.stderr, \
        completed.stderr[-5000:]
