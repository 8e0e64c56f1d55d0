"""Row runs of requests served together: every member gets exactly its own rows, from one read
per run (or of the whole step), whatever the step's layout and whoever is in the group."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenspan import Span
from vllm_runner.groups import cuts, pieces, reading_plan, runs


@dataclass(frozen=True)
class Member:
    span: Span


@st.composite
def steps(draw):
    """A step's requests (1-8 rows each, back to back) and a non-empty group of them."""
    sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=12))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    spans = [Span(start, start + size) for start, size in zip(starts, sizes, strict=True)]
    chosen = draw(st.lists(st.sampled_from(range(len(spans))), min_size=1, unique=True))
    return sum(sizes), [Member(spans[i]) for i in draw(st.permutations(chosen))]


# No deadline: how long an example takes depends on the machine (a process's first torch calls
# can exceed hypothesis' 200 ms).
@settings(deadline=None)
@given(steps(), st.sampled_from([0, 1, 2]))
def test_each_member_gets_exactly_its_rows(step, axis) -> None:
    total, members = step
    shape = [3, 3, 3]
    shape[axis] = total
    slab = torch.arange(torch.Size(shape).numel()).reshape(shape)
    seen = []
    for run, inside in reading_plan(members, total):
        whole = slab.narrow(axis, run.start, len(run))  # the value read over the run
        sizes, chosen = cuts(run, inside)
        for member, rows in zip(inside, pieces(whole, sizes, chosen, axis), strict=True):
            assert torch.equal(rows, slab.narrow(axis, member.span.start, len(member.span)))
            seen.append(member)
    assert sorted(seen, key=lambda m: m.span.start) == sorted(members, key=lambda m: m.span.start)


@settings(deadline=None)
@given(steps())
def test_runs_join_exactly_the_adjacent_members(step) -> None:
    _, members = step
    found = runs(members)
    for (run, _), (following, _) in pairwise(found):
        assert run.stop < following.start  # a gap between runs, or they would be one
    for run, inside in found:
        assert run.start == inside[0].span.start and run.stop == inside[-1].span.stop
        assert len(run) == sum(len(member.span) for member in inside)


def test_the_whole_step_is_read_once_when_the_group_owns_half_of_it() -> None:
    spans = [Span(0, 4), Span(4, 5), Span(5, 9), Span(9, 10)]
    apart = [Member(spans[0]), Member(spans[2])]  # 8 of 10 rows, in two runs
    assert [run for run, _ in reading_plan(apart, 10)] == [Span(0, 10)]
    few = [Member(spans[1]), Member(spans[3])]  # 2 of 10 rows: read each on its own
    assert [run for run, _ in reading_plan(few, 10)] == [Span(4, 5), Span(9, 10)]
