"""The README's example, as a user runs it: saved as `example.py` and run with this
environment's Python in an empty folder; it prints what the README's comments say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_the_readme_example_runs_as_written(tmp_path: Path) -> None:
    (block,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (tmp_path / "example.py").write_text(block)
    result = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"token 0: \d+ features kept of 512", lines[0]), lines
    assert int(lines[0].split()[2]) <= 16
    assert lines[1] == "None"
    assert (tmp_path / "my-sae" / "cfg.json").is_file()
    assert (tmp_path / "features.safetensors").is_file()
