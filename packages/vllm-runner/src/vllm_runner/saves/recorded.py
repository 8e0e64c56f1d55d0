"""Saves served together at the taps' Python (or eager hooks), kept once a step per group instead
of once a request at every location.

A group of requests saving at every layer (`Save("layers.*.layer_output")` on 64 requests) is
read once per run of adjacent rows at each layer (`row_serving._save_together`); cutting each read
into one view and one store entry per request costs a few µs a request at every layer of every
step: with 30 layers and 64 requests, milliseconds of a step's host time
(`benchmarks/tap_cost.py`), on a GPU whose piecewise step takes a few ms. Here the step's reads are
kept as they are, in one `StepRecord` per group and step, and each request keeps where its rows
are (`RecordedRows`: one object for every location and every step whose positions follow on,
added to once a step). The views are cut when the rows are taken out (collection, or moving
them to the host), where the store's chunks take them over.

A request's `RecordedRows` stands in its chunk list at each location, from the first step that
location was recorded for it, as `PendingRows` do for graph taps; once any of its locations has
been taken out it takes no more steps, and a new one starts. A step whose joined read failed at
some location leaves that location out of the step's record (its requests' rows there come from
their own saves instead, `row_serving.serve_one`), so a request's rows at a location may have gaps,
and come out as one chunk per stretch without a gap.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from vllm_runner.saves import host_copies
from vllm_runner.saves.arena import row_index

if TYPE_CHECKING:
    from tokenspan import RunRead


class DeviceBytes:
    """Bytes the live `StepRecord`s of one store hold on a device (a GPU): counted when read,
    let go when a record is freed."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = 0


class StepRecord:
    """One group's reads in one step: per location, one tensor per planned read (`RunRead`), the
    token axis `axis`; the same runs of rows at every location. Freed with its last request's
    `RecordedRows` (it refers to nothing that refers back to it, so this happens at once)."""

    __slots__ = ("_counter", "axis", "device_bytes", "row_bytes", "wholes")

    def __init__(self, axis: int, counter: DeviceBytes) -> None:
        self.axis = axis
        self.wholes: dict[str, list[torch.Tensor]] = {}
        self.row_bytes: dict[str, int] = {}  # per location: one token row's bytes
        self.device_bytes = 0
        self._counter = counter

    def keep(self, location: str, wholes: list[torch.Tensor]) -> None:
        """The reads at `location`, one per planned read."""
        self.wholes[location] = wholes
        first = wholes[0]
        rows = first.shape[self.axis]
        self.row_bytes[location] = first.numel() * first.element_size() // rows if rows else 0
        if host_copies.on_a_device(first):
            size = sum(whole.numel() * whole.element_size() for whole in wholes)
            self.device_bytes += size
            self._counter.held += size

    def __del__(self) -> None:
        self._counter.held -= self.device_bytes


class RecordedRows:
    """One request's rows in `StepRecord`s for one op of its program (`op`): per step, the
    record, the read it is in, its first row there and how many, for positions `first` up to
    `end` (each step's rows follow on the last's). `locations`: where it stands in the store's
    chunk lists; `open` until one of them is taken out."""

    __slots__ = ("_gathered", "end", "first", "locations", "op", "open", "pieces")

    def __init__(self, first: int, op: object) -> None:
        self.first = self.end = first
        self.op = op
        # per location, stretches `gather_together` took out already
        self._gathered: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self.pieces: list[tuple[StepRecord, int, int, int]] = []
        self.locations: set[str] = set()
        self.open = True

    def add(self, record: StepRecord, read: int, offset: int, count: int) -> None:
        """The next `count` positions' rows: rows `offset:offset + count` of `read`."""
        self.pieces.append((record, read, offset, count))
        self.end += count

    def stretches(self, location: str) -> list[tuple[int, torch.Tensor]]:
        """The rows at `location` as (first position, rows) per stretch of steps that recorded
        it, each stretch's rows joined into a new tensor (or one step's view); no more steps
        are taken after, and once every location has been taken out the rows are let go."""
        self.open = False
        self.locations.discard(location)
        found = self._gathered.pop(location, None)
        if found is None:
            found = self._cut(location)
        if not self.locations:
            self.release()
        return found

    def _cut(self, location: str) -> list[tuple[int, torch.Tensor]]:
        """`stretches` one step's view at a time."""
        found: list[tuple[int, torch.Tensor]] = []
        parts: list[torch.Tensor] = []
        position = start = self.first
        for record, read, offset, count in self.pieces:
            wholes = record.wholes.get(location)
            if wholes is None:  # this step's joined read failed there: a gap
                if parts:
                    found.append((start, _joined(parts, record.axis)))
                    parts = []
                start = position + count
            else:
                parts.append(wholes[read].narrow(record.axis, offset, count))
            position += count
        if parts:
            found.append((start, _joined(parts, self.pieces[0][0].axis)))
        return found

    def bytes_at(self, location: str) -> int:
        """What its rows at `location` hold, in bytes (a row's bytes as its first step's)."""
        if not self.pieces:
            return 0
        return (self.end - self.first) * self.pieces[0][0].row_bytes.get(location, 0)

    def release(self) -> None:
        """Forget its rows (taken out at every location, or dropped)."""
        self.pieces = []
        self._gathered.clear()
        self.open = False


def _joined(parts: list[torch.Tensor], axis: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=axis)


class GroupRecord:
    """What a group keeps for the rest of its step: its record, and each member's
    `RecordedRows` with its program id (`SaveStore.start_record`); `covered`, the locations
    every member already stands at (no member then needs a chunk there)."""

    __slots__ = ("covered", "members", "record")

    def __init__(self, record: StepRecord, members: list[tuple[str, RecordedRows]],
                 covered: set[str]) -> None:
        self.record, self.members, self.covered = record, members, covered


def offsets_in(read: RunRead) -> list[int]:
    """Where each piece of `read` (`RunRead.sizes`) starts along the token axis."""
    return list(accumulate(read.sizes, initial=0))


#: How much larger than the rows taken out the reads they are taken from may be for
#: `gather_together` to join those reads first (past it, each step's rows are cut on their own:
#: a request collected alone among many with long prompts would otherwise copy all of theirs).
JOIN_AT_MOST = 4


def gather_together(waiting: Iterable[tuple[RecordedRows, str]]) -> None:
    """Take the rows of each of `waiting` (a request's recorded rows and a location) out of their
    step records for all of them at once: per location, the reads they are in joined into one
    tensor and their rows taken from it with one `index_select`; each one's `stretches` then
    returns its slices of that. One step's view at a time, a request saving every layer over 32
    steps cost ~2 µs for each of 32 views at each layer, more than the copies.

    The joined reads and the rows taken add device memory for one location at a time, at most
    `JOIN_AT_MOST + 1` times the rows taken."""
    by_location: dict[str, list[RecordedRows]] = {}
    seen: set[tuple[int, str]] = set()
    for rows, location in waiting:
        if (location not in rows.locations or location in rows._gathered
                or (id(rows), location) in seen or not rows.pieces):
            continue
        seen.add((id(rows), location))
        by_location.setdefault(location, []).append(rows)
    plans: dict[tuple[int, ...], _Plan] = {}
    for location, members in by_location.items():
        key = tuple(map(id, members))
        plan = plans.get(key)
        if plan is None or not plan.fits(location):
            plan = _Plan(members, location)
            if not plan.gaps:
                plans[key] = plan
        plan.take(location)


class _Plan:
    """Where the rows of `members` are in the reads their records kept at a location: the
    reads in the order they are joined (`sources`), each member's stretches as (first position,
    start, count) in the rows taken out, and the index of those rows in the joined reads."""

    def __init__(self, members: list[RecordedRows], location: str) -> None:
        self.members = members
        self.axis = members[0].pieces[0][0].axis
        self.sources: list[tuple[StepRecord, int]] = []
        bases: dict[tuple[int, int], int] = {}
        total = 0
        firsts: list[int] = []  # each piece's first row in the joined reads
        counts: list[int] = []
        self.stretches: list[list[tuple[int, int, int]]] = []
        self.gaps = False
        taken = 0
        for rows in members:
            mine: list[tuple[int, int, int]] = []
            position = rows.first
            for record, read, offset, count in rows.pieces:
                wholes = record.wholes.get(location)
                if wholes is None or record.axis != self.axis:
                    self.gaps = True
                    position += count
                    continue
                source = (id(record), read)
                base = bases.get(source)
                if base is None:
                    base = bases[source] = total
                    self.sources.append((record, read))
                    total += wholes[read].shape[self.axis]
                firsts.append(base + offset)
                counts.append(count)
                if mine and mine[-1][0] + mine[-1][2] == position:
                    first, start, length = mine[-1]
                    mine[-1] = (first, start, length + count)
                else:
                    mine.append((position, taken, count))
                taken += count
                position += count
            self.stretches.append(mine)
        self.total, self.taken = total, taken
        self.index = row_index(firsts, counts)

    def fits(self, location: str) -> bool:
        """Whether the same plan serves `location`: no gaps, and every record kept it."""
        return not self.gaps and all(location in record.wholes for record, _ in self.sources)

    def take(self, location: str) -> None:
        """Join the reads at `location`, take the members' rows, and give each its stretches;
        nothing where the reads are too much larger than the rows (`JOIN_AT_MOST`)."""
        if not self.taken or self.total > JOIN_AT_MOST * self.taken:
            return
        reads = [record.wholes[location][read] for record, read in self.sources]
        axis = self.axis
        joined = _joined(reads, axis)
        if not host_copies.on_a_device(joined):  # each stretch in memory of its own: no
            # copy of it later (a view of a larger tensor is cloned on its way to the caller)
            for member, mine in zip(self.members, self.stretches, strict=True):
                member._gathered[location] = [
                    (first, joined.index_select(axis, torch.from_numpy(
                        self.index[start:start + count])))
                    for first, start, count in mine]
            return
        # On a device: one index for all, one gather; the stretches are views of it (they are
        # copied to the host next, each into its own place).
        index = torch.from_numpy(self.index).to(joined.untyped_storage().device,
                                                 non_blocking=True)
        rows = joined.index_select(axis, index)
        for member, mine in zip(self.members, self.stretches, strict=True):
            member._gathered[location] = [(first, rows.narrow(axis, start, count))
                                          for first, start, count in mine]
