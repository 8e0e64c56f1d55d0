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


@dataclass(frozen=True)
class ScheduledRequest:
    """A request of this step that runs a program, as the engine adapter hands it over."""

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


def plan_step(layout: StepLayout, requests: Sequence[ScheduledRequest],
              locations_of: Callable[[Op], list[str]]) -> StepPlan:
    """Group the requests' ops by location for this step (`locations_of` resolves an op's
    patterns). A chunk that ends before its prompt does is not sampled: its logits are
    dropped, so it waits at no sampled-row value."""
    if not requests:
        return NOTHING_PLANNED
    sampled = sampled_rows(layout)
    tokens: dict[str, list[OpGroup]] = defaultdict(list)
    rows: dict[str, list[OpGroup]] = defaultdict(list)
    token_groups: dict[tuple[str, int], OpGroup] = {}
    sampled_groups: dict[tuple[str, int], OpGroup] = {}
    for request in requests:
        program, request_id = request.program, request.request_id
        span = layout[request_id]
        # Every pattern gets the request's earlier keys (`key_history`), on any step.
        step = Step(span.first_position, len(span), request.prompt_length, earlier_keys=True)
        last = sampled[request_id]
        is_sampled = last.first_position >= request.prompt_length - 1
        last_step = Step(last.first_position, 1, request.prompt_length)
        for index, op in enumerate(program.ops):
            group = (program.digest, index)
            _join(token_groups, tokens, group, locations_of,
                  Want(request_id, program.program_id, span, step, op), sampled=False)
            if is_sampled:
                _join(sampled_groups, rows, group, locations_of,
                      Want(request_id, program.program_id, last, last_step, op), sampled=True)
    return StepPlan(Visits(layout, dict(tokens)), Visits(sampled, dict(rows)))


def _join(groups: dict[tuple[str, int], OpGroup], wants: dict[str, list[OpGroup]],
          group: tuple[str, int], locations_of: Callable[[Op], list[str]], want: Want,
          sampled: bool) -> None:
    """Add `want` to its group, registering a new group at the op's locations of this kind."""
    members = groups.get(group)
    if members is None:
        members = groups[group] = OpGroup()
        for location in locations_of(want.op):
            if (location in PER_SAMPLED_ROW) == sampled:
                wants[location].append(members)
    members.append(want)
