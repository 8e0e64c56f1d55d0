"""Collected saves as plain data, for a client in another process than the worker.

vLLM's RPC results cross processes as msgpack (engine core to client) and pickle (worker to
engine core under tensor parallelism) of plain data, so each tensor travels as its dtype, shape
and raw bytes. This costs two copies fewer than `torch.save`/`torch.load` around the RPC
(measured: 0.92 GB of saves through vLLM's msgpack encoder and decoder in 1.3 s, 2.35 s with
`torch.save`), and the client unpickles no code.

Where the worker's result goes straight to vLLM's msgpack encoder (the worker runs in the engine
core's process: `views=True`), each tensor's bytes travel as a memoryview of its memory, which the
encoder reads once into its message; `bytes` would copy them first (68 MB of saves: ~50 ms of
the worker's time on this project's CPU, 2026-12-03). Under tensor parallelism the result is
pickled to the engine core first, and pickle refuses memoryviews: there they travel as `bytes`.

The client copies each tensor out of the received message into memory of its own, on several
threads at once (`host_copies.land`): like the worker's copies out of its staging buffer, these
write fresh pages, one thread's ~3.5 GB/s on the H200's host.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from vllm_runner import host_copies

# One collection: program id -> {"error": str | None, "saved": {location: tensor}}.
Collected = dict[str, dict[str, Any]]


def encode(collected: Collected, views: bool = False) -> Collected:
    """`collected` with each host tensor replaced by `[dtype name, shape, raw bytes]`: `bytes`,
    or with `views` a memoryview of the tensor's own memory (for msgpack only: see above)."""
    return {program_id: {"error": result["error"],
                         "saved": {location: _encode_tensor(tensor, views)
                                   for location, tensor in result["saved"].items()}}
            for program_id, result in collected.items()}


def decode(data: Collected) -> Collected:
    """The inverse of `encode`: each request's tensors, each in memory of its own (writable:
    the user may edit them in place), copied there all at once."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    decoded = {program_id: {"error": result["error"],
                            "saved": {location: _decode_tensor(encoded, copies)
                                      for location, encoded in result["saved"].items()}}
               for program_id, result in data.items()}
    host_copies.land(copies)
    return decoded


def _encode_tensor(tensor: torch.Tensor, views: bool) -> list[Any]:
    dtype = str(tensor.dtype).removeprefix("torch.")
    # The array keeps the tensor alive, and the memoryview the array, until the message is sent.
    flat = tensor.contiguous().view(-1).view(torch.uint8).numpy()
    return [dtype, list(tensor.shape), flat.data if views else flat.tobytes()]


def _decode_tensor(encoded: list[Any], copies: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> torch.Tensor:
    """An empty tensor of `encoded`'s dtype and shape, with the copy of its raw bytes into it
    added to `copies` (as 1-D byte tensors: destination, source)."""
    dtype, shape, raw = encoded
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        raise ValueError(f"collected saves name an unknown dtype {dtype!r}")
    tensor = torch.empty(shape, dtype=kind)
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
