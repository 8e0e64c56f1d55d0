"""docs/vllm-runner-internals.md's map lists every module of vllm_runner, and only those: a
newcomer finds each file's room and job there."""

from __future__ import annotations

import re
from pathlib import Path

import vllm_runner

ROOT = Path(__file__).parents[3]
PACKAGE = Path(vllm_runner.__file__).parent


def test_the_map_lists_every_module_and_only_existing_ones() -> None:
    text = (ROOT / "docs" / "vllm-runner-internals.md").read_text()
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", text, re.M))
    rooms = set(re.findall(r"^\| \*\*`(\w+)/`\*\* \|", text, re.M))
    modules = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
               if path.name not in {"__init__.py", "__main__.py"} or path.parent == PACKAGE}
    assert listed == modules, (sorted(modules - listed), sorted(listed - modules))
    assert rooms == {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
