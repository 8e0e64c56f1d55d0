"""Rows saved at a graph tap over many steps, kept in a few device blocks until collection.

A step saving at a graph tap (`tap_saves`) used to keep one tensor per request: a view costs
~2 µs of host time, so 64 saving requests cost ~130 µs a step, on a GPU where the whole step
takes ~3 ms (SmolLM2-135M shape, H200), and collection then joined every step's piece again.
Here a step's rows are copied, one copy per run of adjacent saving requests, into the next free
rows of a block, and each request keeps only where its rows went (`PendingRows`: plain ints,
one object for all the steps whose positions follow on). At collection, or when the store moves
saves to the host, a request's rows come out with one `index_select` per block they are in. A
block is freed once no request has rows waiting in it.
"""

from __future__ import annotations

import numpy as np
import torch

#: What one block holds at least, in bytes (more if one forward's rows need it).
BLOCK_BYTES = 16 << 20


class PendingRows:
    """One request's saved rows at one value, waiting in `arena`, for positions `first` up to
    `end` (each step's rows follow on the last's): per block they are in, the first row and the
    row count of each step's piece."""

    __slots__ = ("arena", "end", "first", "segments")

    def __init__(self, arena: SaveArena, first: int) -> None:
        self.arena = arena
        self.first = self.end = first
        self.segments: list[tuple[int, list[int], list[int]]] = []  # (block, rows, counts)

    def add(self, block: int, row: int, count: int) -> None:
        """The next `count` positions' rows, at `row` of `block`."""
        if not count:
            return
        segments = self.segments
        if not segments or segments[-1][0] != block:
            self.arena.hold(block)
            segments.append((block, [row], [count]))
        else:
            segments[-1][1].append(row)
            segments[-1][2].append(count)
        self.end += count

    @property
    def count(self) -> int:
        """How many rows wait."""
        return self.end - self.first

    def gather(self) -> torch.Tensor:
        """The rows, as a new `[1, rows, width]` tensor, no longer held in the arena."""
        return self.arena.gather(self)

    def release(self) -> None:
        """Forget the rows (their request was dropped)."""
        self.arena.release(self)


class SaveArena:
    """The blocks holding one tapped value's saved rows (`[rows, width]` each, on the value's
    device), and their bookkeeping; a request's rows come back as `[1, rows, width]` (the saved
    value's form: token axis 1, as the taps' Python saves it)."""

    def __init__(self, width: int, rows_per_forward: int, device: torch.device,
                 dtype: torch.dtype, block_bytes: int = BLOCK_BYTES) -> None:
        self.width, self.device, self.dtype = width, device, dtype
        self._index_device = device
        self.row_bytes = width * torch.empty((), dtype=dtype).element_size()
        self._block_rows = max(rows_per_forward, block_bytes // self.row_bytes, 1)
        self._blocks: dict[int, torch.Tensor] = {}
        self._holders: dict[int, int] = {}  # block -> `PendingRows` segments in it
        self._current = -1  # the block rows go into now
        self._cursor = 0  # its first free row
        self._next = 0

    @property
    def blocks(self) -> int:
        """How many blocks are allocated now (a test sees them freed)."""
        return len(self._blocks)

    def append(self, rows: torch.Tensor) -> tuple[int, int]:
        """Copy `rows` (`[n, width]`) into free rows, queued on the current stream; where they
        went: (block, first row). Hold the block (`PendingRows.add`) to keep them."""
        total = int(rows.shape[0])
        if self._current < 0 or self._cursor + total > self._blocks[self._current].shape[0]:
            self._start_block(total)
        block, first = self._current, self._cursor
        self._blocks[block][first:first + total].copy_(rows)
        self._cursor += total
        return block, first

    def _start_block(self, rows: int) -> None:
        old = self._current
        if old >= 0 and not self._holders[old]:
            self._free(old)
        self._current, self._next = self._next, self._next + 1
        self._blocks[self._current] = self._allocate(max(rows, self._block_rows))
        self._holders[self._current] = 0
        self._cursor = 0

    def _allocate(self, rows: int) -> torch.Tensor:
        return torch.empty(rows, self.width, device=self.device, dtype=self.dtype)

    def hold(self, block: int) -> None:
        """One more holder of rows in `block`."""
        self._holders[block] += 1

    def release(self, pending: PendingRows) -> None:
        """Forget `pending`'s rows: a block nobody holds any more is freed, unless rows still
        go into it."""
        for block, _, _ in pending.segments:
            left = self._holders[block] = self._holders[block] - 1
            if not left and block != self._current:
                self._free(block)
        pending.segments = []

    def _free(self, block: int) -> None:
        del self._blocks[block], self._holders[block]

    def gather(self, pending: PendingRows) -> torch.Tensor:
        """`pending`'s rows, in order, as a new `[1, rows, width]` tensor (one `index_select`
        per block they are in), and released."""
        parts = [self._blocks[block].index_select(
            0, torch.from_numpy(_row_index(rows, counts)).to(self._index_device))
            for block, rows, counts in pending.segments]
        self.release(pending)
        gathered = parts[0] if len(parts) == 1 else torch.cat(parts)
        return gathered.unsqueeze(0)


def _row_index(rows: list[int], counts: list[int]) -> np.ndarray:
    """Rows `rows[i]:rows[i] + counts[i]` for every i, in order, as one int64 array."""
    firsts = np.asarray(rows, dtype=np.int64)
    if len(counts) == sum(counts):  # one row each (decode steps)
        return firsts
    sizes = np.asarray(counts, dtype=np.int64)
    offsets = np.cumsum(sizes) - sizes  # where each piece starts in the result
    return np.repeat(firsts - offsets, sizes) + np.arange(int(sizes.sum()))
