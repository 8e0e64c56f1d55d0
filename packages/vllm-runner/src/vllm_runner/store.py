"""Saved values of every request in this worker, as the chunks of rows each step saved.

Preemption recomputes a request from position 0 and chunked prefill spreads a prompt over steps,
so each chunk keeps its first absolute position; on collection the rows are put in position
order (the last write of a position wins) and trimmed to what belongs to the final output.
Chunks, not rows: splitting every step's rows into one tensor per position cost more than the
copies themselves when every layer is saved.
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

# Values without a token axis (the attention pattern) are stored whole under this position.
WHOLE = -1


class SaveStore:
    """Rows saved per request, as the chunks each step saved; freed when collected or dropped."""

    def __init__(self) -> None:
        # key -> location -> [(first absolute position, rows along the token axis)]
        self._chunks: dict[str, dict[str, list[tuple[int, torch.Tensor]]]] = defaultdict(
            lambda: defaultdict(list))
        self._axes: dict[tuple[str, str], int | None] = {}
        self._errors: dict[str, str] = {}
        self._staging: torch.Tensor | None = None  # made at the first collection from a device

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = staging_buffer()
        return self._staging

    def fail(self, key: str, message: str) -> None:
        """Record why `key`'s program failed (the first failure is kept)."""
        self._errors.setdefault(key, message)

    def error(self, key: str) -> str | None:
        """Why `key`'s program failed, or `None`; forgotten once read."""
        return self._errors.pop(key, None)

    def save(self, key: str, location: str, first_position: int, value: torch.Tensor,
             token_axis: int | None) -> None:
        """Keep `value` for `key`: rows from `first_position` on along `token_axis`, or the
        whole value (no token axis: the attention pattern). It must not change afterwards (a
        private copy, or a slice of one). On a GPU it stays there until collected: queueing
        a copy into pinned host memory at every save measured 4x slower on the H200 (pinned
        allocations), and a copy that waits would stall the GPU at every hooked layer."""
        self._axes[(key, location)] = token_axis
        chunks = self._chunks[key][location]
        if token_axis is None:
            chunks[:] = [(WHOLE, value)]
            return
        chunks.append((first_position, value))

    def save_rows(self, location: str, token_axis: int,
                  owners: list[tuple[str, int]], values: list[torch.Tensor]) -> None:
        """`save` for many requests at one location: `values[i]` are the rows of
        `owners[i] = (key, first position)` (one loop, for requests served together)."""
        chunks, axes = self._chunks, self._axes
        for (key, first_position), value in zip(owners, values, strict=True):
            axes[(key, location)] = token_axis
            chunks[key][location].append((first_position, value))

    def collect(self, requests: list[tuple[str, int, dict[str, Callable[[int], bool] | None]]]
                ) -> dict[str, dict[str, torch.Tensor]]:
        """Everything saved for each `(key, computed, wanted)`, in position order, below
        position `computed`, on the host (the client's process may have no GPU, or another one),
        each tensor in memory of its own.

        `computed` is how many positions belong to the final output (prompt plus generated
        tokens but the last); rows beyond it came from steps the scheduler ran ahead.
        `wanted[location]` keeps a position or not (`None`: every position).
        """
        found: dict[str, dict[str, torch.Tensor]] = {}
        mover = _ToHost(self._staging_buffer)
        for key, computed, wanted in requests:
            found[key] = self._rows(key, computed, wanted)
            mover.add(found[key])  # request by request: at most a batch is joined at a time
        mover.flush()
        return found

    def _rows(self, key: str, computed: int,
              wanted: dict[str, Callable[[int], bool] | None]) -> dict[str, torch.Tensor]:
        """`key`'s saves in position order, where they were saved (host or GPU)."""
        result: dict[str, torch.Tensor] = {}
        for location, chunks in self._chunks.pop(key, {}).items():
            axis = self._axes.pop((key, location), None)
            if axis is None:
                result[location] = chunks[0][1]
                continue
            rows = _in_position_order(chunks, axis, computed, wanted[location])
            if rows is not None:
                result[location] = rows
        return result

    def drop(self, keys: list[str]) -> None:
        """Free what `keys` saved (aborted or abandoned requests)."""
        for key in keys:
            self._errors.pop(key, None)
            for location in self._chunks.pop(key, {}):
                self._axes.pop((key, location), None)

    def __len__(self) -> int:
        return len(self._chunks)


# Saves on a GPU cross to the host through one pinned buffer of this many bytes, allocated once
# per worker and reused: a copy into fresh pageable memory ran at ~1.4 GB/s on the H200 (page
# faults; 2.3 s of a 5.4 s run saving every layer's MLP neurons), a pinned allocation per copy
# was slower still, and the extra device memory of a batch stays bounded.
STAGING_BYTES = 64 * 2**20
_ALIGN = 64  # bytes: every tensor starts at an offset any dtype can be viewed at


class _ToHost:
    """Replaces tensors of saved dicts by host tensors of their own memory.

    On a GPU a copy per tensor waits for the device each time (with every layer saved for 64
    requests that was 13% of a run on the H200), so device tensors are joined per dtype, copied
    into the staging buffer in batches of up to `STAGING_BYTES` and cloned from there into
    tensors of their own. On the host only slices are cloned: a slice of a step read shared by
    several requests (`Runtime._serve_together`) would otherwise keep every request's rows
    alive."""

    def __init__(self, staging: Callable[[], torch.Tensor]) -> None:
        self._staging = staging
        self._batch: list[tuple[dict[str, torch.Tensor], str, torch.Tensor]] = []
        self._size = 0

    def add(self, saved: dict[str, torch.Tensor]) -> None:
        """Move `saved`'s tensors (in place): host ones now, device ones with their batch."""
        for location, rows in saved.items():
            if not _on_a_device(rows):
                if rows.untyped_storage().nbytes() != rows.numel() * rows.element_size():
                    saved[location] = rows.clone()
                continue
            size = _aligned(rows.numel() * rows.element_size())
            if size > STAGING_BYTES:  # one save of over 64 MiB (long prompts): window by window
                saved[location] = _copy_through(rows, self._staging())
                continue
            if self._size + size > STAGING_BYTES:
                self.flush()
            self._batch.append((saved, location, rows))
            self._size += size

    def flush(self) -> None:
        """Copy the waiting device tensors now."""
        if self._batch:
            _copy_batch(self._batch, self._staging())
        self._batch, self._size = [], 0


def _on_a_device(rows: torch.Tensor) -> bool:
    """Whether `rows` are off the host (a GPU's memory)."""
    return rows.device.type != "cpu"


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def staging_buffer() -> torch.Tensor:
    """The host buffer device saves cross through: pinned where CUDA is, so the copy is one
    direct transfer (plain memory otherwise; host tensors never use it)."""
    return torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def _copy_through(rows: torch.Tensor, staging: torch.Tensor) -> torch.Tensor:
    """`rows` on the host, copied through `staging` one window of its size at a time."""
    host = torch.empty(rows.shape, dtype=rows.dtype)
    flat, landed = rows.reshape(-1), host.view(-1)
    usable = staging.numel() // rows.element_size() * rows.element_size()
    window = staging[:usable].view(rows.dtype)
    for start in range(0, flat.numel(), window.numel()):
        count = min(window.numel(), flat.numel() - start)
        window[:count].copy_(flat[start:start + count])  # waits for the device
        landed[start:start + count].copy_(window[:count])
    return host


def _copy_batch(batch: list[tuple[dict[str, torch.Tensor], str, torch.Tensor]],
                staging: torch.Tensor) -> None:
    """One device-to-host copy per dtype for `batch` (at most `STAGING_BYTES` together, each
    tensor's bytes aligned); each entry gets its own host tensor."""
    by_dtype: dict[torch.dtype, list[tuple[dict[str, torch.Tensor], str, torch.Tensor]]] = (
        defaultdict(list))
    for entry in batch:
        by_dtype[entry[2].dtype].append(entry)
    at = 0
    for dtype, entries in by_dtype.items():
        flat = torch.cat([rows.reshape(-1) for _, _, rows in entries])
        size = flat.numel() * flat.element_size()
        landed = staging[at:at + size].view(dtype)
        landed.copy_(flat)  # waits for the device: the host reads it next
        pieces = landed.split([rows.numel() for _, _, rows in entries])
        for (saved, location, rows), piece in zip(entries, pieces, strict=True):
            saved[location] = piece.view(rows.shape).clone()
        at += _aligned(size)


def _in_position_order(chunks: list[tuple[int, torch.Tensor]], axis: int, computed: int,
                       keep: Callable[[int], bool] | None) -> torch.Tensor | None:
    """The chunks' rows by absolute position, a later chunk's row winning (preemption
    recomputes from position 0; a repeated step rewrites its rows); `None` if no row is kept."""
    rows = torch.cat([chunk for _, chunk in chunks], dim=axis) if len(chunks) > 1 \
        else chunks[0][1]
    # Usually each chunk starts where the previous one ended, and nothing is filtered: the rows
    # as they are, up to `computed`.
    firsts = [first for first, _ in chunks]
    ends = [first + chunk.shape[axis] for first, chunk in chunks]
    if keep is None and firsts[1:] == ends[:-1]:
        count = min(ends[-1], computed) - firsts[0]
        return rows.narrow(axis, 0, count) if count > 0 else None
    positions = [first + offset for first, chunk in chunks for offset in range(chunk.shape[axis])]
    latest = {position: index for index, position in enumerate(positions)}
    order = [latest[p] for p in sorted(latest) if p < computed and (keep is None or keep(p))]
    if not order:
        return None
    return rows.index_select(axis, torch.tensor(order, device=rows.device))


def to_bytes(saved: dict[str, Any]) -> bytes:
    """Saved tensors as bytes: plain data crosses vLLM's msgpack RPC without special flags."""
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> dict[str, Any]:
    """The inverse of `to_bytes` (tensors only, no pickled code)."""
    return torch.load(io.BytesIO(data), weights_only=True)
