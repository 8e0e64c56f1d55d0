"""`narrow` and `widen`: a request's rows out of a slab, and replaced rows back into it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tokenspan.axis import require_token_axis, token_axis
from tokenspan.errors import LayoutError, SpanShapeError
from tokenspan.tree import Path, describe_path, map_leaves, same_leaf, zip_leaves

if TYPE_CHECKING:
    from tokenspan.layout import StepLayout
    from tokenspan.span import Span


def check_span(span: Span, layout: StepLayout) -> None:
    """Refuse a span that reaches past the step's real rows (e.g. kept from an earlier step)."""
    if span.stop > layout.total:
        raise LayoutError(
            f"span rows {span.start}:{span.stop} reach beyond this step's {layout.total} token "
            "rows; spans must come from the current step's layout"
        )


def leaf_axis(leaf: Any, layout: StepLayout, axis: int | None) -> int | None:
    """The token axis of one leaf: detected, or `axis` when the caller fixed it for tensors."""
    if axis is None or not isinstance(leaf, torch.Tensor):
        return token_axis(leaf, layout)
    return require_token_axis(leaf, layout, axis)


def private_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A clone that tracks in-place edits, even when made under `torch.inference_mode()`.

    Tensors created in inference mode have no version counter, and engines run their forward in
    inference mode; a copy made outside it keeps one, so edits to it can be detected.
    """
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return tensor.clone()
    return tensor.clone()


def narrow(
    value: Any, span: Span, layout: StepLayout, copy: bool = False, axis: int | None = None
) -> Any:
    """The rows of `span` from every per-token tensor in `value`; other leaves pass through.

    `value` may be a tensor or a nested tuple, list or dict (a module's output). Per-token
    tensors are found with `token_axis` (or `axis`, if given, for every tensor leaf). Without
    `copy` the result shares storage with `value` (a view: in-place edits land in the slab and
    the engine may later overwrite it); with `copy` each narrowed tensor is a private clone with
    a working version counter. dtype and device are preserved; padded rows are never included.
    """
    check_span(span, layout)
    start, length = span.start, span.stop - span.start

    def narrow_leaf(_: Path, leaf: Any) -> Any:
        leaf_ax = leaf_axis(leaf, layout, axis)
        if leaf_ax is None:
            return leaf
        rows = leaf.narrow(leaf_ax, start, length)
        return private_copy(rows) if copy else rows

    if isinstance(value, torch.Tensor):
        return narrow_leaf((), value)
    return map_leaves(narrow_leaf, value)


Write = tuple[torch.Tensor, torch.Tensor]


def plan_writes(
    whole: Any,
    span: Span,
    layout: StepLayout,
    part: Any,
    axis: int | None = None,
    should_write: Callable[[Path, Any], bool] | None = None,
    written_rows: torch.Tensor | None = None,
) -> list[Write]:
    """Validate `part` against `span` of `whole` and list the `(destination, source)` copies.

    Nothing is written here, so a caller can refuse the whole write when any leaf is wrong.
    `should_write(path, part_leaf)` lets a lease skip leaves it knows are unchanged. A source
    that is the destination itself (an unreplaced view) is skipped; one that shares memory with
    the slab is cloned first, since an overlapping copy is undefined. With `written_rows` (see
    `widen`) a source is `part`'s rows where it is true and the slab's own elsewhere.
    """
    check_span(span, layout)
    writes: list[Write] = []
    for path, part_leaf, whole_leaf in zip_leaves(part, whole):
        whole_ax = leaf_axis(whole_leaf, layout, axis)
        if whole_ax is None:
            if not same_leaf(part_leaf, whole_leaf):
                raise SpanShapeError(
                    f"at {describe_path(path)}: this part of the value is not per-token, so it "
                    "cannot be written through a span; leave it as it was"
                )
            continue
        if should_write is not None and not should_write(path, part_leaf):
            continue
        destination = whole_leaf.narrow(whole_ax, span.start, len(span))
        if not isinstance(part_leaf, torch.Tensor):
            raise SpanShapeError(
                f"at {describe_path(path)}: expected a tensor of shape "
                f"{tuple(destination.shape)} for rows {span.start}:{span.stop}, got "
                f"{type(part_leaf).__name__}"
            )
        if part_leaf.shape != destination.shape:
            raise SpanShapeError(
                f"at {describe_path(path)}: expected shape {tuple(destination.shape)} for rows "
                f"{span.start}:{span.stop} ({len(span)} tokens), got {tuple(part_leaf.shape)}"
            )
        if written_rows is not None:
            part_leaf = torch.where(_along(written_rows, destination.dim(), whole_ax),
                                    part_leaf, destination)
        elif _is_same_view(part_leaf, destination):
            continue
        if _shares_memory(part_leaf, whole_leaf):
            part_leaf = part_leaf.clone()
        writes.append((destination, part_leaf))
    return writes


def apply_writes(writes: list[Write]) -> None:
    """Carry out copies planned by `plan_writes` (converting to the slab's dtype and device)."""
    for destination, source in writes:
        destination.copy_(source)


def widen(
    whole: Any,
    span: Span,
    layout: StepLayout,
    part: Any,
    axis: int | None = None,
    written_rows: torch.Tensor | None = None,
) -> None:
    """Write `part` (shaped like `narrow(whole, span, layout)`) into the span's rows of `whole`.

    Every leaf is checked before anything is written: a per-token leaf of the wrong shape, or a
    changed leaf that is not per-token, raises `SpanShapeError` naming the place and both
    shapes, and leaves `whole` untouched. Rows outside the span never change.

    `written_rows` (bool, one per row of the span, on the slab's device) writes only the rows
    where it is true; the others keep the slab's values. The choice is made on the device, so
    an engine can write what a check computed there allows without waiting for its answer.
    """
    apply_writes(plan_writes(whole, span, layout, part, axis, written_rows=written_rows))


def _along(rows: torch.Tensor, dims: int, axis: int) -> torch.Tensor:
    """`rows` (one value per row) shaped to broadcast along `axis` of a `dims`-axis tensor."""
    shape = [1] * dims
    shape[axis] = rows.shape[0]
    return rows.reshape(shape)


def _is_same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == (
        b.untyped_storage().data_ptr()
    )
