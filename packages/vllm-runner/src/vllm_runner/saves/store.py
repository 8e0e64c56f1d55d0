"""Saved values of every request in this worker, as the chunks of rows each step saved.

Preemption recomputes a request from position 0 and chunked prefill spreads a prompt over steps,
so each chunk keeps its first absolute position; on collection the rows are put in position
order (the last write of a position wins) and trimmed to what belongs to the final output.
Chunks, not rows: splitting every step's rows into one tensor per position cost more than the
copies themselves when every layer is saved. A chunk's rows may also wait elsewhere until taken
out: in the graph taps' arena (`saves.arena.PendingRows`), or in the reads a group of requests
saving together made in a step (`saves.recorded.RecordedRows`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from vllm_runner.errors import after_earlier, saves_lost
from vllm_runner.saves import host_copies
from vllm_runner.saves.arena import PendingRows, SaveArena, gather_together
from vllm_runner.saves.recorded import (
    DeviceBytes,
    GroupRecord,
    RecordedRows,
    StepRecord,
    offsets_in,
)
from vllm_runner.saves.recorded import gather_together as gather_recorded
from vllm_runner.saves.unread_checks import UnreadChecks
from vllm_runner.settings import FALLBACK_DEVICE_SAVES_MIB

if TYPE_CHECKING:
    from tokenspan import RunRead

logger = logging.getLogger("vllm.interp")

# Values without a token axis (the attention pattern) are stored whole under this position.
WHOLE = -1

#: Which positions of a saved name are kept: `position -> bool`, or `None` for every one.
Keep = Callable[[int], bool] | None
#: Where a collection writes a request's tensors instead of memory of their own: given its program
#: id and tensors, their places in a file, or `None` (`wire.SharedFiles.places`).
Places = Callable[[str, dict[str, torch.Tensor]], dict[str, host_copies.FileFor] | None]


class Chunk(list[Any]):
    """`[first, rows]`: the rows one step saved for one value, from absolute position `first`,
    made as `Chunk((first, rows))`; `rows` may still wait in a `SaveArena` (`PendingRows`)
    until the store takes them out (`_resolved`). A list, so that `host_copies` swaps its rows
    for host ones in place (`chunk[1]`); built by list's own constructor, with no Python
    `__init__`, because a step saving every layer for 64 requests makes thousands (a Python
    constructor was a large share of a tap's cost in `save_rows`)."""

    __slots__ = ()

    @property
    def first(self) -> int:
        """The absolute position of the first row."""
        return int(self[0])

    @property
    def rows(self) -> torch.Tensor:
        """The rows, along the value's tokens axis."""
        return self[1]  # type: ignore[no-any-return]


class ToCollect(NamedTuple):
    """A finished request to collect: how many positions belong to its final output, and per
    saved name which positions its ops keep."""

    program_id: str
    computed: int
    wanted: dict[str, Keep]


class SaveStore:
    """Rows saved per request, as the chunks each step saved; freed when collected or dropped.

    On a GPU, saves stay there while their request runs: queueing a copy into pinned host
    memory at every save is several times slower (pinned allocations), and a copy that waits
    would stall the GPU at every hooked layer. Past a limit they are moved to the host
    together (`spill`), and the rest at collection, in batched copies (`host_copies`)."""

    def __init__(self) -> None:
        # program id -> location -> the chunks saved, in the order they were saved
        self._chunks: dict[str, dict[str, list[Chunk]]] = defaultdict(
            lambda: defaultdict(list))
        self._axes: dict[tuple[str, str], int | None] = {}
        # Values whose rows differ in width along their last axis (attention patterns: one key
        # column per position so far), and what pads them to one width.
        # per (program id, location): what pads rows of different widths, and whether a row's
        # width is its position + 1 (`save`)
        self._fills: dict[tuple[str, str], tuple[float, bool]] = {}
        self._errors: dict[str, str] = {}
        # Edits' finiteness answered on the device, not read yet (`unread_checks`), and whose.
        self._unread: list[UnreadChecks] = []
        self._unread_ids: set[str] = set()
        self._device_bytes: dict[str, int] = defaultdict(int)  # per program_id, saves on a device
        self._spilled: set[str] = set()  # program_ids with chunks moved to the host by `spill`
        self._staging: torch.Tensor | None = None  # made at the first move from a device
        self._device: torch.device | None = None  # where device saves are (one per worker)
        self._automatic_limit: int | None = None  # see `spill`
        # program id -> id of an op -> the rows its group's step records hold for it now
        self._recording: dict[str, dict[int, RecordedRows]] = {}
        self._recorded = DeviceBytes()  # what live step records hold on a device

    @property
    def device_bytes(self) -> int:
        """Bytes of saves held on a device (a GPU) now: what `spill` compares to its limit."""
        return sum(self._device_bytes.values()) + self._recorded.held

    def held(self) -> dict[str, int]:
        """What is held for requests not collected yet: how many have saves or an error, and
        the bytes of their saves (on a device or the host). A server reports it so that an
        operator — or a test — sees memory come back after requests end or are abandoned."""
        requests = set(self._chunks) | set(self._errors)
        size = sum(_bytes(chunk[1], location) for locations in self._chunks.values()
                   for location, chunks in locations.items() for chunk in chunks)
        return {"requests": len(requests), "bytes": size}

    def fail(self, program_id: str, message: str) -> None:
        """Record why `program_id`'s program failed (the first failure is kept)."""
        self._errors.setdefault(program_id, message)

    def check_later(self, checks: UnreadChecks) -> None:
        """Fail the requests of `checks` whose edit was not finite once the answers are read:
        before the store next says whether one of them failed (`failed`, `any_failed`,
        `error`), and at collection."""
        self._unread.append(checks)
        self._unread_ids.update(checks.program_ids)

    def settle(self) -> None:
        """Read every unread check (waiting for the device to reach it) and fail whom it
        refused."""
        unread, self._unread = self._unread, []
        self._unread_ids.clear()
        for checks in unread:
            for program_id, why in checks.failures():
                self.fail(program_id, why)

    @property
    def any_failed(self) -> bool:
        """Whether some program failed and was not collected yet (unread checks read first)."""
        if self._unread:
            self.settle()
        return bool(self._errors)

    @property
    def may_have_failed(self) -> bool:
        """Whether some program failed, or may have (unread checks), without waiting."""
        return bool(self._errors) or bool(self._unread)

    def has_saves(self, program_id: str, location: str) -> bool:
        """Whether `program_id` keeps anything at `location` yet (rows, or none: an op whose
        `positions` were not reached keeps an empty piece so its name comes back)."""
        kept = self._chunks.get(program_id)
        return kept is not None and bool(kept.get(location))

    def failed(self, program_id: str) -> bool:
        """Whether `program_id`'s program has failed (it is served no more): its unread checks
        are read first, so an edit is never served after one refused earlier."""
        if program_id in self._unread_ids:
            self.settle()
        return program_id in self._errors

    def failed_so_far(self, program_id: str) -> bool:
        """`failed` without reading unread checks (no wait for the device): for reads later in
        the forward whose check is unread, which see the rows the refused edit left alone."""
        return program_id in self._errors

    def error(self, program_id: str) -> str | None:
        """Why `program_id`'s program failed, or `None`; forgotten once read."""
        if program_id in self._unread_ids:
            self.settle()
        return self._errors.pop(program_id, None)

    def save(self, program_id: str, location: str, first_position: int, value: torch.Tensor,
             token_axis: int | None, fill: float | None = None,
             width_is_position: bool = True) -> None:
        """Keep `value` for `program_id`: rows from `first_position` on along `token_axis`, or the
        whole value (no token axis). It must not change afterwards (a private copy, or a slice
        of one). `fill` marks rows whose last axis differs from step to step: rows are padded
        with it to the widest when joined. Where `width_is_position` (an attention pattern's
        keys: a row's width is its position + 1) the rows kept are then cut to the last one's
        width; otherwise (an SAE's active features, as many as its busiest token has) not."""
        self._axes[(program_id, location)] = token_axis
        if fill is not None:
            self._fills[(program_id, location)] = (fill, width_is_position)
        chunks = self._chunks[program_id][location]
        if token_axis is not None and chunks and value.shape[token_axis] == 0:
            return  # no rows (an op with `positions` kept none this step): nothing to add
        if program_id in self._recording:
            self._end_records(program_id, (location,))
        if host_copies.on_a_device(value):
            self._device_bytes[program_id] += value.numel() * value.element_size()
            self._device = value.device
        if token_axis is None:
            for _, replaced in chunks:
                if host_copies.on_a_device(replaced):
                    self._device_bytes[program_id] -= replaced.numel() * replaced.element_size()
            chunks[:] = [Chunk((WHOLE, value))]
            return
        chunks.append(Chunk((first_position, value)))

    def save_rows(self, location: str, token_axis: int,
                  owners: list[tuple[str, int]], values: list[torch.Tensor]) -> None:
        """`save` for many requests at one location: `values[i]` are the rows of
        `owners[i] = (program_id, first position)` (one loop, for requests served together; the
        values come from one read, so all are on one device)."""
        chunks, axes, device_bytes = self._chunks, self._axes, self._device_bytes
        size = values[0].element_size() if values and host_copies.on_a_device(values[0]) else 0
        if size:
            self._device = values[0].device
        recording = self._recording
        # One pass per owner, kept lean: it runs for every request at every tap of every step.
        for (program_id, first_position), value in zip(owners, values, strict=True):
            if program_id in recording:
                self._end_records(program_id, (location,))
            axes[program_id, location] = token_axis
            chunks[program_id][location].append(Chunk((first_position, value)))
            if size:
                device_bytes[program_id] += value.numel() * size

    def start_record(self, reads: list[tuple[RunRead, list[tuple[str, int]]]], token_axis: int,
                     op: object) -> GroupRecord:
        """A step's record for a group of requests running `op` (one op of one program) whose
        value is read once per planned read (`reads`: each read and its pieces' owners, program
        id and first position); each owner's rows go on from its last step's where they follow
        on (`saves.recorded`). Then `record` at each location the group visits."""
        record = StepRecord(token_axis, self._recorded)
        recording = self._recording
        key = id(op)
        members: list[tuple[str, RecordedRows]] = []
        started = False
        # Once a step per request (not per location): kept lean.
        for index, (read, owners) in enumerate(reads):
            offsets, sizes = offsets_in(read), read.sizes
            for (program_id, first_position), chosen in zip(owners, read.chosen, strict=True):
                mine = recording.get(program_id)
                if mine is None:
                    mine = recording[program_id] = {}
                rows = mine.get(key)
                if rows is None or not rows.open or rows.end != first_position or rows.op is not op:
                    rows = mine[key] = RecordedRows(first_position, op)
                    started = True
                rows.add(record, index, offsets[chosen], sizes[chosen])
                members.append((program_id, rows))
        covered = (set.intersection(*(rows.locations for _, rows in members))
                   if members and not started else set())
        return GroupRecord(record, members, covered)

    def _end_records(self, program_id: str, locations: tuple[str, ...]) -> None:
        """A save made another way at `locations` ends the program's recorded rows that stand
        there: rows recorded after it must come after it in the chunk list, where the later
        of two rows of one position wins (a step whose joined read failed, then a recomputation
        of its positions, would otherwise have the older rows win)."""
        for rows in self._recording[program_id].values():
            if not rows.locations.isdisjoint(locations):
                rows.open = False

    def record(self, group: GroupRecord, location: str, reads: list[torch.Tensor]) -> None:
        """Keep a group's reads at `location` (one per planned read) in its step's record; each
        member not yet standing at `location` gets a chunk there for its `RecordedRows`."""
        record = group.record
        on_device = host_copies.on_a_device(reads[0])
        first_visit = not record.wholes
        record.keep(location, reads)
        if on_device:
            self._device = reads[0].device
            if first_visit:  # each member holds device rows (`collect` asks, after a spill)
                for program_id, _ in group.members:
                    self._device_bytes[program_id] += 0
        if location in group.covered:
            return
        chunks, axes, axis = self._chunks, self._axes, record.axis
        for program_id, rows in group.members:
            if location not in rows.locations:
                rows.locations.add(location)
                axes[program_id, location] = axis
                chunks[program_id][location].append(Chunk((rows.first, rows)))

    def save_pending(self, locations: tuple[str, ...], arena: SaveArena,
                     saved: list[tuple[str, int, int, int, int]]) -> list[PendingRows]:
        """`save_rows` for rows graph taps put in `arena` (`tap_saves`), the same rows at each
        of `locations`: each of `saved` is `(program_id, first position, block, row, count)`. A
        request's rows wait there, its steps' pieces in one `PendingRows` while their positions
        follow on (shared by the locations), until collected, dropped or moved to the host.
        Token axis 1. Each one's `PendingRows`, in the order of `saved`."""
        chunks, axes, device_bytes = self._chunks, self._axes, self._device_bytes
        kept_in: list[PendingRows] = []
        size = arena.device_row_bytes(len(locations))
        if size:
            self._device = arena.device
        first_location = locations[0]
        recording = self._recording
        for program_id, first_position, block, row, count in saved:
            if program_id in recording:
                self._end_records(program_id, locations)
            by_location = chunks[program_id]
            kept = by_location[first_location]
            pending = kept[-1][1] if kept else None
            if (type(pending) is not PendingRows or pending.locations != locations
                    or pending.arena is not arena or pending.end != first_position):
                if type(pending) is PendingRows:
                    pending.settle()  # a run of steps it shares (`repeated_saves`) ends here
                pending = PendingRows(arena, first_position, locations)
                for location in locations:
                    axes[program_id, location] = 1
                    by_location[location].append(Chunk((first_position, pending)))
            pending.add(block, row, count)
            kept_in.append(pending)
            if size:
                device_bytes[program_id] += count * size
        return kept_in

    def save_shared_step(self, device_bytes: list[tuple[str, int]]) -> None:
        """Count a step's rows that went into a `SharedRows` (`repeated_saves`): `(program id,
        bytes)` of each member on a device (none on the host)."""
        held = self._device_bytes
        for program_id, size in device_bytes:
            held[program_id] += size

    def spill(self, limit: int | None) -> list[str]:
        """Move every save held on a device to the host if together they exceed `limit` bytes
        (`settings.device_saves_limit`): a request's adjacent chunks are joined first, so this
        is a few batched copies however many steps saved. Called between steps. Where the move
        fails (the host out of memory), the programs it was moving fail, their saves freed, and
        they are returned (none, normally), for the step to serve them nothing more.

        `limit=None` is half of the device memory free the first time saves are held there:
        after vLLM has taken its share, what is left is ours, and the other half stays free
        for collection, which joins a request's saves on the device before they move."""
        if not self._device_bytes:
            return []
        if limit is None:
            limit = self._limit_from_free_memory()
        if self.device_bytes <= limit:
            return []
        mover = host_copies.ToHost(self._staging_buffer)
        moving = list(self._device_bytes)
        try:
            for program_id in moving:
                self._to_host(program_id, mover)
            mover.flush()
        except Exception as error:  # e.g. the host out of memory: those requests fail, not all
            logger.exception("vllm-runner: saves could not be moved to the host; the %d "
                             "requests whose saves they were fail", len(moving))
            # Some of their chunks may have moved, some not, one batch half copied: none kept.
            why = saves_lost("moved from the device to the host past the device limit", error,
                             "if the host ran out of memory, save fewer values or positions or "
                             "give the host more")
            for program_id in moving:
                self.fail(program_id, why)
                self._release(program_id)
            return moving
        return []

    def _to_host(self, program_id: str, mover: host_copies.ToHost) -> None:
        """Queue `program_id`'s device chunks on `mover`, joined where positions follow on."""
        for location, chunks in self._chunks.get(program_id, {}).items():
            chunks[:] = _resolved(chunks, location)
            axis = self._axes.get((program_id, location))
            if axis is not None and (program_id, location) not in self._fills:
                chunks[:] = _joined(chunks, axis)
            for chunk in chunks:
                if host_copies.on_a_device(chunk[1]):
                    mover.add(chunk, 1)
        self._device_bytes.pop(program_id, None)
        self._spilled.add(program_id)

    def _limit_from_free_memory(self) -> int:
        if self._automatic_limit is None:
            free = free_device_bytes(self._device)
            self._automatic_limit = (FALLBACK_DEVICE_SAVES_MIB * 2**20 if free is None
                                     else free // 2)
        return self._automatic_limit

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = host_copies.staging_buffer()
        return self._staging

    def collect(self, requests: list[ToCollect], into: Places | None = None
                ) -> dict[str, dict[str, torch.Tensor]]:
        """Everything saved for each `ToCollect`, in position order, below
        position `computed`, on the host (the client's process may have no GPU, or another one),
        each tensor in memory of its own — or, where `into` gives a request's tensors places in
        a file (`wire.SharedFiles.places`), written there and stood for by tensors on the meta
        device (`host_copies.ToHost`).

        `computed` is how many positions belong to the final output (prompt plus generated
        tokens but the last); rows beyond it came from steps the scheduler ran ahead.
        `wanted[location]` keeps a position or not (`None`: every position).

        Where the collection fails (the host out of memory, or a bug), every request of
        `requests` fails naming the cause (after any failure of its program before), its saves
        freed, and comes back with none, so the caller still gets every request's text
        (`SaveStore.error` says why); an interruption (`KeyboardInterrupt`) still goes up.
        """
        requests = [ToCollect._make(request) for request in requests]
        self.settle()  # outside: a failure there is the device's, and others' checks are in it
        try:
            return self._collect(requests, into)
        except Exception as error:
            logger.exception("vllm-runner: the saves of %d finished requests could not be "
                             "collected; those requests fail, their text comes back",
                             len(requests))
            why = saves_lost("collected", error,
                             "its text is complete. If the host or the GPU ran out of memory (a "
                             "request's saves are joined on the GPU before they move), save "
                             "fewer values or positions")
            for request in requests:
                self._errors[request.program_id] = after_earlier(
                    self._errors.get(request.program_id), why)
                self._release(request.program_id)
            return {request.program_id: {} for request in requests}

    def _collect(self, requests: list[ToCollect], into: Places | None
                 ) -> dict[str, dict[str, torch.Tensor]]:
        """`collect` where nothing fails (the store's checks settled)."""
        mover = host_copies.ToHost(self._staging_buffer)
        # A request with chunks on the host already (spilled) and on a device: all to the host
        # before joining (one tensor cannot join chunks of two devices).
        for program_id in [request.program_id for request in requests
                           if request.program_id in self._spilled]:
            if program_id in self._device_bytes:  # saved on a device since (maybe zero bytes)
                self._to_host(program_id, mover)
        mover.flush()
        found: dict[str, dict[str, torch.Tensor]] = {}
        for group in self._gathered_in_groups(requests):
            for program_id, computed, wanted in group:
                found[program_id] = self._rows(program_id, computed, wanted)
                # Request by request: at most a batch is joined at a time.
                mover.add_all(found[program_id],
                              into(program_id, found[program_id]) if into else None)
        mover.flush()
        return found

    def _gathered_in_groups(self, requests: list[ToCollect]) -> Iterator[list[ToCollect]]:
        """`requests` in order, in groups whose rows waiting in a GPU's `SaveArena` come out
        of it together (`gather_together`), and whose rows in step records too
        (`saves.recorded.gather_together`), before the group is yielded; a group holds at most
        a staging buffer's worth of them (or one request), so the gathered copies add about
        that much device memory before they move. Rows in an arena on the host come out request
        by request, each into memory of its own (together, each would be copied once more)."""
        group: list[ToCollect] = []
        waiting: list[tuple[PendingRows, str]] = []
        recorded: list[tuple[RecordedRows, str]] = []
        size = 0
        for request in requests:
            mine = []
            mine_recorded = []
            more = 0
            for location, chunks in self._chunks.get(request.program_id, {}).items():
                for _, rows in chunks:
                    if type(rows) is PendingRows and rows.arena.device.type != "cpu":
                        mine.append((rows, location))
                        more += _bytes(rows)
                    elif type(rows) is RecordedRows:
                        mine_recorded.append((rows, location))
                        more += rows.bytes_at(location)
            if group and size + more > host_copies.STAGING_BYTES:
                gather_together(waiting)
                gather_recorded(recorded)
                yield group
                group, waiting, recorded, size = [], [], [], 0
            group.append(request)
            waiting += mine
            recorded += mine_recorded
            size += more
        gather_together(waiting)
        gather_recorded(recorded)
        yield group

    def _rows(self, program_id: str, computed: int,
              wanted: dict[str, Keep]) -> dict[str, torch.Tensor]:
        """`program_id`'s saves in position order, where they were saved (host or GPU)."""
        self._forget(program_id)
        self._recording.pop(program_id, None)
        result: dict[str, torch.Tensor] = {}
        kept = self._chunks.pop(program_id, {})
        try:
            for location, chunks in kept.items():
                chunks = _resolved(chunks, location)
                axis = self._axes.pop((program_id, location), None)
                fill = self._fills.pop((program_id, location), None)
                if axis is None:
                    result[location] = chunks[0][1]
                    continue
                # A name no op declared (a `Call`'s dict of results) keeps every position.
                result[location] = _in_position_order(chunks, axis, computed,
                                                      wanted.get(location), fill)
        except BaseException:
            # Out of `_chunks` already, so out of `_release`'s reach: freed here (an arena's
            # blocks would otherwise stay held for good), an interruption's included.
            self._chunks[program_id] = kept
            self._release(program_id)
            raise
        return result

    def _forget(self, program_id: str) -> None:
        self._device_bytes.pop(program_id, None)
        self._spilled.discard(program_id)

    def drop(self, program_ids: list[str]) -> None:
        """Free what `program_ids` saved (aborted or abandoned requests)."""
        self.settle()
        for program_id in program_ids:
            self._errors.pop(program_id, None)
            self._release(program_id)

    def _release(self, program_id: str) -> None:
        """Free what `program_id` saved; its error, if any, stays to be collected."""
        self._forget(program_id)
        self._recording.pop(program_id, None)
        for location, chunks in self._chunks.pop(program_id, {}).items():
            for _, rows in chunks:
                if isinstance(rows, PendingRows | RecordedRows):
                    rows.release()
            self._axes.pop((program_id, location), None)
            self._fills.pop((program_id, location), None)

    def __len__(self) -> int:
        return len(self._chunks)


def free_device_bytes(device: torch.device | None) -> int | None:
    """Bytes free on `device` now (`None` where torch cannot say: not a CUDA device)."""
    if device is None or device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def _bytes(rows: torch.Tensor | PendingRows | RecordedRows, location: str = "") -> int:
    """What a chunk's rows (at `location`) hold, in bytes, wherever they wait."""
    if isinstance(rows, PendingRows):
        return rows.count * rows.arena.row_bytes
    if isinstance(rows, RecordedRows):
        return rows.bytes_at(location)
    return rows.numel() * rows.element_size()


def _resolved(chunks: list[Chunk], location: str) -> list[Chunk]:
    """`location`'s `chunks` with rows still in a `SaveArena` taken out of it
    (`PendingRows.gather`), and rows still in step records cut out of them
    (`RecordedRows.stretches`: one chunk per stretch without a gap)."""
    if all(type(rows) is not PendingRows and type(rows) is not RecordedRows
           for _, rows in chunks):
        return chunks
    found: list[Chunk] = []
    for first, rows in chunks:
        if type(rows) is PendingRows:
            found.append(Chunk((first, rows.gather(location))))
        elif type(rows) is RecordedRows:
            found += [Chunk(stretch) for stretch in rows.stretches(location)]
        else:
            found.append(Chunk((first, rows)))
    return found


def _joined(chunks: list[Chunk], axis: int) -> list[Chunk]:
    """`chunks` with each run of device chunks whose positions follow on joined into one, in the
    same order (so a later chunk still wins over an earlier one). Host chunks are left as they
    are (joining them again at every spill would copy a request's history over and over), and a
    run stops at `host_copies.STAGING_BYTES`, so the joined copy adds at most that much device
    memory before it moves."""
    runs: list[list[Any]] = []  # [first, end, bytes, [rows]]
    for first, rows in chunks:
        size = rows.numel() * rows.element_size()
        # A device chunk never joins a host run: their devices differ.
        if (host_copies.on_a_device(rows) and runs and runs[-1][1] == first
                and runs[-1][3][0].device == rows.device
                and runs[-1][2] + size <= host_copies.STAGING_BYTES):
            runs[-1][1] += rows.shape[axis]
            runs[-1][2] += size
            runs[-1][3].append(rows)
        else:
            runs.append([first, first + rows.shape[axis], size, [rows]])
    return [Chunk((first, parts[0] if len(parts) == 1 else torch.cat(parts, dim=axis)))
            for first, _, _, parts in runs]


def _in_position_order(chunks: list[Chunk], axis: int, computed: int, keep: Keep,
                       fill: tuple[float, bool] | None = None) -> torch.Tensor:
    """The chunks' rows by absolute position, a later chunk's row winning (preemption
    recomputes from position 0; a repeated step rewrites its rows); no rows (an empty token
    axis) when none is kept, e.g. positions the request never reached. With `fill` (its value,
    and whether a row's width is its position + 1: `SaveStore.save`), rows are padded with it
    along the last axis to the widest, then cut to the width of the last row kept where that
    is its position + 1."""
    cut = fill is not None and fill[1]
    if fill is not None:
        chunks = _padded(chunks, fill[0])
    rows = torch.cat([chunk for _, chunk in chunks], dim=axis) if len(chunks) > 1 \
        else chunks[0][1]
    # Usually each chunk starts where the previous one ended, and nothing is filtered: the rows
    # as they are, up to `computed`.
    firsts = [first for first, _ in chunks]
    ends = [first + chunk.shape[axis] for first, chunk in chunks]
    if keep is None and firsts[1:] == ends[:-1]:
        end = max(min(ends[-1], computed), firsts[0])
        kept = rows.narrow(axis, 0, end - firsts[0])
        return kept[..., :end] if cut else kept
    positions = [first + offset for first, chunk in chunks for offset in range(chunk.shape[axis])]
    latest = {position: index for index, position in enumerate(positions)}
    wanted = [p for p in sorted(latest) if p < computed and (keep is None or keep(p))]
    indices = [latest[p] for p in wanted]
    if indices and indices == list(range(indices[0], indices[0] + len(indices))):
        # A run without gaps (a probe's one row, the rows a filter kept at save time): a view, as
        # above. An index on a GPU is a host-to-device copy that waits for the device, and a
        # gather, for every request and location: most of a probe's collection at the 8B shape
        # (8,192 saves, 0.55-0.91 s a run).
        kept = rows.narrow(axis, indices[0], len(indices))
    else:
        kept = rows.index_select(axis, rows.new_tensor(indices, dtype=torch.long))
    return kept[..., :wanted[-1] + 1 if wanted else 0] if cut else kept


def _padded(chunks: list[Chunk], fill: float) -> list[Chunk]:
    """`chunks` padded with `fill` along their last axis to the widest one's width."""
    width = max(chunk.shape[-1] for _, chunk in chunks)
    return [Chunk((first, chunk if chunk.shape[-1] == width else torch.nn.functional.pad(
        chunk, (0, width - chunk.shape[-1]), value=fill))) for first, chunk in chunks]
