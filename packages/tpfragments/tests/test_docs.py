"""The README's and the documentation page's examples run as written."""

from __future__ import annotations

import doctest
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tpf_ranks import free_port

PACKAGE = Path(__file__).resolve().parents[1]
DOCS_PAGE = PACKAGE.parents[1] / "docs" / "tpfragments.md"


def _doctest(path: Path) -> None:
    result = doctest.testfile(str(path), module_relative=False, report=True,
                              optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{path.name} has no examples"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {path} failed"


def test_readme_examples() -> None:
    _doctest(PACKAGE / "README.md")


def _docs_page() -> str:
    if not DOCS_PAGE.exists():
        pytest.skip("docs/tpfragments.md lies outside the package; run from a repository checkout")
    return DOCS_PAGE.read_text()


def test_documentation_page_examples() -> None:
    _docs_page()
    _doctest(DOCS_PAGE)


def test_documentation_page_script_with_real_processes(tmp_path: Path) -> None:
    page = _docs_page()
    match = re.search(r"<!-- script: (\S+) -->\n```python\n(.*?)```", page, re.DOTALL)
    assert match, "the page's multi-process script is missing"
    name, script = match.groups()
    (tmp_path / name).write_text(script.replace("29517", str(free_port())))
    result = subprocess.run([sys.executable, name], cwd=tmp_path, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
