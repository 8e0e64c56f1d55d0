"""The ops a compiled graph runs itself at one tapped value (`compiled.in_graph`): at most a
`ProjectOut`, then `Add`s, then `Save`s, in program order. Which ops those are is the ops'
own business, so it is said here, once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vllm_runner.ops import Add, Op, ProjectOut, Save


@dataclass(frozen=True)
class GraphOps:
    """A program's ops at one location split by what the graph does for each: ablations
    (`ProjectOut`), then steering (`Add`), then the copy for saves (`Save`)."""

    ablations: tuple[ProjectOut, ...]
    adds: tuple[Add, ...]
    saves: tuple[Save, ...]

    @classmethod
    def of(cls, ops: Iterable[Op]) -> GraphOps | None:
        """`ops` split, or `None` where one is of another kind or they come in another order
        (a `Save` before an `Add`: the graph runs them in the order above)."""
        ops = list(ops)
        ablations = tuple(op for op in ops if isinstance(op, ProjectOut))
        adds = tuple(op for op in ops if isinstance(op, Add))
        saves = tuple(op for op in ops if isinstance(op, Save))
        in_order = [*ablations, *adds, *saves]
        if len(in_order) != len(ops) or any(op is not wanted
                                            for op, wanted in zip(ops, in_order, strict=True)):
            return None
        return cls(ablations, adds, saves)
