"""The stack's static types: mypy over every package's `src/` (settings in the root
pyproject.toml: the lower packages strict), as `nox -s typecheck` runs it. It runs here because
this package's test environment is the one that already holds all four packages, vLLM and
torch, whose own annotations are what the code is checked against; CI saves a whole
environment's install this way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[3]


def test_every_package_type_checks(tmp_path: Path) -> None:
    sources = sorted(str(path) for path in (ROOT / "packages").glob("*/src") if path.is_dir())
    assert len(sources) == 4, sources
    # One run over all four: torch and vLLM are analysed once (55 s here, not 68 s).
    ran = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                          str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "mypy"),
                          *sources], capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, f"{ran.stdout[-6000:]}{ran.stderr[-2000:]}"
