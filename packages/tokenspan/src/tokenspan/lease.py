"""`lease`: a request's rows handed out safely, with edits written back only when there are any."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from tokenspan.narrowing import apply_writes, leaf_axis, narrow, plan_writes
from tokenspan.tree import Path, iter_leaves

if TYPE_CHECKING:
    from types import TracebackType

    from tokenspan.layout import StepLayout
    from tokenspan.span import Span

ReadMode = Literal["lease", "copy", "view"]
READ_MODES: tuple[str, ...] = get_args(ReadMode)


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place edit counter; `None` for inference tensors, which have none."""
    try:
        return tensor._version
    except RuntimeError:
        return None


class Lease:
    """A request's rows of a value, lent to code that may keep or edit them.

    `value` starts as `narrow(whole, span, layout)`, private or not according to `mode`:

    - `"lease"` (default): a private copy. Kept references are never overwritten by the engine,
      and edits — in place or by assigning `lease.value` — are written back by `commit()`.
    - `"copy"`: a private copy; only assignment (a replaced value or leaf) is written back.
    - `"view"`: a view into the slab; in-place edits land at once, assignment on `commit()`.

    `commit()` writes only leaves that were replaced or, in lease mode, edited in place (their
    version counter moved), so an untouched lease costs one copy of the span and writes nothing.
    It is also a context manager that commits when its block ends without an exception.
    """

    __slots__ = ("_axis", "_layout", "_mode", "_originals", "_span", "_whole", "value")

    def __init__(
        self,
        whole: Any,
        span: Span,
        layout: StepLayout,
        mode: ReadMode = "lease",
        axis: int | None = None,
    ) -> None:
        if mode not in READ_MODES:
            raise ValueError(f"read mode must be one of {READ_MODES}, got {mode!r}")
        self._whole = whole
        self._span = span
        self._layout = layout
        self._mode = mode
        self._axis = axis
        self.value = narrow(whole, span, layout, copy=mode != "view", axis=axis)
        self._record()

    def _record(self) -> None:
        """Remember the current value's per-token leaves and their versions, by path."""
        if isinstance(self.value, torch.Tensor):
            self._originals: Any = (self.value, _version(self.value))
            return
        self._originals = {
            path: (leaf, _version(leaf))
            for path, leaf in iter_leaves(self.value)
            if isinstance(leaf, torch.Tensor)
        }

    def _leaf_changed(self, path: Path, leaf: Any) -> bool:
        if isinstance(self._originals, tuple):
            original = self._originals if path == () else None
        else:
            original = self._originals.get(path)
        if original is None or leaf is not original[0]:
            return True
        if self._mode != "lease":
            return False
        version = original[1]
        return version is None or _version(leaf) != version

    @property
    def mode(self) -> ReadMode:
        """How the value was lent: `"lease"`, `"copy"` or `"view"`."""
        return self._mode

    @property
    def changed(self) -> bool:
        """Whether `commit()` would write anything (without validating shapes)."""
        return any(
            self._leaf_changed(path, leaf)
            for path, leaf in iter_leaves(self.value)
            if isinstance(leaf, torch.Tensor)
            and leaf_axis(leaf, self._layout, self._axis) is not None
        )

    def commit(self) -> bool:
        """Write replaced or edited leaves back into the slab; return whether anything was written.

        Shapes are checked before any write (`SpanShapeError`). Later commits write only what
        changed since the previous one.
        """
        value = self.value
        single = isinstance(value, torch.Tensor) and isinstance(self._originals, tuple)
        if single and not self._leaf_changed((), value):
            return False
        writes = plan_writes(
            self._whole, self._span, self._layout, value, self._axis, self._leaf_changed
        )
        apply_writes(writes)
        self._record()
        return bool(writes)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()


def lease(
    whole: Any, span: Span, layout: StepLayout, mode: ReadMode = "lease", axis: int | None = None
) -> Lease:
    """Lend `span`'s rows of `whole` to user code; see `Lease` for the three read modes."""
    return Lease(whole, span, layout, mode=mode, axis=axis)
