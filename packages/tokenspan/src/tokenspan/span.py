"""`Span`: the rows one request owns in a flat token slab, and the positions they stand for."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from tokenspan.errors import LayoutError

#: A request's key in a step layout: anything hashable (vLLM's request ids are strings).
Key = Hashable


@dataclass(frozen=True, slots=True)
class Span:
    """Rows `[start, stop)` of a flat token slab, holding absolute positions from `first_position`.

    Under continuous batching one request owns a contiguous run of rows in each step's slab, and
    those rows stand for positions `first_position, first_position + 1, ...` of its sequence (a
    chunked prefill resumes mid-prompt; a decode step is a single row at the sequence's end).
    Keeping the row range and the absolute position together is what lets values collected over
    many steps be keyed by position rather than by step.
    """

    start: int
    stop: int
    first_position: int = 0

    def __post_init__(self) -> None:
        if self.start < 0:
            raise LayoutError(f"a span cannot start at a negative row ({self.start})")
        if self.stop < self.start:
            raise LayoutError(
                f"a span cannot end (row {self.stop}) before it starts (row {self.start})"
            )
        if self.first_position < 0:
            raise LayoutError(f"a span's first position must be >= 0, got {self.first_position}")

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def rows(self) -> slice:
        """The span as a slice over the token axis, for plain indexing."""
        return slice(self.start, self.stop)

    @property
    def last_position(self) -> int:
        """The absolute position of the span's last row (`first_position - 1` when empty)."""
        return self.first_position + len(self) - 1

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The absolute position of each row, as an int64 tensor of length `len(self)`."""
        return torch.arange(
            self.first_position, self.first_position + len(self), dtype=torch.long, device=device
        )
