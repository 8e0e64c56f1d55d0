"""`lease` and `lend`: values handed to user code safely, with edits written back only when there
are any.

`lease` lends a request's rows of a slab and writes changes back itself (`Lease.commit`); `lend`
lends one tensor the caller already holds (say, a value decoded from the rows) and says what to
write back (`Lent.written`). Both judge in-place edits by the tensor's version counter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from tokenspan.errors import SpanShapeError
from tokenspan.narrowing import apply_writes, leaf_axis, narrow, plan_writes, private_copy
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


def _edited_in_place(tensor: torch.Tensor, version: int | None) -> bool:
    """Whether `tensor`, whose counter read `version` when it was lent, was edited in place since.

    A tensor without a counter (`version` is `None`: made under `torch.inference_mode()`) may
    have been edited, and is counted as edited.
    """
    return version is None or _version(tensor) != version


def _check_mode(mode: str) -> None:
    if mode not in READ_MODES:
        raise ValueError(f"read mode must be one of {READ_MODES}, got {mode!r}")


# What a lease remembers of a per-token leaf it lent: the leaf and its version counter then.
_Lent = tuple[torch.Tensor, int | None]


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
        _check_mode(mode)
        self._whole = whole
        self._span = span
        self._layout = layout
        self._mode = mode
        self._axis = axis
        self.value = narrow(whole, span, layout, copy=mode != "view", axis=axis)
        self._record()

    def _record(self) -> None:
        """Remember the current value's per-token leaves and their versions, by path."""
        self._originals: _Lent | dict[Path, _Lent]
        if isinstance(self.value, torch.Tensor):
            self._originals = (self.value, _version(self.value))
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
        return self._mode == "lease" and _edited_in_place(leaf, original[1])

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


class Lent:
    """One tensor lent to user code, and what to write back once the code has run.

    Made by `lend`. `value` is what the code gets: the tensor itself in `"view"` mode, a private
    copy (with a working version counter, even under `torch.inference_mode()`) in `"copy"` and
    `"lease"` mode. After the code ran and returned `result`, `written(result)` says what the
    caller should write back, if anything. `owned=True` says the tensor is a private copy
    already (e.g. a value decoded from the slab), so it is lent as it is, without a second copy;
    its in-place edits are seen if it has a version counter (made outside inference mode).
    """

    __slots__ = ("_counter", "mode", "value")

    def __init__(self, tensor: torch.Tensor, mode: ReadMode = "lease", owned: bool = False) -> None:
        _check_mode(mode)
        self.mode: ReadMode = mode
        self.value = tensor if mode == "view" or owned else private_copy(tensor)
        self._counter = _version(self.value) if mode == "lease" else None

    def written(self, result: object) -> torch.Tensor | None:
        """What to write back after user code given `value` returned `result`, or `None`.

        - a replacement: `result` when it is neither `None` nor `value` itself, in every mode;
        - in `"lease"` mode, `value` itself when it was edited in place (its version counter
          moved, or it has none);
        - otherwise `None`: in `"copy"` mode in-place edits are ignored, and in `"view"` mode
          they already landed in the lent tensor.

        A replacement that is not a tensor raises `SpanShapeError`.
        """
        if result is not None and result is not self.value:
            if not isinstance(result, torch.Tensor):
                raise SpanShapeError(
                    f"expected a tensor of shape {tuple(self.value.shape)} or None back, got "
                    f"{type(result).__name__}"
                )
            return result
        if self.mode == "lease" and _edited_in_place(self.value, self._counter):
            return self.value
        return None

    def __repr__(self) -> str:
        return f"Lent({self.mode}, {tuple(self.value.shape)})"


def lend(tensor: torch.Tensor, mode: ReadMode = "lease", owned: bool = False) -> Lent:
    """Lend `tensor` to user code in a read mode; `Lent.written` says what to write back.

    `"view"` lends `tensor` as is (in-place edits land in it at once); `"copy"` and `"lease"`
    lend a private copy, whose in-place edits `written` reports in `"lease"` mode only — or,
    with `owned=True`, the tensor itself, when it is the caller's private copy already.
    """
    return Lent(tensor, mode, owned)
