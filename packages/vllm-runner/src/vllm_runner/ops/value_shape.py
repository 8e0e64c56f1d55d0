"""A value's shape as the server knows it before a request runs, and the rule an op's tensor
must meet to fit it: what `Op.tensor_misfit` and `Op.saved_bytes` work on.

The shapes come from the engine itself (one request of one token that saves every value:
`server.state`); here they are plain data, so each op states its own rule next to its other
behaviour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ValueShape:
    """A value as saved for a one-token prompt: its axis names, its sizes (the tokens axis, or
    a pattern's query and key axes, at 1) and the bytes of one element as saved."""

    layout: tuple[str, ...]
    shape: tuple[int, ...]
    itemsize: int = 4

    @property
    def token_axis(self) -> int | None:
        """The axis that runs along tokens; `None` for a pattern (query by key)."""
        return self.layout.index("tokens") if "tokens" in self.layout else None

    def describe(self) -> str:
        """The shape with its axis names, the tokens axis left open, e.g. `[1 tokens 576]`."""
        sizes = ["tokens" if axis == self.token_axis else str(size)
                 for axis, size in enumerate(self.shape)]
        return "[" + " ".join(sizes) + "] (" + " ".join(self.layout) + ")"

    def bytes_per_row(self) -> int:
        """Bytes saved per token (per query-key pair for a pattern)."""
        return math.prod(self.shape) * self.itemsize


def broadcast_misfit(given: tuple[int, ...], location: str, value: ValueShape) -> str | None:
    """Why a tensor of shape `given` does not broadcast over `value` (at `location`) at any
    token count, or `None`: more axes than the value never fit (as in the worker), and each
    trailing axis but the tokens axis must be 1 or the value's size."""
    token_axis = value.token_axis
    fits = len(given) <= len(value.shape)
    for offset in range(1, min(len(given), len(value.shape)) + 1):
        axis = len(value.shape) - offset
        if axis != token_axis and given[-offset] not in (1, value.shape[axis]):
            fits = False
    if fits:
        return None
    return (f"has shape {list(given)}, which does not broadcast over {location} "
            f"{value.describe()}: give e.g. [{value.shape[-1]}] for one vector along its last "
            "axis")
