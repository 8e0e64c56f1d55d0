"""Rows saved at graph taps over many steps, kept in device blocks until collection.

A step saving at a graph tap (`tap_saves`) used to keep one tensor per request: a view costs
~2 µs of host time, so 64 saving requests cost ~130 µs a step per tap, on a GPU where the whole
step takes ~3 ms (SmolLM2-135M shape, H200), and collection then joined every step's piece again.
Here a step's rows are copied, one copy per run of adjacent saving requests, into rows of a
block, and each request keeps only where its rows went (`PendingRows`: plain ints, one object for
all the steps whose positions follow on). At collection, or when the store moves saves to the
host, a request's rows come out with one `index_select` per block they are in.

The graph taps share one arena whose blocks advance in lockstep: block `k` has the same rows at
every tap (each tap's tensor of it allocated when something is first written there), so a
request saving at many taps in a step — every layer — keeps one `PendingRows` for all of them,
and the host work per step grows with the requests plus the taps, not their product. A block is
freed once no request has rows waiting in it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

#: What one block of one tap holds at least, in bytes (more if one forward's rows need it).
BLOCK_BYTES = 16 << 20


class PendingRows:
    """One request's saved rows at the graph taps `locations`, waiting in `arena`, for positions
    `first` up to `end` (each step's rows follow on the last's): per block they are in, the first
    row and the row count of each step's piece — the same rows at every one of `locations`."""

    __slots__ = ("_indices", "arena", "end", "first", "locations", "segments", "waiting")

    def __init__(self, arena: SaveArena, first: int, locations: tuple[str, ...]) -> None:
        self.arena = arena
        self.first = self.end = first
        self.locations = locations
        self.waiting = set(locations)  # those not gathered yet
        self.segments: list[tuple[int, list[int], list[int]]] = []  # (block, rows, counts)
        self._indices: list[torch.Tensor] | None = None  # per segment, made at the first gather

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
        """How many rows wait, at each location."""
        return self.end - self.first

    def gather(self, location: str) -> torch.Tensor:
        """The rows at `location`, as a new `[1, rows, width]` tensor; once every location has
        been gathered, they no longer hold the arena's blocks."""
        if self._indices is None:
            self._indices = self.arena.indices(self.segments)
        rows = self.arena.gather(location, self.segments, self._indices)
        self.waiting.discard(location)
        if not self.waiting:
            self.release()
        return rows

    def release(self) -> None:
        """Forget the rows at every location (their request was dropped, or all gathered)."""
        self.arena.release(self.segments)
        self.segments, self._indices = [], None
        self.waiting.clear()


class SaveArena:
    """The blocks holding the graph taps' saved rows (`[rows, width]` per tap and block, on the
    model's device), and their bookkeeping; a request's rows come back as `[1, rows, width]` (the
    saved value's form: token axis 1, as the taps' Python saves it)."""

    def __init__(self, width: int, rows_per_forward: int, device: torch.device,
                 dtype: torch.dtype, block_bytes: int = BLOCK_BYTES) -> None:
        self.width, self.device, self.dtype = width, device, dtype
        self._index_device = device  # where gather's indices go (a test fakes `device`)
        self.row_bytes = width * torch.empty((), dtype=dtype).element_size()
        self._block_rows = max(rows_per_forward, block_bytes // self.row_bytes, 1)
        self._sizes: dict[int, int] = {}  # block -> its rows
        self._tensors: dict[int, dict[str, torch.Tensor]] = {}  # block -> tap -> its rows
        self._holders: dict[int, int] = {}  # block -> `PendingRows` segments in it
        self._current = -1  # the block rows go into now
        self._cursor = 0  # its first free row
        self._next = 0

    @property
    def blocks(self) -> int:
        """How many blocks are in use now (a test sees them freed)."""
        return len(self._sizes)

    def reserve(self, rows: int) -> tuple[int, int]:
        """`rows` free rows at every tap: (block, first row). Hold the block
        (`PendingRows.add`) to keep what is written there."""
        if self._current < 0 or self._cursor + rows > self._sizes[self._current]:
            self._start_block(rows)
        first = self._cursor
        self._cursor += rows
        return self._current, first

    def write(self, locations: Sequence[str], block: int, row: int,
              rows: Sequence[torch.Tensor]) -> None:
        """Copy `rows[i]` (`[n, width]`, the same `n` for all) into `locations[i]`'s rows
        `row:row + n` of `block`: one call for every tap (`_foreach_copy_`, torch's batched copy,
        which its optimizers use; on a GPU one launch), queued on the current stream."""
        tensors = self._tensors[block]
        stop = row + int(rows[0].shape[0])
        targets = []
        for location in locations:
            tensor = tensors.get(location)
            if tensor is None:
                tensor = tensors[location] = self._allocate(self._sizes[block])
            targets.append(tensor[row:stop])
        torch._foreach_copy_(targets, list(rows))

    def _start_block(self, rows: int) -> None:
        old = self._current
        if old >= 0 and not self._holders[old]:
            self._free(old)
        self._current, self._next = self._next, self._next + 1
        self._sizes[self._current] = max(rows, self._block_rows)
        self._tensors[self._current] = {}
        self._holders[self._current] = 0
        self._cursor = 0

    def _allocate(self, rows: int) -> torch.Tensor:
        return torch.empty(rows, self.width, device=self.device, dtype=self.dtype)

    def hold(self, block: int) -> None:
        """One more holder of rows in `block`."""
        self._holders[block] += 1

    def release(self, segments: Sequence[tuple[int, list[int], list[int]]]) -> None:
        """Forget `segments` (`PendingRows.segments`): a block nobody holds any more is freed,
        unless rows still go into it."""
        for block, _, _ in segments:
            left = self._holders[block] = self._holders[block] - 1
            if not left and block != self._current:
                self._free(block)

    def _free(self, block: int) -> None:
        del self._sizes[block], self._tensors[block], self._holders[block]

    def indices(self, segments: Sequence[tuple[int, list[int], list[int]]]
                ) -> list[torch.Tensor]:
        """Each segment's rows (`PendingRows.segments`) as an index on the device, for
        `gather` at every location they were saved at."""
        return [torch.from_numpy(_row_index(rows, counts)).to(self._index_device)
                for _, rows, counts in segments]

    def gather(self, location: str, segments: Sequence[tuple[int, list[int], list[int]]],
               indices: Sequence[torch.Tensor]) -> torch.Tensor:
        """The rows `segments` name at `location`, in order, as a new `[1, rows, width]` tensor
        (one `index_select` per block, with `indices`)."""
        parts = [self._tensors[block][location].index_select(0, index)
                 for (block, _, _), index in zip(segments, indices, strict=True)]
        if not parts:
            return torch.empty(1, 0, self.width, device=self.device, dtype=self.dtype)
        gathered = parts[0] if len(parts) == 1 else torch.cat(parts)
        return gathered.unsqueeze(0)


def _row_index(rows: list[int], counts: list[int]) -> np.ndarray:
    """Rows `rows[i]:rows[i] + counts[i]` for every i, in order, as one int64 array."""
    firsts = np.asarray(rows, dtype=np.int64)
    if len(counts) == sum(counts):  # one row each (decode steps; no piece is empty)
        return firsts
    sizes = np.asarray(counts, dtype=np.int64)
    offsets = np.cumsum(sizes) - sizes  # where each piece starts in the result
    return np.repeat(firsts - offsets, sizes) + np.arange(int(sizes.sum()))
