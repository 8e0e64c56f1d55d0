"""Programs: a request's ops as plain data in `SamplingParams.extra_args`, and back.

The client encodes a program once per call (`encode`); a worker decodes each request's program
once, at its first step (`ProgramCache`), into the op classes of `vllm_runner.ops`.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from vllm_runner.ops import Call, Op, op_from_data

EXTRA_ARGS_KEY = "vllm_interp"
#: How many programs without a `Call` the worker keeps decoded by digest (requests running the
#: same program share their ops; decoding costs tensor copies and checks).
SHARED_PROGRAMS = 256

ProgramData = dict[str, Any]


def new_program_id() -> str:
    """A name for one request's program and saves, unique across clients."""
    return uuid.uuid4().hex


def check_ops(ops: Sequence[Any], what: str) -> None:
    """Refuse a program holding anything but ops, naming the argument (`what`) that took it."""
    if not all(isinstance(op, Op) for op in ops):
        raise TypeError(f"{what} takes a list of ops (vllm_runner.ops), "
                        f"not {[type(op).__name__ for op in ops]}")


def encode_ops(ops: Sequence[Op]) -> list[dict[str, Any]]:
    """`ops` as plain data (tensors as bytes, `Call` functions cloudpickled)."""
    return [op.to_data() for op in ops]


def program_digest(ops_data: list[dict[str, Any]]) -> str:
    """A name that only requests running the very same program share: the worker serves them
    together (one read per value for all), and it is their prefix-cache salt."""
    text = json.dumps(ops_data, sort_keys=True, default=_bytes_as_hex)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _bytes_as_hex(value: Any) -> str:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"cannot hash a program holding {type(value).__name__}")


def encode(program_id: str, ops_data: list[dict[str, Any]], digest: str) -> ProgramData:
    """The `extra_args` entry for a request whose ops were encoded by `encode_ops`, with their
    `program_digest`."""
    return {"program_id": program_id, "ops": ops_data, "digest": digest}


def attach_program(params: Any, ops_data: list[dict[str, Any]], digest: str) -> str:
    """Give one engine request's `SamplingParams` a program of its own (a new program id) and
    keep it off cached prompt blocks: a prefix-cache hit would skip prompt rows the program must
    see (requests with a program still feed the cache). Returns the program id."""
    program_id = new_program_id()
    params.extra_args = {**(params.extra_args or {}),
                         EXTRA_ARGS_KEY: encode(program_id, ops_data, digest)}
    params.skip_reading_prefix_cache = True
    return program_id


def salted(given_salt: str | None, digest: str) -> str:
    """The prompt's `cache_salt` for a request running the program `digest`: its KV blocks are
    kept from anyone not running the same program; a salt the caller gave keeps its own meaning
    too (both, joined)."""
    return digest if given_salt is None else f"{given_salt}/{digest}"


def program_data(extra_args: dict[str, Any] | None) -> ProgramData | None:
    """The program a request carries in its `extra_args`, or `None` for a plain request."""
    if not extra_args:
        return None
    found = extra_args.get(EXTRA_ARGS_KEY)
    return found if isinstance(found, dict) else None


@dataclass(frozen=True)
class Program:
    """One request's program, decoded: its ops and the names that group and collect it."""

    program_id: str
    digest: str
    ops: tuple[Op, ...]

    @cached_property  # asked at every step of every running request
    def edits(self) -> bool:
        """Whether it may change the engine's values (any op but a save or a lens): its
        requests' KV blocks are zeroed before they are handed to anyone else (`kv_blocks`)."""
        return any(op.edits for op in self.ops)

    @cached_property  # asked at every step of every running request
    def reads_token_ids(self) -> bool:
        """Whether an op filters by token (`tokens=`): its steps need the step's token ids,
        read where the model embeds them (the plain module tree)."""
        return any(getattr(op, "tokens", None) is not None for op in self.ops)

    @cached_property  # asked at every step of every running request
    def prompt_only(self) -> bool:
        """Whether every op acts on the prompt only (`Op.acts_past_the_prompt`): a request
        running it has nothing to do at a step past its prompt, and such a step is planned and
        graphed as if the request had no program (`step_plan.acting`)."""
        return not any(op.acts_past_the_prompt() for op in self.ops)

    def acts_at(self, prompt_length: int, first_position: int) -> bool:
        """Whether a request running the program, with a prompt of `prompt_length` tokens, may
        act at a step whose rows start at `first_position` (`prompt_only` programs: only while
        the step holds prompt rows)."""
        return first_position < prompt_length or not self.prompt_only

    def before_the_prompt(self, prompt_length: int) -> str | None:
        """Why the program can never run as written on a prompt of `prompt_length` tokens, or
        `None` (see `Op.before_the_prompt`)."""
        return next((problem for op in self.ops
                     if (problem := op.before_the_prompt(prompt_length)) is not None), None)


class ProgramCache:
    """Each running request's decoded program, decoded at its first step and kept until its
    saves are collected or dropped; programs share their ops by digest unless they hold a
    `Call` that is not `rowwise` (its function is unpickled per request: it may keep state of
    its own; a rowwise one promises it keeps none)."""

    def __init__(self, expand: Callable[[tuple[Op, ...]], tuple[Op, ...]] = lambda ops: ops
                 ) -> None:
        #: What the worker adds to a program as decoded (its own ops, e.g. the output of an
        #: edited attention pattern: `pattern_edits.with_pattern_outputs`).
        self._expand = expand
        self._programs: dict[str, Program] = {}
        self._shared: dict[str, tuple[Op, ...]] = {}
        #: Whether a program that acts on the prompt only was ever decoded here: until one is,
        #: every program acts at every step, and the adapters ask no request's program whether
        #: it acts (`Runtime.acts_at`, per request per step).
        self.seen_prompt_only = False
        #: Whether a program that filters by token (`Program.reads_token_ids`) was ever decoded
        #: here: until one is, no step looks for one among its requests.
        self.seen_token_filters = False

    def get(self, data: ProgramData) -> Program:
        """The decoded program of `data` (a `ValueError` if it does not decode)."""
        program_id = data["program_id"]
        found = self._programs.get(program_id)
        if found is None:
            found = self._programs[program_id] = Program(program_id, data["digest"],
                                                         self._ops(data))
            self.seen_prompt_only = self.seen_prompt_only or found.prompt_only
            self.seen_token_filters = self.seen_token_filters or found.reads_token_ids
        return found

    def _ops(self, data: ProgramData) -> tuple[Op, ...]:
        shared = self._shared.get(data["digest"])
        if shared is not None:
            return shared
        ops = self._expand(tuple(op_from_data(op) for op in data["ops"]))
        if not any(isinstance(op, Call) and not op.rowwise for op in ops):
            if len(self._shared) >= SHARED_PROGRAMS:
                self._shared.pop(next(iter(self._shared)))
            self._shared[data["digest"]] = ops
        return ops

    def known(self, program_id: str) -> Program | None:
        """The program decoded for `program_id`, if its request was ever scheduled."""
        return self._programs.get(program_id)

    def forget(self, program_id: str) -> None:
        """Drop a finished request's program."""
        self._programs.pop(program_id, None)

    def __len__(self) -> int:
        return len(self._programs)
