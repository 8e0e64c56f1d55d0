"""Files in shared memory (`/dev/shm`) that carry a request's saves from the engine core's process
to its client on the same host, instead of vLLM's socket.

With the engine core in a process of its own (vLLM's default on a GPU), saves sent as message
bytes were copied four more times after the worker had them (into the message, through the
socket twice, out of the message): 0.13-0.16 s for 71 MB on the H200's host, against 0.016 s
with the client in the engine core's process (Llama-1B, one layer saved for 64 requests,
2026-12-04). Through a file the worker copies each tensor once, with `pwrite` (no mapping: a full
`/dev/shm` is an error there, never a SIGBUS later; and no page is zeroed before it is written),
and the client maps the file and unlinks it at once: the tensors are views of that mapping,
memory of their own that is freed when the last of the request's tensors is.

A file no client opened (it died, or its task was cancelled while the result was on its way) is
removed after `ABANDONED_AFTER_S` — a client maps its files within milliseconds — or when the
worker's process exits, so a long-running server cannot fill `/dev/shm` (which vLLM's own
message queues use) with saves nobody will read.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import uuid

import torch

DIRECTORY = "/dev/shm"
_PREFIX = "vllm-interp-"
#: Seconds after which a file no client has opened is taken as abandoned and removed.
ABANDONED_AFTER_S = 600.0
_PRUNE_EVERY_S = 30.0  # how often the files made are looked at again
_made: dict[str, float] = {}  # this process's files not known to be gone yet: when made
_pruned: list[float] = [0.0]  # when they were last looked at
_cleanup: list[bool] = []  # whether `remove_left_behind` is registered to run at exit
_lock = threading.Lock()


def write(pieces: list[memoryview], size: int) -> str | None:
    """A new file in shared memory holding `pieces` back to back (`size` bytes in all), or
    `None` where shared memory cannot hold it (no `/dev/shm`, too little room): the caller
    sends the bytes another way. Safe to call from several threads at once."""
    if size <= 0 or not os.path.isdir(DIRECTORY):
        return None
    path = os.path.join(DIRECTORY, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        offset = 0
        for piece in pieces:
            remaining = piece.cast("B")
            while remaining:
                written = os.pwrite(descriptor, remaining, offset)
                remaining, offset = remaining[written:], offset + written
    except OSError:  # ENOSPC: a full /dev/shm says so here, never as a SIGBUS in a mapping
        _unlink(path)
        return None
    finally:
        os.close(descriptor)
    _remember(path)
    return path


def attach(path: str, size: int) -> torch.Tensor:
    """The file `write` made, mapped as a 1-D byte tensor of `size` bytes, and removed from
    the file system (its memory stays until the tensor and every view of it are gone)."""
    try:
        found = os.stat(path).st_size
    except OSError as error:
        raise RuntimeError(
            f"saves were sent through {path}, which this process cannot open ({error}): is "
            "the engine core on another host? Set VLLM_INTERP_SHARED_SAVES=0 to send them "
            "through vLLM's socket") from error
    try:
        if found != size:
            raise RuntimeError(f"saves were sent through {path} of {size} bytes, but it holds "
                               f"{found}")
        return _mapped(path, size)
    finally:
        _unlink(path)


def remove(paths: list[str]) -> None:
    """Remove these files where they still exist (a client that could not decode them)."""
    for path in paths:
        _unlink(path)


def _mapped(path: str, size: int) -> torch.Tensor:
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=size)
    return torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]


def _remember(path: str) -> None:
    """Keep `path` for removal at exit; now and then forget the files clients have removed and
    remove those abandoned (see above)."""
    now = time.monotonic()
    with _lock:
        if not _cleanup:
            atexit.register(remove_left_behind)
            _cleanup.append(True)
        if now - _pruned[0] >= _PRUNE_EVERY_S:
            _pruned[0] = now
            for made, when in list(_made.items()):
                if now - when >= ABANDONED_AFTER_S:
                    _unlink(made)
                if now - when >= ABANDONED_AFTER_S or not os.path.exists(made):
                    del _made[made]
        _made[path] = now


def remove_left_behind() -> None:
    """Remove this process's files that no client opened (registered at exit)."""
    with _lock:
        for path in list(_made):
            _unlink(path)
        _made.clear()


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
