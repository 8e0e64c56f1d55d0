"""Files in shared memory (`/dev/shm`) that carry a request's saves from the engine core's process
to its client on the same host, instead of vLLM's socket.

With the engine core in a process of its own (vLLM's default on a GPU), saves sent as message bytes
were copied four more times after the worker had them (into the message, through the socket twice,
out of the message): several times the cost of the same saves with the client in the engine core's
process (docs/benchmarks.md). Through a file the worker copies each tensor once, with `pwrite` (no
mapping: a full `/dev/shm` is an error there, never a SIGBUS later; and no page is zeroed before it
is written) straight from its staging buffer as the saves reach the host (`SharedFile`, written by
`host_copies.ToHost`), and the client maps the file and unlinks it at once: the tensors are views of
that mapping, memory of their own that is freed when the last of the request's tensors is.

Shared memory is shared with vLLM's own message queues and with every other program on the host,
and saves a client keeps stay in it: a file is written only while a quarter of `/dev/shm` (at
least `KEEP_FREE_BYTES`) would stay free after it; otherwise the saves go inside the message.
A file no client opened (it died, or its task was cancelled while the result was on its way) is
removed by the first write `ABANDONED_AFTER_S` after it was made — a client maps its files within
milliseconds — whichever process made it (one killed cannot clean up), and a worker's files are
removed when its process exits.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import multiprocessing.util
import os
import socket
import threading
import time
import uuid

import torch

from vllm_runner.saves.per_process import PerProcess

DIRECTORY = "/dev/shm"
_PREFIX = "vllm-interp-"
#: Seconds after which a file no client has opened is taken as abandoned and removed.
ABANDONED_AFTER_S = 600.0
#: Bytes of shared memory a file may never eat into (at least; a quarter of it if that is more).
KEEP_FREE_BYTES = 256 * 2**20
_PRUNE_EVERY_S = 30.0  # how often the directory is looked at for abandoned files


class _Made:
    """This process's files not known to be gone yet (for removal at exit), and when the
    directory was last pruned; made anew in a forked child, which owns none of them."""

    def __init__(self) -> None:
        self.paths: set[str] = set()
        self.pruned = time.monotonic() - _PRUNE_EVERY_S  # the first write prunes
        self.lock = threading.Lock()
        # At exit: `atexit` for a main process, multiprocessing's finalizers for a process it
        # started (a forked child leaves through `os._exit`, which runs no `atexit` handler).
        atexit.register(remove_left_behind)
        multiprocessing.util.Finalize(None, remove_left_behind, exitpriority=10)


MADE = PerProcess(_Made)


def identity() -> str | None:
    """Which shared memory this process sees (host name, device and inode of `/dev/shm`), or
    `None` where there is none: a worker writes files only for a client that sees the same (a
    container on the same host, even with the host's name, may have its own)."""
    try:
        found = os.stat(DIRECTORY)
    except OSError:
        return None
    return f"{socket.gethostname()}:{found.st_dev}:{found.st_ino}"


class SharedFile:
    """A file in shared memory being written (`create`), `size` bytes long from the start (a
    hole until written: nothing allocated), bytes going in at given offsets from several
    threads at once. It holds no descriptor between writes (a collection makes one file per
    request, thousands of them may be open at once, and a descriptor closed under a late
    writer could be reused by another file). A failed write (shared memory full) marks it
    `failed`, and later writes are refused, so its request's saves go another way (`read_at`
    gives back what was written)."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size, self.failed = path, size, False

    def write_at(self, data: memoryview, offset: int) -> bool:
        """Write `data` at `offset`; `False` (and the file `failed`) where it did not fit, where
        the file is gone (discarded), or where an earlier write had failed."""
        if self.failed:
            return False
        remaining = data.cast("B")
        try:
            descriptor = os.open(self.path, os.O_WRONLY)  # never created: gone is a failure
        except OSError:
            self.failed = True
            return False
        try:
            while remaining:
                written = os.pwrite(descriptor, remaining, offset)
                remaining, offset = remaining[written:], offset + written
        except OSError:  # ENOSPC: shared memory filled since `create` (never a SIGBUS later)
            self.failed = True
            return False
        finally:
            os.close(descriptor)
        return True

    def read_at(self, offset: int, size: int) -> bytearray:
        """The `size` bytes at `offset` (written by `write_at`), in memory of their own."""
        found = bytearray(size)
        view = memoryview(found)
        descriptor = os.open(self.path, os.O_RDONLY)
        try:
            while view:
                read = os.preadv(descriptor, [view], offset)
                if not read:
                    raise RuntimeError(f"{self.path} ended {len(view)} bytes before offset "
                                       f"{offset + size}")
                view, offset = view[read:], offset + read
        finally:
            os.close(descriptor)
        return found

    def discard(self) -> None:
        """Remove the file (no client will open it)."""
        _forget(MADE.get(), self.path)


def create(size: int) -> SharedFile | None:
    """A new file in shared memory of `size` bytes for `SharedFile.write_at`, or `None` where
    shared memory cannot hold it (no `/dev/shm`, too little room): the caller sends the bytes
    another way. Safe to call from several threads at once."""
    if size <= 0 or not _has_room(size):
        return None
    state = MADE.get()
    _prune(state)
    path = os.path.join(DIRECTORY, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    with state.lock:
        state.paths.add(path)
    try:
        os.ftruncate(descriptor, size)  # its size for `attach` to check; a hole until written
    except OSError:
        _forget(state, path)
        return None
    finally:
        os.close(descriptor)
    return SharedFile(path, size)


def attach(path: str, size: int) -> torch.Tensor:
    """The file `write` made, mapped as a 1-D byte tensor of `size` bytes, and removed from
    the file system (its memory stays until the tensor and every view of it are gone)."""
    try:
        descriptor = os.open(path, os.O_RDWR)  # never created: a missing file is an error
    except OSError as error:
        raise RuntimeError(
            f"saves were sent through {path}, which this process cannot open ({error}): is "
            "the engine core on another host? Set VLLM_INTERP_SHARED_SAVES=0 to send them "
            "through vLLM's socket") from error
    try:
        found = os.fstat(descriptor).st_size
        if found != size or size <= 0:
            raise RuntimeError(f"saves were sent through {path} of {size} bytes, but it holds "
                               f"{found}")
        # The tensor keeps the mapping alive; the mapping outlives the descriptor and the name.
        return torch.frombuffer(mmap.mmap(descriptor, size), dtype=torch.uint8)
    finally:
        os.close(descriptor)
        _unlink(path)


def remove(paths: list[str]) -> None:
    """Remove these files where they still exist (a client that could not decode them)."""
    for path in paths:
        _unlink(path)


def remove_left_behind() -> None:
    """Remove this process's files that no client opened (run at exit)."""
    state = MADE.current()
    if state is None:
        return
    with state.lock:
        paths, state.paths = state.paths, set()
    for path in paths:
        _unlink(path)


def _has_room(size: int) -> bool:
    try:
        found = os.statvfs(DIRECTORY)
    except OSError:
        return False
    total, free = found.f_blocks * found.f_frsize, found.f_bavail * found.f_frsize
    return free - size >= max(KEEP_FREE_BYTES, total // 4)


def _prune(state: _Made) -> None:
    """At most every `_PRUNE_EVERY_S`: remove every file of ours in the directory not touched
    for `ABANDONED_AFTER_S` (any process's), and forget this process's files clients removed."""
    now = time.monotonic()
    with state.lock:
        if now - state.pruned < _PRUNE_EVERY_S:
            return
        state.pruned = now
    oldest = time.time() - ABANDONED_AFTER_S
    with contextlib.suppress(OSError):
        for entry in os.scandir(DIRECTORY):
            if entry.name.startswith(_PREFIX):
                with contextlib.suppress(OSError):
                    if entry.stat().st_mtime < oldest:
                        _unlink(entry.path)
    with state.lock:
        state.paths = {path for path in state.paths if os.path.exists(path)}


def _forget(state: _Made, path: str) -> None:
    _unlink(path)
    with state.lock:
        state.paths.discard(path)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
