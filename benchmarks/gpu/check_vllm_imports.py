"""Every `vllm` import in our code, checked against the source of a vLLM release that cannot be
imported here (the GPU build), before device time is spent finding a moved name.

    python benchmarks/gpu/check_vllm_imports.py VLLM_SOURCE [PATHS...]

VLLM_SOURCE is the folder holding the release's `vllm/` package, e.g. the staged wheel unpacked:
`cat .gpu-stage-033/part* | tar x ./vllm-0.33.0-*.whl && python -m zipfile -e vllm-*.whl src`
then `src`. PATHS default to every package's `src/` and `tests/`, and `benchmarks/`. Prints
one line per import that names a missing module or a name its module does not define, and
exits 1 if there is any. Checked by reading, not importing: a module that builds names at run
time is taken to define any name written in it as a string (lazy `__getattr__` tables), and a
star import is taken to define everything. A file that names the vLLM module it adapts
(`ADAPTED_MODULE = "vllm...."`, e.g. the V1 runner's adapter) is skipped where the release has
no such module: it is never imported there.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module_file(source: Path, module: str) -> Path | None:
    base = source.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _defines(path: Path, name: str) -> bool:
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                return True
        elif isinstance(node, ast.Assign):
            if any(isinstance(target, ast.Name) and target.id == name for target in node.targets):
                return True
        elif isinstance(node, ast.AnnAssign):
            if isinstance(node.target, ast.Name) and node.target.id == name:
                return True
        elif isinstance(node, ast.Import | ast.ImportFrom) and any(
                alias.name == "*" or (alias.asname or alias.name.split(".")[-1]) == name
                for alias in node.names):
            return True
    return f"'{name}'" in text or f'"{name}"' in text


def _import_problems(source: Path, path: Path, node: ast.AST) -> list[str]:
    found = []
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
        module = _module_file(source, node.module)
        if module is None:
            return [f"{path}:{node.lineno}: no module {node.module}"]
        for alias in node.names:
            if (_module_file(source, f"{node.module}.{alias.name}") is None
                    and not _defines(module, alias.name)):
                found.append(f"{path}:{node.lineno}: {node.module} has no {alias.name}")
    elif isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == "vllm" and _module_file(source, alias.name) is None:
                found.append(f"{path}:{node.lineno}: no module {alias.name}")
    return found


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    caught = handler.type
    names = caught.elts if isinstance(caught, ast.Tuple) else [caught]
    return any(isinstance(name, ast.Name) and name.id in ("ImportError", "ModuleNotFoundError")
               for name in names)


def _adapted_module(tree: ast.Module) -> str | None:
    """The vLLM module a file says it adapts (`ADAPTED_MODULE = "..."` at its top level)."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
                and any(isinstance(target, ast.Name) and target.id == "ADAPTED_MODULE"
                        for target in node.targets)):
            return node.value.value
    return None


def problems(source: Path, path: Path) -> list[str]:
    """What in one of our files imports from vLLM a module or name that `source` lacks. Imports
    in a `try` that falls back on `ImportError` are alternatives: one that resolves is enough."""
    found: list[str] = []
    seen: set[int] = set()
    tree = ast.parse(path.read_text())
    adapted = _adapted_module(tree)
    if adapted is not None and _module_file(source, adapted) is None:
        return []  # an adapter for a runner this release does not have: never imported
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(map(_catches_import_error, node.handlers)):
            branches = [node.body, *(handler.body for handler in node.handlers)]
            reports = []
            for branch in branches:
                imports = [inner for statement in branch for inner in ast.walk(statement)
                           if isinstance(inner, ast.Import | ast.ImportFrom)]
                seen.update(map(id, imports))
                reports.append([line for inner in imports
                                for line in _import_problems(source, path, inner)])
            if all(reports):
                found += [line for report in reports for line in report]
    for node in ast.walk(tree):
        if id(node) not in seen:
            found += _import_problems(source, path, node)
    return found


def main(arguments: list[str]) -> int:
    """Check the given paths (or the default ones) and print what is missing."""
    if not arguments or not (Path(arguments[0]) / "vllm" / "__init__.py").exists():
        print(__doc__, file=sys.stderr)
        return 2
    source = Path(arguments[0])
    roots = [Path(path) for path in arguments[1:]] or [
        *ROOT.glob("packages/*/src"), *ROOT.glob("packages/*/tests"), ROOT / "benchmarks"]
    found = [line for root in roots for path in sorted(root.rglob("*.py"))
             for line in problems(source, path)]
    print("\n".join(found) or f"every vllm import found in {source}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
