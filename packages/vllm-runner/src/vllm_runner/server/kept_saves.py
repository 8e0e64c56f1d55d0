"""Saves the server keeps under an id until their client fetches them (`GET
/v1/interp/saves/{id}`, safetensors), within a byte budget: large results are not inlined in
JSON responses, and the server's memory for them is bounded — over the budget a request's saves
are refused with a message, never an out-of-memory."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from safetensors.torch import save


class KeptSavesFull(RuntimeError):
    """Keeping these saves would pass the server's budget; the message says by how much."""


@dataclass
class _Kept:
    data: bytes
    expires: float


#: Random bytes in a kept saves' id (192 bits, 32 URL-safe characters): the id is all a reader
#: needs, so no client can find another's saves by trying ids.
SAVES_ID_BYTES = 24


class KeptSaves:
    """safetensors files in memory by id, each deleted when read, or when its time is up."""

    def __init__(self, budget_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._kept: dict[str, _Kept] = {}

    @property
    def held_bytes(self) -> int:
        """Bytes kept now (after dropping what expired)."""
        self._expire()
        return sum(len(kept.data) for kept in self._kept.values())

    def keep(self, saved: Mapping[str, torch.Tensor]) -> tuple[str, int]:
        """(an id for `saved` as one safetensors file, its size); `KeptSavesFull` if it does not
        fit beside what is kept."""
        data = save({name: tensor.contiguous() for name, tensor in saved.items()})
        held = self.held_bytes
        if held + len(data) > self.budget_bytes:
            raise KeptSavesFull(f"saves of {len(data)} bytes do not fit the server's budget for "
                             f"kept saves ({self.budget_bytes} bytes, {held} held by saves not "
                             "fetched yet): fetch or delete those, save fewer values or "
                             "positions, or ask the operator for a larger "
                             "--interp-saves-budget-mib")
        saves_id = secrets.token_urlsafe(SAVES_ID_BYTES)
        self._kept[saves_id] = _Kept(data, self._clock() + self.ttl_s)
        return saves_id, len(data)

    def take(self, saves_id: str) -> bytes | None:
        """The saves kept as `saves_id`, forgotten now (a second read finds nothing)."""
        self._expire()
        kept = self._kept.pop(saves_id, None)
        return None if kept is None else kept.data

    def delete(self, saves_id: str) -> bool:
        """Forget `saves_id`; whether it was kept."""
        self._expire()
        return self._kept.pop(saves_id, None) is not None

    def _expire(self) -> None:
        now = self._clock()
        for saves_id in [key for key, kept in self._kept.items() if kept.expires <= now]:
            del self._kept[saves_id]
