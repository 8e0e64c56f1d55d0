"""The step plan: which requests want which op at which location this step, grouped.

Built from plain data — the step's `StepLayout` and each scheduled request's decoded program —
by the runtime at the start of every forward that has programs. Requests running the same
program (the same digest) share one `OpGroup` per op, registered at the op's locations once, so
the plan grows with the requests plus their programs' locations, not their product; a group is
then served with one read or one edit (`row_serving.serve_together`). Within a program, ops at one
location keep their order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenspan import Span, StepLayout
from vllm_envoys import Step

from vllm_runner.ops import Op
from vllm_runner.ops.locations import PER_SAMPLED_ROW
from vllm_runner.ops.wants import ScheduledRequest, Want
from vllm_runner.runtime.row_serving import OpGroup, Visits

NO_ROWS = StepLayout.from_counts([], [], [])
NO_VISITS = Visits(NO_ROWS)


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
    # sampled-row locations, by the op's index, and whether any op reads sampled rows; its
    # sampled-row group is made at its first sampled request. The count keeps a request whose
    # digest does not match its ops (the digest travels with them) from breaking the step's
    # plan for the others.
    groups: dict[tuple[str, int], tuple[list[tuple[OpGroup | None, list[str]]], bool]] = {}
    sampled_groups: dict[tuple[str, int, int], OpGroup] = {}
    sampled: StepLayout | None = None
    # The layout's columns, read directly: this loop runs for every request at every step with
    # programs (`layout[request_id]` builds the same span through a lookup of its own).
    index, starts, counts, firsts = (layout.index, layout.starts, layout.counts,
                                     layout.first_positions)
    for request_id, program, prompt_length in requests:
        ops = program.ops
        program_key = (program.digest, len(ops))
        found = groups.get(program_key)
        if found is None:  # the first request of this program: its ops' groups
            made = [_token_group(op, locations_of, tokens) for op in ops]
            found = groups[program_key] = (made, any(locations for _, locations in made))
        made, reads_sampled = found
        row = index(request_id)
        first, count = firsts[row], counts[row]
        span = Span(starts[row], starts[row] + count, first)
        # Every pattern gets the request's earlier keys (`key_history`), on any step.
        step = Step(first, count, prompt_length, True)
        program_id = program.program_id
        # The request's own ops (a plain `Call` holds the request's own function).
        for op, (token_group, _) in zip(ops, made, strict=True):
            if token_group is not None:
                token_group.append(Want(request_id, program_id, span, step, op))
        last_position = first + count - 1
        if not reads_sampled or last_position < prompt_length - 1:
            continue  # no op reads the sampled rows, or this chunk is not sampled
        if sampled is None:
            sampled = sampled_rows(layout)
        for op_index, (op, (_, sampled_locations)) in enumerate(zip(ops, made, strict=True)):
            if not sampled_locations:
                continue
            key = (*program_key, op_index)
            sampled_group = sampled_groups.get(key)
            if sampled_group is None:
                sampled_group = sampled_groups[key] = OpGroup()
                for location in sampled_locations:
                    rows[location].append(sampled_group)
            sampled_group.append(Want(request_id, program_id, sampled[request_id],
                                      Step(last_position, 1, prompt_length), op))
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
