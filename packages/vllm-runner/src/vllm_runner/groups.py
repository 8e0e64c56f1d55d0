"""Row runs of a group of requests that share one op this step: where to read once for all.

Requests running the same program are served together (`Runtime._serve_together`): the rows of
adjacent requests form one run, read (and, for an edit, written) with one call instead of one per
request. Pure functions of spans, kept apart from the runtime's hooks so they can be tested alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from tokenspan import Span


class Member(Protocol):
    """What grouping needs of a request's want: its rows this step."""

    span: Span


def runs(members: Sequence[Member]) -> list[tuple[Span, list[Member]]]:
    """The members' rows as maximal runs of adjacent rows, in row order, each with the members
    it holds (a step's requests own disjoint rows)."""
    bounds: list[list[int]] = []  # [start, stop] of each run, as it grows
    inside: list[list[Member]] = []
    for member in sorted(members, key=lambda m: m.span.start):
        if bounds and bounds[-1][1] == member.span.start:
            bounds[-1][1] = member.span.stop
            inside[-1].append(member)
        else:
            bounds.append([member.span.start, member.span.stop])
            inside.append([member])
    return [(Span(start, stop), held) for (start, stop), held in zip(bounds, inside, strict=True)]


def reading_plan(members: Sequence[Member], total: int) -> list[tuple[Span, list[Member]]]:
    """Where to read a value once for every member: each run of adjacent rows, or the whole
    step when there are several runs and the members own at least half of its rows (one copy
    of at most twice what is kept beats many small ones)."""
    found = runs(members)
    owned = sum(len(member.span) for member in members)
    if len(found) > 1 and 2 * owned >= total:
        return [(Span(0, total), [member for _, inside in found for member in inside])]
    return found


def cuts(run: Span, inside: Sequence[Member]) -> tuple[list[int], list[int]]:
    """How to split the value read over `run` into its members' rows: the sizes of the pieces
    along the tokens axis (members' rows and the rows of requests between them) and the index
    of each member's piece, in `inside`'s order (row order)."""
    sizes, chosen, at = [], [], run.start
    for member in inside:
        if member.span.start > at:
            sizes.append(member.span.start - at)  # rows of requests outside the group
        chosen.append(len(sizes))
        sizes.append(len(member.span))
        at = member.span.stop
    if at < run.stop:
        sizes.append(run.stop - at)
    return sizes, chosen


def pieces(whole: torch.Tensor, sizes: list[int], chosen: list[int],
           axis: int) -> list[torch.Tensor]:
    """The members' rows of `whole`, as views, split with one call rather than a slice each
    (`sizes` and `chosen` from `cuts`)."""
    split = whole.split(sizes, dim=axis)
    return [split[index] for index in chosen]
