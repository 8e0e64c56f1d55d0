"""What a step's plan is made of, shared by both ways of serving it (the eager hooks of
`runtime` and the graph taps of `compiled`): a request of the step with its program
(`ScheduledRequest`, as an engine adapter hands it over) and one request's op waiting at one
kind of visit (`Want`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from tokenspan import Span
from vllm_envoys import Step, Value

from vllm_runner.ops import Op
from vllm_runner.ops.program import Program


class ScheduledRequest(NamedTuple):
    """A request of this step that runs a program, as the engine adapter hands it over (a
    tuple: the adapters make one per request per step)."""

    request_id: str
    program: Program
    prompt_length: int


class Want(NamedTuple):
    """One request waiting for one op at one kind of visit this step (a tuple: the step plan
    makes one per request per op at every step with programs)."""

    request_id: str
    program_id: str
    span: Span
    step: Step
    op: Op


def passed_over(want: Want, value: Value, failed: Callable[[str], bool]) -> bool:
    """Whether `want` gets nothing at this visit: `value` cannot be served at its step, or its
    program failed earlier (`failed`: the store's)."""
    return value.reason(want.step) is not None or failed(want.program_id)
