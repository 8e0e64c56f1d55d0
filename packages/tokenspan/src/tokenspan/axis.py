"""`token_axis`: where a tensor keeps its per-token rows, if it has them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenspan.errors import SpanShapeError

if TYPE_CHECKING:  # annotations only: layout imports this module, not the other way round
    from tokenspan.layout import StepLayout


def token_axis(value: object, layout: StepLayout) -> int | None:
    """The axis along which `value` holds one row per token of the step, or `None`.

    Recognised: `[tokens, ...]` (axis 0; vLLM's flat slab), `[1, tokens, ...]` (axis 1; engines
    that keep a singleton batch axis), and either of those with `layout.padded_total` rows
    instead of `layout.total` (a slab padded for a CUDA graph bucket). Anything else — weights,
    scalars, metadata, non-tensors — is not per-token and returns `None`, so nested outputs can
    be walked and only their per-token parts touched.

    This is a test of shape alone: hand it activations, not parameters, or pass `axis=`
    explicitly where a parameter could share the token count. Axis 0 wins when both readings
    fit, which only happens in a one-token step (`[1, n, ...]` with `n` the padded total).
    """
    if not isinstance(value, torch.Tensor):
        return None
    shape = value.shape
    if not shape:
        return None
    total, padded_total = layout.total, layout.padded_total
    if shape[0] == total or shape[0] == padded_total:
        return 0
    if len(shape) >= 2 and shape[0] == 1 and (shape[1] == total or shape[1] == padded_total):
        return 1
    return None


def require_token_axis(value: torch.Tensor, layout: StepLayout, axis: int | None) -> int:
    """The token axis of a tensor the caller says is per-token; a clear error if it is not."""
    if axis is None:
        found = token_axis(value, layout)
        if found is None:
            raise SpanShapeError(
                f"a tensor of shape {tuple(value.shape)} has no token axis for a step of "
                f"{layout.total} rows ({layout.padded_total} padded); expected [tokens, ...] or "
                "[1, tokens, ...], or pass axis= explicitly"
            )
        return found
    if not -value.dim() <= axis < value.dim():
        raise SpanShapeError(f"axis {axis} is out of range for a tensor of shape "
                             f"{tuple(value.shape)}")
    axis %= value.dim()
    if value.shape[axis] < layout.total:
        raise SpanShapeError(
            f"axis {axis} of a tensor of shape {tuple(value.shape)} has "
            f"{value.shape[axis]} rows, fewer than the step's {layout.total} tokens"
        )
    return axis
