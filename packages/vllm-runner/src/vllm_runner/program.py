"""Programs: a request's ops as plain data in `SamplingParams.extra_args`.

Plain data (str, int, lists, dicts) survives msgpack between the client, the engine core and the
workers, so the same program works in-process, across processes and over HTTP.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from typing import Any

from vllm_runner.ops import Op

EXTRA_ARGS_KEY = "vllm_interp"
#: Ops that only read (and save): a program of these alone never changes a value the engine keeps.
READ_ONLY_OPS = ("save", "lens")


def new_key() -> str:
    """A key naming one request's program and saves, unique across clients."""
    return uuid.uuid4().hex


def encode_ops(ops: Sequence[Op]) -> list[dict[str, Any]]:
    """`ops` as plain data (tensors as bytes, `Call` functions cloudpickled)."""
    return [op.to_data() for op in ops]


def encode(key: str, ops_data: list[dict[str, Any]], digest: str | None = None) -> dict[str, Any]:
    """The `extra_args` entry for a request whose ops were encoded by `encode_ops`. `digest`
    (`program_digest(ops_data)`) names the program: the worker serves requests with the same
    digest together (one read per value for all of them)."""
    return {"key": key, "ops": ops_data, "digest": digest}


def program_digest(ops_data: list[dict[str, Any]]) -> str:
    """A name that only requests running the very same program share (also their prefix-cache
    salt)."""
    text = json.dumps(ops_data, sort_keys=True, default=_bytes_as_hex)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def collection_filters(ops_data: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What collecting a request's saves needs of its program: the location and position
    filters of its `save` and `lens` ops (no tensors, no code)."""
    return [{key: op.get(key) for key in ("op", "location", "positions", "steps")}
            for op in ops_data if op["op"] in READ_ONLY_OPS]


def _bytes_as_hex(value: Any) -> str:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"cannot hash a program holding {type(value).__name__}")


def program_of(extra_args: dict[str, Any] | None) -> dict[str, Any] | None:
    """The program a request carries, or `None` for a plain request."""
    if not extra_args:
        return None
    return extra_args.get(EXTRA_ARGS_KEY)


def edits(program: dict[str, Any] | None) -> bool:
    """Whether a program may change the engine's values (any op but a save or a lens): its
    requests' KV blocks are zeroed before they are handed to anyone else (`kv_blocks`)."""
    return program is not None and any(op["op"] not in READ_ONLY_OPS for op in program["ops"])
