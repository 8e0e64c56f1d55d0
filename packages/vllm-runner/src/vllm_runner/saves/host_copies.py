"""Moving saved tensors from a GPU to the host in few, fast copies.

A copy per tensor waits for the device each time (with every layer saved for 64 requests, a
noticeable share of a run), and a copy into fresh pageable memory is slowed by page faults (most of
the cost of a run saving every layer's MLP neurons); a pinned allocation per copy is slower still
(docs/benchmarks.md). So device tensors are joined per dtype and copied in batches through one
pinned staging buffer, allocated once per worker and reused, then copied from it into host tensors
of their own; the extra device memory of a batch stays bounded by the buffer's size.

That last copy writes into fresh memory, and first writes to fresh pages are what cost (the kernel
faults each page in and zeroes it), at a few GB/s for one thread: a noticeable share of a run that
saves one layer for every request (docs/benchmarks.md). The copy is split by bytes over a few
threads (`LANDING_THREADS`; torch's copies release the GIL), so the faults are taken on several
cores at once. Saves bound for a file in shared memory (a client in another process: `wire`) skip
that copy: their bytes go from the staging buffer straight into the file (`FileFor`).

The staging buffer has two halves, each a batch: a batch's device-to-host copy is launched
into one half without waiting, and the host then writes out the batch before it from the other
half, so the device's copy (and the gathers queued before it) overlap the host's writes —
with every layer saved for 64 requests a collection is many batches.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, MutableMapping, MutableSequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, NamedTuple

import torch

from vllm_runner.saves.per_process import PerProcess
from vllm_runner.saves.shm_files import SharedFile

STAGING_BYTES = 64 * 2**20
_ALIGN = 64  # bytes: every tensor starts at an offset any dtype can be viewed at
#: How many threads write a batch into host memory; below `PARALLEL_BYTES` one does it (handing
#: work to a pool costs tens of microseconds, more than a small copy).
LANDING_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1)
PARALLEL_BYTES = 4 * 2**20

# Where a tensor waiting to move lives: `holder[slot]` (a dict of saves and its location, or a
# chunk `[first position, rows]` and 1), replaced by the host tensor once copied.
Holder = MutableMapping[str, Any] | MutableSequence[Any]


class FileFor(NamedTuple):
    """Where a tensor's bytes go instead of host memory of its own: `offset` in a file in
    shared memory being written for its client."""

    file: SharedFile
    offset: int


# A tensor waiting in a batch: where it lives, the tensor, and the file its bytes go into (if any).
_Waiting = tuple[Holder, Any, torch.Tensor, FileFor | None]


def on_a_device(rows: torch.Tensor) -> bool:
    """Whether `rows` are off the host (a GPU's memory)."""
    return rows.device.type != "cpu"


def staging_buffer() -> torch.Tensor:
    """The host buffer device tensors cross through, two batches of `STAGING_BYTES`: pinned
    where CUDA is, so each copy is one direct transfer that need not be waited for at once
    (plain memory otherwise: host tensors never use it)."""
    return torch.empty(2 * STAGING_BYTES, dtype=torch.uint8,
                       pin_memory=torch.cuda.is_available())


class _Staged(NamedTuple):
    """A batch whose device-to-host copies were launched: per dtype, its entries and their
    bytes' place in the staging buffer; `done` is recorded after the copies (`None` where
    they were synchronous: no CUDA)."""

    groups: list[tuple[list[_Waiting], torch.Tensor]]
    done: Any


class ToHost:
    """Replaces device tensors by host tensors of their own memory, in batches.

    Host tensors are left where they are, except slices, which are cloned: a slice of a step
    read shared by several requests (`row_serving.serve_together`) would otherwise keep every
    request's rows alive. A tensor given a `FileFor` has its bytes written into that file
    instead (from the staging buffer for a device tensor) and is replaced by a tensor of its
    dtype and shape on the meta device (no memory); where the file's write fails (shared
    memory filled up), it gets memory of its own as any other."""

    def __init__(self, staging: Callable[[], torch.Tensor]) -> None:
        self._staging = staging
        self._batch: list[_Waiting] = []
        self._size = 0
        self._staged: _Staged | None = None  # launched, not yet written out
        self._half = 0  # the half of the staging buffer the next batch goes into

    def add(self, holder: Holder, slot: Any, into: FileFor | None = None) -> None:
        """Move `holder[slot]` to the host (or `into` a file): now if it is there already or
        too large for a batch, else with its batch (by `flush` at the latest)."""
        rows = holder[slot]
        if not on_a_device(rows):
            if into is not None and write_into(into, rows):
                holder[slot] = _placeholder(rows)
            elif rows.untyped_storage().nbytes() != rows.numel() * rows.element_size():
                holder[slot] = rows.clone()
            return
        size = _aligned(rows.numel() * rows.element_size())
        if size > STAGING_BYTES:  # one save of over 64 MiB (long prompts): window by window
            self.flush()  # the whole buffer is the window
            holder[slot] = _copy_through(rows, self._staging(), into)
            return
        if self._size + size > STAGING_BYTES:
            self._launch()
        self._batch.append((holder, slot, rows, into))
        self._size += size

    def add_all(self, saved: dict[str, torch.Tensor],
                into: dict[str, FileFor] | None = None) -> None:
        """`add` every tensor of a request's saves (`into` their places in a file, if given)."""
        for location in saved:
            self.add(saved, location, into.get(location) if into else None)

    def flush(self) -> None:
        """Copy the waiting device tensors now (every `holder[slot]` is on the host after)."""
        self._launch()
        staged, self._staged = self._staged, None
        if staged is not None:
            _write_out(staged)

    def _launch(self) -> None:
        """Launch the waiting batch's copies into the free half of the staging buffer, then
        write out the batch launched before it while they run."""
        if not self._batch:
            return
        buffer = self._staging()
        half = buffer.numel() // 2
        staged = _stage(self._batch, buffer[self._half * half:(self._half + 1) * half])
        self._batch, self._size, self._half = [], 0, 1 - self._half
        earlier, self._staged = self._staged, staged
        if earlier is not None:
            _write_out(earlier)


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def _copy_through(rows: torch.Tensor, staging: torch.Tensor, into: FileFor | None = None
                  ) -> torch.Tensor:
    """`rows` on the host, copied through `staging` one window of its size at a time; with
    `into`, written window by window from there into its file, and a placeholder returned
    (where a write fails, the tensor gets memory of its own, the windows written already read
    back into it)."""
    flat = rows.reshape(-1)
    host = None if into is not None else torch.empty(rows.shape, dtype=rows.dtype)
    usable = staging.numel() // rows.element_size() * rows.element_size()
    window = staging[:usable].view(rows.dtype)
    for start in range(0, flat.numel(), window.numel()):
        count = min(window.numel(), flat.numel() - start)
        window[:count].copy_(flat[start:start + count])  # waits for the device
        if host is None and into is not None:
            written = start * rows.element_size()
            if write_into(FileFor(into.file, into.offset + written), window[:count]):
                continue
            host = torch.empty(rows.shape, dtype=rows.dtype)
            read_back(into, flat_bytes(host)[:written])
        assert host is not None
        land([(host.view(-1)[start:start + count], window[:count])])
    return host if host is not None else _placeholder(rows)


def _stage(batch: list[_Waiting], staging: torch.Tensor) -> _Staged:
    """Launch one device-to-host copy per dtype for `batch` (at most `STAGING_BYTES` together,
    each tensor's bytes aligned) into `staging`, without waiting for them."""
    by_dtype: dict[torch.dtype, list[_Waiting]] = defaultdict(list)
    for entry in batch:
        by_dtype[entry[2].dtype].append(entry)
    groups = []
    at = 0
    for dtype, entries in by_dtype.items():
        flat = torch.cat([entry[2].reshape(-1) for entry in entries])
        size = flat.numel() * flat.element_size()
        landed = staging[at:at + size].view(dtype)
        landed.copy_(flat, non_blocking=True)  # into pinned memory: the host goes on
        groups.append((entries, landed))
        at += _aligned(size)
    done = None
    if torch.cuda.is_available() and on_a_device(batch[0][2]):
        done = torch.cuda.Event()
        done.record()
    return _Staged(groups, done)


def _write_out(staged: _Staged) -> None:
    """Once `staged`'s copies are done, give each entry its own host tensor, or write its bytes
    from the staging buffer into its file (several files on several threads)."""
    if staged.done is not None:
        staged.done.synchronize()
    for entries, landed in staged.groups:
        pieces = landed.split([entry[2].numel() for entry in entries])
        written = iter(in_parallel([partial(write_into, into, piece) for (*_, into), piece
                                    in zip(entries, pieces, strict=True) if into is not None]))
        pairs = []
        for (holder, slot, rows, into), piece in zip(entries, pieces, strict=True):
            if into is not None and next(written):
                holder[slot] = _placeholder(rows)
                continue
            holder[slot] = torch.empty(rows.shape, dtype=rows.dtype)
            pairs.append((holder[slot].view(-1), piece))
        land(pairs)


def write_into(into: FileFor, rows: torch.Tensor) -> bool:
    """Write host `rows`' bytes at `into`'s place in its file; whether they went in (a file
    that failed once takes nothing more)."""
    if not rows.numel():
        return True
    return into.file.write_at(flat_bytes(rows).numpy().data, into.offset)


def read_back(into: FileFor, destination: torch.Tensor) -> None:
    """Fill `destination` (1-D bytes) with what `write_into` put at `into`'s place."""
    if destination.numel():
        destination.copy_(torch.frombuffer(into.file.read_at(into.offset, destination.numel()),
                                           dtype=torch.uint8))


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bytes as a 1-D uint8 tensor (a contiguous copy first where it is strided)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def _placeholder(rows: torch.Tensor) -> torch.Tensor:
    """What stands for a tensor written into a file: its dtype and shape, no memory."""
    return torch.empty(rows.shape, dtype=rows.dtype, device="meta")


def land(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each pair's host source (1-D) into its destination (1-D, fresh memory), the bytes
    split evenly over up to `LANDING_THREADS` threads: most of the time goes to faulting the
    destination's pages in, which cores do side by side."""
    total = sum(source.numel() * source.element_size() for _, source in pairs)
    threads = min(LANDING_THREADS, total // max(1, PARALLEL_BYTES // 4))  # >= 1/4 of it each
    if total < PARALLEL_BYTES or threads < 2:
        _copy_all(pairs)
        return
    in_parallel([partial(_copy_all, share) for share in _shares(pairs, total, threads)])


def in_parallel(calls: list[Callable[[], Any]]) -> list[Any]:
    """Each call's result, in order, the calls run side by side on the landing threads (for
    work that writes fresh memory, as `land`'s copies do), each under the caller's inference
    mode."""
    if len(calls) < 2 or LANDING_THREADS < 2:
        return [call() for call in calls]
    return list(_landing_pool().map(partial(_called, inference=torch.is_inference_mode_enabled()),
                                    calls))


def _called(call: Callable[[], Any], inference: bool) -> Any:
    # Inference mode is a thread's own: a landing thread takes its caller's, or it could not
    # write into the host tensors made under vLLM's inference mode (inference tensors).
    with torch.inference_mode(inference):
        return call()


def _shares(pairs: list[tuple[torch.Tensor, torch.Tensor]], total: int, threads: int
            ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """`pairs` cut into `threads` lists of slices of about `total / threads` bytes each, in
    order (a pair may be cut between two lists, never an element: a share is at least one
    element of every pair, or a share smaller than an element would take nothing from it and
    the lists would grow without end — seen as a worker killed at 20 GB in CI)."""
    share = max(-(-total // threads), *(source.element_size() for _, source in pairs))
    shares: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    room = share
    for destination, source in pairs:
        size = source.element_size()
        start, count = 0, source.numel()
        while start < count:
            if room < size:
                shares.append([])
                room = share
            take = min(count - start, room // size)
            shares[-1].append((destination[start:start + take], source[start:start + take]))
            start += take
            room -= take * size
    return shares


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for destination, source in pairs:
        destination.copy_(source)


def _new_landing_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(LANDING_THREADS, thread_name_prefix="interp-land")


#: The threads that write batches into host memory, started at the first large batch; one pool
#: per process (a forked child has the parent's pool object but none of its threads).
LANDING_POOLS = PerProcess(_new_landing_pool)


def _landing_pool() -> ThreadPoolExecutor:
    return LANDING_POOLS.get()
