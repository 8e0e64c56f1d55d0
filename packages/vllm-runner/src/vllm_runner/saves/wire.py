"""Collected saves as plain data, for a client in another process than the worker.

vLLM's RPC results cross processes as msgpack (engine core to client) and pickle (worker to
engine core under tensor parallelism) of plain data, so each tensor travels as its dtype, shape
and raw bytes. This costs two copies fewer than `torch.save`/`torch.load` around the RPC
(measured: 0.92 GB of saves through vLLM's msgpack encoder and decoder in 1.3 s, 2.35 s with
`torch.save`), and the client unpickles no code.

Where the worker's result goes straight to vLLM's msgpack encoder (the worker runs in the engine
core's process: `views=True`), each tensor's bytes travel as a memoryview of its memory, which the
encoder reads once into its message; `bytes` would copy them first, in the worker's time.
Under tensor parallelism the result is
pickled to the engine core first, and pickle refuses memoryviews: there they travel as `bytes`.

The client copies each tensor out of the received message into memory of its own, on several
threads at once (`host_copies.land`): like the worker's copies out of its staging buffer, these
write fresh pages, which one thread alone does at a few GB/s.

A client on the worker's host with a single worker takes large saves through files in shared
memory instead (`shm_files`, `SharedFiles`): the collection writes them there from its staging
buffer as they reach the host (one copy in the worker), and the client maps the files (none).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from vllm_runner.errors import after_earlier, saves_lost
from vllm_runner.saves import host_copies, shm_files
from vllm_runner.saves.host_copies import FileFor

logger = logging.getLogger("vllm.interp")

# One collection: program id -> {"error": str | None, "saved": {location: tensor}}; encoded, each
# result also names its `"segment"` in shared memory (`[path, bytes]`) or `None`.
Collected = dict[str, dict[str, Any]]


#: A request's saves smaller than this go inside the message even where shared memory is offered:
#: a file costs tens of microseconds to make, map and remove.
SHARED_MIN_BYTES = 2**20
_ALIGN = 64  # bytes: every tensor in a file starts where any dtype can be viewed


class SharedFiles:
    """The files in shared memory one collection writes its large requests' saves into, for a
    client on this host: one per request whose saves come to `SHARED_MIN_BYTES` or more, while
    shared memory has room (`shm_files.create`); the rest go inside the message."""

    def __init__(self) -> None:
        self.files: dict[str, shm_files.SharedFile] = {}

    def places(self, program_id: str, saved: dict[str, torch.Tensor]
               ) -> dict[str, FileFor] | None:
        """Where each of a request's tensors goes in a new file of its own (`_offsets`), or
        `None` where they go inside the message (for `host_copies.ToHost.add_all`)."""
        offsets, size = _offsets(saved.values())
        if size < SHARED_MIN_BYTES:
            return None
        file = shm_files.create(size)
        if file is None:
            return None
        self.files[program_id] = file
        return {location: FileFor(file, offset)
                for location, offset in zip(saved, offsets, strict=True)}

    def discard(self) -> None:
        """Remove every file (the collection failed: no client will open them)."""
        for file in self.files.values():
            file.discard()
        self.files.clear()


def encode(collected: Mapping[str, Mapping[str, Any]], views: bool = False,
           files: SharedFiles | None = None) -> Collected:
    """`collected` with each host tensor replaced by `[dtype name, shape, raw bytes]`: `bytes`,
    or with `views` a memoryview of the tensor's own memory (for msgpack only: see above).

    A request given a file by `files` (the client runs on this host) has its tensors there,
    written as they reached the host (tensors on the meta device stand for them); its
    result names the file in its `"segment"` as `[path, bytes]`, and each tensor travels as
    `[dtype name, shape, offset in the file]`. Where a file's writes failed (shared memory
    filled up), its request's saves are read back and go inside the message. A request whose
    saves cannot be encoded (the host out of memory for a copy) comes back with none and the
    cause in its error, its file removed, the others as they were; every file is removed if
    encoding is interrupted."""
    files = files or SharedFiles()
    try:
        return {program_id: _encoded_or_failed(program_id, result, views, files)
                for program_id, result in collected.items()}
    except BaseException:
        files.discard()
        raise


def _encoded_or_failed(program_id: str, result: Mapping[str, Any], views: bool,
                       files: SharedFiles) -> dict[str, Any]:
    """`_encode_result`, or where it fails, the request with no saves and the cause added to
    its error: one request's failure costs the others nothing."""
    file = files.files.get(program_id)
    try:
        return _encode_result(result, views, file)
    except Exception as error:
        logger.exception("vllm-runner: the saves of request %s could not be sent", program_id)
        if file is not None:
            file.discard()
        why = saves_lost("sent from the engine", error,
                         "its text is complete. If the host ran out of memory, save fewer values "
                         "or positions, or give the host more")
        return {"error": after_earlier(result["error"], why), "segment": None, "saved": {}}


def decode(data: Collected) -> Collected:
    """The inverse of `encode`: each request's tensors, writable (the user may edit them in
    place) and in memory no one else writes: copied out of the message all at once, or views of
    the request's file in shared memory, mapped and removed (its memory is freed with the last
    of the request's tensors). Every file named in `data` is removed, even where decoding
    fails."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    segments = _segment_paths(data)
    try:
        decoded = {program_id: {"error": result["error"],
                                "saved": _decode_saved(result, copies)}
                   for program_id, result in data.items()}
        host_copies.land(copies)
    finally:
        shm_files.remove(segments)
    return decoded


def _segment_paths(data: Any) -> list[str]:
    """The files named in encoded `data`, however malformed the rest of it (they are removed
    whatever happens to the decoding)."""
    results = data.values() if isinstance(data, dict) else ()
    segments = [result.get("segment") for result in results if isinstance(result, dict)]
    return [segment[0] for segment in segments
            if isinstance(segment, list | tuple) and segment and isinstance(segment[0], str)]


def _encode_result(result: Mapping[str, Any], views: bool, file: shm_files.SharedFile | None
                   ) -> dict[str, Any]:
    """One request's result as plain data (see `encode`): its tensors in `file`, or in the
    message."""
    saved: dict[str, torch.Tensor] = result["saved"]
    offsets, size = _offsets(saved.values())
    # A file with nothing in it: its request's collection failed after the file was made.
    if file is not None and (file.failed or not saved
                             or not all(tensor.is_meta for tensor in saved.values())):
        saved = {location: _read_back(file, tensor, offset) for (location, tensor), offset
                 in zip(saved.items(), offsets, strict=True)}
        file.discard()
        file = None
    if file is None:
        return {"error": result["error"], "segment": None,
                "saved": {location: _encode_tensor(tensor, views)
                          for location, tensor in saved.items()}}
    return {"error": result["error"], "segment": [file.path, size],
            "saved": {location: [_dtype_name(tensor), list(tensor.shape), offset]
                      for (location, tensor), offset in zip(saved.items(), offsets,
                                                            strict=True)}}


def _read_back(file: shm_files.SharedFile, tensor: torch.Tensor, offset: int) -> torch.Tensor:
    """`tensor` in memory of its own: itself, or (on the meta device) its bytes read back from
    `file`, where they were written before the file failed."""
    if not tensor.is_meta:
        return tensor
    found = torch.empty(tensor.shape, dtype=tensor.dtype)
    host_copies.read_back(FileFor(file, offset), host_copies.flat_bytes(found))
    return found


def _offsets(tensors: Any) -> tuple[list[int], int]:
    """Where each tensor starts in a file holding them all, and the file's size."""
    offsets, size = [], 0
    for tensor in tensors:
        offsets.append(size)
        size += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    return offsets, size


def _decode_saved(result: dict[str, Any], copies: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> dict[str, torch.Tensor]:
    """One request's tensors: views of its file, or empty tensors whose copies out of the
    message are added to `copies`."""
    segment = result.get("segment")
    if not segment:
        return {location: _decode_tensor(encoded, copies)
                for location, encoded in result["saved"].items()}
    path, size = segment
    mapped = shm_files.attach(path, size)
    return {location: _view(mapped, encoded) for location, encoded in result["saved"].items()}


def _view(mapped: torch.Tensor, encoded: list[Any]) -> torch.Tensor:
    dtype, shape, offset = encoded
    tensor = torch.empty(shape, dtype=_dtype(dtype))
    size = tensor.numel() * tensor.element_size()
    if not size:
        return tensor
    if not 0 <= offset <= mapped.numel() - size or offset % _ALIGN:
        raise ValueError(f"a collected {dtype} tensor of shape {shape} lies at bytes "
                         f"{offset}:{offset + size} of a file of {mapped.numel()}")
    return mapped[offset:offset + size].view(tensor.dtype).view(tensor.shape)


def _dtype(name: str) -> torch.dtype:
    kind = getattr(torch, name, None)
    if not isinstance(kind, torch.dtype):
        raise ValueError(f"collected saves name an unknown dtype {name!r}")
    return kind


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _encode_tensor(tensor: torch.Tensor, views: bool) -> list[Any]:
    # The array keeps the tensor alive, and the memoryview the array, until the message is sent.
    flat = host_copies.flat_bytes(tensor).numpy()
    return [_dtype_name(tensor), list(tensor.shape), flat.data if views else flat.tobytes()]


def _decode_tensor(encoded: list[Any], copies: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> torch.Tensor:
    """An empty tensor of `encoded`'s dtype and shape, with the copy of its raw bytes into it
    added to `copies` (as 1-D byte tensors: destination, source)."""
    dtype, shape, raw = encoded
    tensor = torch.empty(shape, dtype=_dtype(dtype))
    size = tensor.numel() * tensor.element_size()
    if len(memoryview(raw).cast("B")) != size:
        raise ValueError(f"a collected {dtype} tensor of shape {shape} came with "
                         f"{len(memoryview(raw).cast('B'))} bytes instead of {size}")
    if size:
        with warnings.catch_warnings():
            # torch warns that `bytes` are read-only; the source is only read from.
            warnings.simplefilter("ignore", UserWarning)
            source = torch.frombuffer(raw, dtype=torch.uint8)
        copies.append((tensor.view(-1).view(torch.uint8), source))
    return tensor
