"""Saved values of every request in this worker, keyed by absolute position.

Preemption recomputes a request from position 0 and chunked prefill spreads a prompt over steps,
so rows are stored by (request key, location, absolute position) and the last write wins. On
collection they are put in position order and trimmed to what belongs to the final output.
"""

from __future__ import annotations

import io
from collections import defaultdict
from typing import Any

import torch

# Values without a token axis (the attention pattern) are stored whole under this position.
WHOLE = -1


class SaveStore:
    """Rows saved per request; freed when collected or dropped."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(
            lambda: defaultdict(dict))
        self._axes: dict[tuple[str, str], int | None] = {}
        self._errors: dict[str, str] = {}

    def fail(self, key: str, message: str) -> None:
        """Record why `key`'s program failed (the first failure is kept)."""
        self._errors.setdefault(key, message)

    def error(self, key: str) -> str | None:
        """Why `key`'s program failed, or `None`; forgotten once read."""
        return self._errors.pop(key, None)

    def save(self, key: str, location: str, first_position: int, value: torch.Tensor,
             token_axis: int | None) -> None:
        """Keep `value` (a private copy) for `key`, one row per absolute position."""
        self._axes[(key, location)] = token_axis
        rows = self._rows[key][location]
        if token_axis is None:
            rows[WHOLE] = value
            return
        for offset, row in enumerate(value.unbind(token_axis)):
            rows[first_position + offset] = row

    def collect(self, key: str, computed: int, wanted: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Everything saved for `key`, in position order, below position `computed`.

        `computed` is how many positions belong to the final output (prompt plus generated
        tokens but the last); rows beyond it came from steps the scheduler ran ahead.
        `wanted[location]` may hold `positions` (a set) and `steps` filters.
        """
        result: dict[str, torch.Tensor] = {}
        for location, rows in self._rows.pop(key, {}).items():
            axis = self._axes.pop((key, location), None)
            if axis is None:
                result[location] = rows[WHOLE].cpu()
                continue
            keep = [p for p in sorted(rows) if p < computed and wanted[location](p)]
            if keep:
                # On the host: the client's process may have no GPU, or another one.
                result[location] = torch.stack([rows[p] for p in keep], dim=axis).cpu()
        return result

    def drop(self, keys: list[str]) -> None:
        """Free what `keys` saved (aborted or abandoned requests)."""
        for key in keys:
            self._errors.pop(key, None)
            for location in self._rows.pop(key, {}):
                self._axes.pop((key, location), None)

    def __len__(self) -> int:
        return len(self._rows)


def to_bytes(saved: dict[str, Any]) -> bytes:
    """Saved tensors as bytes: plain data crosses vLLM's msgpack RPC without special flags."""
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> dict[str, Any]:
    """The inverse of `to_bytes` (tensors only, no pickled code)."""
    return torch.load(io.BytesIO(data), weights_only=True)
