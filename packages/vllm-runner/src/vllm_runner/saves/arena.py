"""Rows saved at graph taps over many steps, kept in device blocks until collection.

A step saving at a graph tap (`tap_saves`) used to keep one tensor per request: a view costs
microseconds of host time, so 64 saving requests cost a visible share of a GPU step of a small
model per tap, and collection then joined every step's piece again.
Here a step's rows are copied, one copy per run of adjacent saving requests, into rows of a
block, and each request keeps only where its rows went (`PendingRows`: plain ints, one object for
all the steps whose positions follow on). At collection the rows of many requests come out
together, with one `index_select` per block (`gather_together`); when the store moves one
request's saves to the host, its rows come out with one `index_select` per block they are in.

The graph taps share one arena whose blocks advance in lockstep: block `k` has the same rows at
every tap (each tap's tensor of it allocated when something is first written there), so a
request saving at many taps in a step — every layer — keeps one `PendingRows` for all of them,
and the host work per step grows with the requests plus the taps, not their product. A block is
freed once no request has rows waiting in it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

#: What one block of one tap holds at least, in bytes (more if one forward's rows need it).
BLOCK_BYTES = 16 << 20


class PendingRows:
    """One request's saved rows at the graph taps `locations`, waiting in `arena`, for positions
    `first` up to `end` (each step's rows follow on the last's): per block they are in, the first
    row and the row count of each step's piece — the same rows at every one of `locations`. The
    latest steps' rows may be kept for many requests at once in a `SharedRows` the request is a
    member of, until they are taken out of it (`settle`)."""

    __slots__ = ("_end", "_gathered", "_indices", "_member", "_shared", "arena", "first",
                 "locations", "segments", "waiting")

    def __init__(self, arena: SaveArena, first: int, locations: tuple[str, ...]) -> None:
        self.arena = arena
        self.first = self._end = first
        self.locations = locations
        self.waiting = set(locations)  # those not gathered yet
        self.segments: list[tuple[int, list[int], list[int]]] = []  # (block, rows, counts)
        self._indices: list[torch.Tensor] | None = None  # per segment, made at the first gather
        self._gathered: dict[str, torch.Tensor] = {}  # rows `gather_together` took out already
        self._shared: SharedRows | None = None
        self._member = 0  # its place in `_shared`

    @property
    def end(self) -> int:
        """The position after the last row that waits."""
        shared = self._shared
        if shared is None:
            return self._end
        return self._end + len(shared.rows) * shared.counts[self._member]

    def add(self, block: int, row: int, count: int) -> None:
        """The next `count` positions' rows, at `row` of `block`."""
        if not count:
            return
        if self._shared is not None:
            self.settle()
        self._append(block, [row], [count])

    def _append(self, block: int, rows: list[int], counts: list[int]) -> None:
        segments = self.segments
        if not segments or segments[-1][0] != block:
            self.arena.hold(block)
            segments.append((block, rows, counts))
        else:
            segments[-1][1].extend(rows)
            segments[-1][2].extend(counts)
        self._end += sum(counts)

    def join(self, shared: SharedRows, member: int) -> None:
        """The next steps' rows are kept in `shared`, at `member`'s place."""
        self.settle()
        self._shared, self._member = shared, member

    def settle(self) -> None:
        """Take this request's rows out of its `SharedRows` into its own segments (before they
        are gathered, or other rows follow them); the shared run then takes no more steps."""
        shared = self._shared
        if shared is None:
            return
        self._shared = None
        for block, rows, counts in shared.segments_of(self._member):
            self._append(block, rows, counts)
        shared.leave(self._member)

    @property
    def count(self) -> int:
        """How many rows wait, at each location."""
        return self.end - self.first

    def gather(self, location: str) -> torch.Tensor:
        """The rows at `location`, as a new `[1, rows, width]` tensor; once every location has
        been gathered, they no longer hold the arena's blocks."""
        self.settle()
        rows = self._gathered.pop(location, None)
        if rows is None:
            if self._indices is None:
                self._indices = self.arena.indices(self.segments)
            rows = self.arena.gather(location, self.segments, self._indices)
        self.waiting.discard(location)
        if not self.waiting:
            self.release()
        return rows

    def release(self) -> None:
        """Forget the rows at every location (their request was dropped, or all gathered)."""
        if self._shared is not None:
            self._shared.leave(self._member)
            self._shared = None
        self.arena.release(self.segments)
        self.segments, self._indices = [], None
        self._gathered.clear()
        self.waiting.clear()


class SharedRows:
    """The rows of a run of steps that the same requests saved at the same graph taps, each
    request at the same place in every step's rows: a run of decode steps with an unchanged
    schedule (`repeated_saves`). A step is kept once, as the block and first row it went to,
    instead of once per request (`PendingRows.add`: ~1 µs of host time a request a step).

    Request `member` owns rows `row + offsets[member]` (`counts[member]` of them) of each step's
    `(block, row)`. The run holds each block it uses once; a member whose rows are taken out
    (`PendingRows.settle`) or dropped leaves, the run then takes no more steps, and the blocks
    are let go when the last member has left."""

    __slots__ = ("_blocks", "_left", "arena", "counts", "offsets", "open", "rows")

    def __init__(self, arena: SaveArena, offsets: list[int], counts: list[int]) -> None:
        self.arena = arena
        self.offsets, self.counts = offsets, counts
        self.rows: list[int] = []  # each step's first row
        self.open = True  # whether steps may still be added
        self._left = set(range(len(offsets)))  # members whose rows are still here
        # Each block the steps went to, with its first step; held by the run, once each.
        self._blocks: list[tuple[int, int]] = []

    def add(self, block: int, row: int) -> None:
        """One more step's rows, from `row` of `block`."""
        if not self._blocks or self._blocks[-1][0] != block:
            self.arena.hold(block)
            self._blocks.append((block, len(self.rows)))
        self.rows.append(row)

    def segments_of(self, member: int) -> list[tuple[int, list[int], list[int]]]:
        """`member`'s rows as `PendingRows.segments`."""
        if not self._blocks:
            return []
        offset, count, rows = self.offsets[member], self.counts[member], self.rows
        stops = [first for _, first in self._blocks[1:]] + [len(rows)]
        return [(block, [row + offset for row in rows[first:stop]], [count] * (stop - first))
                for (block, first), stop in zip(self._blocks, stops, strict=True)]

    def leave(self, member: int) -> None:
        """`member`'s rows are no longer kept here."""
        self.open = False
        self._left.discard(member)
        if not self._left and self._blocks:
            self.arena.release([(block, [], []) for block, _ in self._blocks])
            self._blocks = []


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

    def device_row_bytes(self, taps: int) -> int:
        """What one row saved at `taps` taps holds on a device, in bytes; 0 where the arena is
        on the host (the store counts device bytes only, to know when to spill)."""
        return self.row_bytes * taps if self.device.type != "cpu" else 0

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
        return [_on_index_device(row_index(rows, counts), self._index_device)
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


def gather_together(waiting: Iterable[tuple[PendingRows, str]]) -> None:
    """Take the rows of each of `waiting` (a request's rows and a location they were saved at)
    out of their arena for all of them at once: per arena and location one new tensor, filled
    with one `index_select` and one `index_copy_` per block, and its indices sent to the device
    in one copy per arena; each request's `gather` then returns its slice of it. Request by
    request, a collection ran one `index_select` per block a request's rows are in and a `cat`:
    for 64 requests saving one graph tap over a wave, hundreds of small operators, which took
    the worker's collection to several times what its copies to the host took (and each
    request's indices copied to the device on their own, a blocking copy that waits for the
    work queued before it, cost as much again).

    The new tensors hold every row of `waiting` on the device at once: the caller bounds it
    (`SaveStore.collect` passes at most a staging buffer's worth at a time)."""
    by_arena: dict[int, tuple[SaveArena, dict[str, list[PendingRows]]]] = {}
    seen: set[tuple[int, str]] = set()
    for rows, location in waiting:
        rows.settle()
        if (not rows.segments or location not in rows.waiting or location in rows._gathered
                or (id(rows), location) in seen):
            continue
        seen.add((id(rows), location))
        by_arena.setdefault(id(rows.arena), (rows.arena, {}))[1].setdefault(
            location, []).append(rows)
    for arena, by_location in by_arena.values():
        _gather_arena(arena, by_location)


def _gather_arena(arena: SaveArena, by_location: dict[str, list[PendingRows]]) -> None:
    """`gather_together` for one arena: `by_location[location]` are the requests whose rows
    are taken out at `location`, in order. Locations with the same requests (one tap per layer,
    every layer saved) share one layout and its indices."""
    layouts: dict[tuple[int, ...], _Layout] = {}
    arrays: list[np.ndarray] = []
    for members in by_location.values():
        key = tuple(map(id, members))
        if key not in layouts:
            layouts[key] = layout = _Layout(members)
            arrays += layout.arrays
    pieces = iter(_on_index_device(np.concatenate(arrays), arena._index_device).split(
        [len(array) for array in arrays]))
    for layout in layouts.values():
        layout.indices = [(next(pieces), next(pieces)) for _ in layout.blocks]
    for location, members in by_location.items():
        layout = layouts[tuple(map(id, members))]
        together = arena._allocate(layout.total)
        for block, (taken, placed) in zip(layout.blocks, layout.indices, strict=True):
            together.index_copy_(0, placed,
                                 arena._tensors[block][location].index_select(0, taken))
        for rows, start, stop in layout.spans:
            rows._gathered[location] = together[start:stop].unsqueeze(0)


class _Layout:
    """Where the rows of requests `members` go when gathered together: each one's `(rows,
    start, stop)` in the new tensor of `total` rows, the blocks they come from, and per block
    the rows taken from it and the rows they are placed at (`arrays`: taken, placed, block by
    block; `indices`: the same on the device)."""

    def __init__(self, members: list[PendingRows]) -> None:
        by_block: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self.spans: list[tuple[PendingRows, int, int]] = []
        total = 0
        for rows in members:
            start = total
            for block, firsts, counts in rows.segments:
                taken = row_index(firsts, counts)
                taken_of_block, placed_of_block = by_block.setdefault(block, ([], []))
                taken_of_block.append(taken)
                placed_of_block.append(np.arange(total, total + len(taken), dtype=np.int64))
                total += len(taken)
            self.spans.append((rows, start, total))
        self.total, self.blocks = total, list(by_block)
        self.arrays = [np.concatenate(part) for lists in by_block.values() for part in lists]
        self.indices: list[tuple[torch.Tensor, torch.Tensor]] = []


def _on_index_device(index: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(index).to(device, non_blocking=True)


def row_index(rows: list[int], counts: list[int]) -> np.ndarray:
    """Rows `rows[i]:rows[i] + counts[i]` for every i, in order, as one int64 array."""
    firsts = np.asarray(rows, dtype=np.int64)
    if len(counts) == sum(counts):  # one row each (decode steps; no piece is empty)
        return firsts
    sizes = np.asarray(counts, dtype=np.int64)
    offsets = np.cumsum(sizes) - sizes  # where each piece starts in the result
    return np.repeat(firsts - offsets, sizes) + np.arange(int(sizes.sum()))
