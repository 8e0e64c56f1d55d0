"""Two rules of the rooms that import-linter cannot check: an op's behaviour lives with its
class (no `isinstance` on an op class outside `ops/`), and the engine adapters and the worker's
RPCs use the runtime only through its door (`runtime.door`), which `Runtime` implements."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import vllm_runner
from vllm_runner import ops
from vllm_runner.runtime.door import EngineDoor, StepDoor, WorkerDoor
from vllm_runner.runtime.runtime import Runtime

PACKAGE = Path(vllm_runner.__file__).parent


def _op_class_names() -> set[str]:
    """Every op class's name: the public ops, their bases, and the worker's own ops."""
    found: set[str] = set()
    pending = [ops.Op]
    while pending:
        cls = pending.pop()
        found.add(cls.__name__)
        pending.extend(cls.__subclasses__())
    return found


def _names_in(node: ast.expr) -> set[str]:
    """The class names an `isinstance` second argument names (`A`, `ops.A`, `(A, B)`, `A | B`)."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Tuple):
        return {name for element in node.elts for name in _names_in(element)}
    if isinstance(node, ast.BinOp):
        return _names_in(node.left) | _names_in(node.right)
    return set()


def test_no_isinstance_on_an_op_class_outside_ops() -> None:
    op_classes = _op_class_names()
    assert {"Save", "Add", "Call", "EditOp", "PatternOutput"} <= op_classes  # the check can fail
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "ops":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in {"isinstance", "issubclass"} and len(node.args) == 2
                    and (named := _names_in(node.args[1]) & op_classes)):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {sorted(named)}")
    assert not found, "an op's behaviour belongs on its class (ops/): " + ", ".join(found)


def _members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")} | set(
        getattr(protocol, "__annotations__", {}))


def test_runtime_implements_every_member_of_its_door() -> None:
    members = _members(StepDoor) | _members(WorkerDoor)
    assert {"begin_step", "graph_need", "end_step", "collect"} <= members
    for name in members:
        assert hasattr(Runtime, name) or name in {"refused_taps", "forwards", "compiled"}, name
    for name in _members(StepDoor) - {"compiled", "taps", "every_program_acts", "any_failed"}:
        door = inspect.signature(getattr(StepDoor, name))
        runtime = inspect.signature(getattr(Runtime, name))
        assert list(door.parameters) == list(runtime.parameters), name
    assert {StepDoor, WorkerDoor} <= set(EngineDoor.__mro__)
