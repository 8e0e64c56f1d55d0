"""Programs: a request's ops as plain data in `SamplingParams.extra_args`.

Plain data (str, int, lists, dicts) survives msgpack between the client, the engine core and the
workers, so the same program works in-process, across processes and over HTTP.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from vllm_runner.ops import Op

EXTRA_ARGS_KEY = "vllm_interp"


def new_key() -> str:
    """A key naming one request's program and saves, unique across clients."""
    return uuid.uuid4().hex


def encode(key: str, ops: Sequence[Op]) -> dict[str, Any]:
    """The `extra_args` entry for a request with `ops`."""
    return {"key": key, "ops": [op.to_data() for op in ops]}


def program_of(extra_args: dict[str, Any] | None) -> dict[str, Any] | None:
    """The program a request carries, or `None` for a plain request."""
    if not extra_args:
        return None
    return extra_args.get(EXTRA_ARGS_KEY)
