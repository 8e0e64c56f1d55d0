"""The step plan: which requests want which op at which location this step, grouped.

Built from plain data — the step's `StepLayout` and each scheduled request's decoded program —
by the runtime at the start of every forward that has programs. Requests running the same
program (the same digest) share one `OpGroup` per op, registered at the op's locations once, so
the plan grows with the requests plus their programs' locations, not their product; a group is
then served with one read or one edit (`serving.serve_together`). Within a program, ops at one
location keep their order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tokenspan import StepLayout
from vllm_envoys import Step

from vllm_runner.ops import Op
from vllm_runner.program import Program
from vllm_runner.serving import OpGroup, Visits, Want

#: Values whose rows are the sampled rows (one per request, its last row this step), not the
#: step's tokens, served in this order by one hook on the logits processor.
PER_SAMPLED_ROW = ("logits", "next_token_probs")

NO_ROWS = StepLayout.from_counts([], [], [])
NO_VISITS = Visits(NO_ROWS)


class ScheduledRequest(NamedTuple):
    """A request of this step that runs a program, as the engine adapter hands it over (a
    tuple: the adapters make one per request per step)."""

    request_id: str
    program: Program
    prompt_length: int


@dataclass(frozen=True)
class StepPlan:
    """This step's visits: the token rows of the forward, and the sampled rows of the logits
    that follow it."""

    tokens: Visits = NO_VISITS
    sampled: Visits = NO_VISITS

    def locations(self) -> list[str]:
        """Every location some request waits at, tokens first, in order."""
        return [*self.tokens.wants, *self.sampled.wants]


NOTHING_PLANNED = StepPlan()


def sampled_rows(layout: StepLayout) -> StepLayout:
    """One row per request, its last row this step: the rows of the logits the sampler uses
    (no speculative decoding)."""
    lasts = [first + count - 1 for first, count in zip(layout.first_positions, layout.counts,
                                                       strict=True)]
    return StepLayout.from_counts(list(layout.keys), [1] * len(layout), lasts)


def acting(layout: StepLayout, requests: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """`requests` less those whose programs act on the prompt only (`Program.prompt_only`, e.g.
    `Save(..., positions=(-1,))`) at a step whose rows are all past the prompt
    (`Program.acts_at`): the generated tokens' steps of such a request need no hook, no tap's
    Python and no eager forward, so they run vLLM's full CUDA graphs. The adapters decide the
    step's graph with the same rule (`Runtime.acts_at`). `requests` itself where none is left
    out: a repeated schedule's very list (`graph_steps` reuses its plan for it)."""
    if not any(request.program.prompt_only for request in requests):
        return requests  # every program acts past its prompt: no request's rows to look up
    kept = [request for request in requests if request.program.acts_at(
        request.prompt_length, layout[request.request_id].first_position)]
    return requests if len(kept) == len(requests) else kept


def plan_step(layout: StepLayout, requests: Sequence[ScheduledRequest],
              locations_of: Callable[[Op], list[str]]) -> StepPlan:
    """Group the requests' ops by location for this step (`locations_of` resolves an op's
    patterns). A chunk that ends before its prompt does is not sampled: its logits are
    dropped, so it waits at no sampled-row value.

    It runs before every forward with programs, for every request: a want is made only for the
    kind of visit (token rows, sampled rows) its op acts at, and the sampled rows' layout only
    when some op reads them."""
    if not requests:
        return NOTHING_PLANNED
    tokens: dict[str, list[OpGroup]] = defaultdict(list)
    rows: dict[str, list[OpGroup]] = defaultdict(list)
    # (digest, op count) -> each op's token-row group (None: it acts at no token row) and
    # sampled-row locations, by the op's index; its sampled-row group is made at its first
    # sampled request. The count keeps a request whose digest does not match its ops (the
    # digest travels with them) from breaking the step's plan for the others.
    groups: dict[tuple[str, int], list[tuple[OpGroup | None, list[str]]]] = {}
    sampled_groups: dict[tuple[str, int], OpGroup] = {}
    sampled: StepLayout | None = None
    for request in requests:
        program, request_id = request.program, request.request_id
        program_key = (program.digest, len(program.ops))
        found = groups.get(program_key)
        if found is None:  # the first request of this program: its ops' groups
            found = groups[program_key] = [_token_group(op, locations_of, tokens)
                                           for op in program.ops]
        span = layout[request_id]
        # Every pattern gets the request's earlier keys (`key_history`), on any step.
        step = Step(span.first_position, len(span), request.prompt_length, earlier_keys=True)
        last_position = span.first_position + len(span) - 1
        is_sampled = last_position >= request.prompt_length - 1
        # The request's own ops (a plain `Call` holds the request's own function).
        for index, (op, (token_group, sampled_locations)) in enumerate(
                zip(program.ops, found, strict=True)):
            if token_group is not None:
                token_group.append(Want(request_id, program.program_id, span, step, op))
            if sampled_locations and is_sampled:
                if sampled is None:
                    sampled = sampled_rows(layout)
                key = (program.digest, index)
                sampled_group = sampled_groups.get(key)
                if sampled_group is None:
                    sampled_group = sampled_groups[key] = OpGroup()
                    for location in sampled_locations:
                        rows[location].append(sampled_group)
                sampled_group.append(Want(
                    request_id, program.program_id, sampled[request_id],
                    Step(last_position, 1, request.prompt_length), op))
    # No request sampled where an op reads sampled rows: nothing waits there.
    return StepPlan(Visits(layout, dict(tokens)),
                    Visits(sampled if sampled is not None else NO_ROWS, dict(rows)))


def _token_group(op: Op, locations_of: Callable[[Op], list[str]],
                 tokens: dict[str, list[OpGroup]]) -> tuple[OpGroup | None, list[str]]:
    """A new op's token-row group this step, registered at its token-row locations (`None`
    if it has none), and its sampled-row locations."""
    locations = locations_of(op)
    sampled = [location for location in locations if location in PER_SAMPLED_ROW]
    if len(sampled) == len(locations):
        return None, sampled
    group = OpGroup()
    for location in locations:
        if location not in PER_SAMPLED_ROW:
            tokens[location].append(group)
    return group, sampled
