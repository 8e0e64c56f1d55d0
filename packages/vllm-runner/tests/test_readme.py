"""The README's tour runs as a user runs it (issue [H] item 2): saved as `tour.py` and run with
`python tour.py`, and pasted into Python's interactive prompt, in this environment with no
variable the README does not set — and it prints what the README says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import python_blocks, user_environment

README = Path(__file__).parents[3] / "README.md"


def promised(tour: str) -> list[str]:
    """What the tour's comments say its `print` lines print (their first line)."""
    return [comment.split(r"\n")[0] for comment in re.findall(r"^print\(.*#\s?(.*)$", tour, re.M)]


@pytest.mark.parametrize("how", ["script", "interactive"])
def test_the_readme_tour_runs_and_prints_what_it_says(tmp_path, how) -> None:
    (tour,) = python_blocks(README)
    script = tmp_path / "tour.py"
    script.write_text(tour)
    if how == "script":
        completed = subprocess.run([sys.executable, "tour.py"], cwd=tmp_path,
                                   env=user_environment(), capture_output=True, text=True,
                                   timeout=600)
    else:  # what pasting it at the >>> prompt does, statement by statement
        completed = subprocess.run([sys.executable, "-i"], input=tour, cwd=tmp_path,
                                   env=user_environment(), capture_output=True, text=True,
                                   timeout=600)
    assert completed.returncode == 0 and "Traceback" not in completed.stderr, \
        completed.stderr[-4000:]
    printed = [line.rstrip() for line in completed.stdout.splitlines()]
    expected = promised(tour)
    assert len(expected) == 4
    for line in expected:
        assert line.rstrip() in printed, f"the README promises {line!r}; it printed:\n" + \
            "\n".join(line for line in printed if not line.startswith("("))
