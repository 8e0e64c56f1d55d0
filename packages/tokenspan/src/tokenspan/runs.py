"""`RunRead`: one read of a value over a run of slab rows, and how to cut it into requests' rows.

A runner that serves many requests with the same operation reads a value once per run of
adjacent rows rather than once per request, and cuts each read into the requests' rows with one
`split`. `Selection.reads()` plans those reads; this module holds the plan's value object and
the pure planning rule, which knows nothing but rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import NamedTuple

import torch

from tokenspan.span import Key, Span


class RunRead(NamedTuple):
    """One read over slab rows `span.start:span.stop`, and where the selected requests are in it.

    - `span`: the rows to read. It may cover several requests, so its `first_position` is 0 and
      means nothing; each request's positions are in the layout (`layout[key]`).
    - `sizes`: how to split the tensor read over `span` along its token axis: the selected
      requests' rows and, between them, the rows of requests that were not selected. They add
      up to `len(span)`.
    - `chosen`: for each selected request inside `span`, in slab order, the index of its piece
      in `sizes`.
    - `keys`: the selected requests inside `span`, in slab order (one per entry of `chosen`).

    Built by `Selection.reads()`. An immutable named tuple (a runner builds dozens per step, and
    a named tuple is made in half the time of a frozen dataclass), so it also unpacks as
    `span, sizes, chosen, keys`.
    """

    span: Span
    sizes: tuple[int, ...]
    chosen: tuple[int, ...]
    keys: tuple[Key, ...]

    def pieces(self, read: torch.Tensor, axis: int) -> list[torch.Tensor]:
        """Each selected request's rows of `read` (the value read over `span`), as views.

        One `split` along `axis` for all of them rather than one slice each, in the order of
        `keys`. In-place edits of a piece land in `read`.
        """
        split = torch.split(read, list(self.sizes), dim=axis)
        return [split[index] for index in self.chosen]


def plan_reads(
    keys: Sequence[Key], starts: Sequence[int], counts: Sequence[int], total: int
) -> list[RunRead]:
    """The reads that cover requests `keys` (slab order, rows `starts[i]:starts[i] + counts[i]`).

    Each maximal run of adjacent requests is one read, unless there are several runs and the
    requests own at least half of the step's `total` rows: then one read over the whole step,
    `Span(0, total)` (one copy of at most twice what is kept beats many small ones).
    """
    n = len(keys)
    if n == 0:
        return []
    breaks = _breaks(starts, counts)
    if breaks and 2 * sum(counts) >= total:
        sizes: list[int] = []
        chosen: list[int] = []
        at = 0
        for start, count in zip(starts, counts, strict=True):
            if start > at:
                sizes.append(start - at)  # rows of requests that were not selected
            chosen.append(len(sizes))
            sizes.append(count)
            at = start + count
        if at < total:
            sizes.append(total - at)
        return [RunRead(Span(0, total), tuple(sizes), tuple(chosen), tuple(keys))]
    edges = [0, *breaks, n]
    return [
        RunRead(
            Span(starts[first], starts[end - 1] + counts[end - 1]),
            tuple(counts[first:end]),
            _RANGES[end - first] if end - first < len(_RANGES) else tuple(range(end - first)),
            tuple(keys[first:end]),
        )
        for first, end in pairwise(edges)
    ]


def maximal_runs(starts: Sequence[int], counts: Sequence[int]) -> list[tuple[int, int]]:
    """`(start, stop)` of each maximal run of adjacent requests (rows `starts[i]:starts[i] +
    counts[i]`, in slab order, none empty)."""
    if not starts:
        return []
    edges = [0, *_breaks(starts, counts), len(starts)]
    return [(starts[first], starts[end - 1] + counts[end - 1]) for first, end in pairwise(edges)]


def _breaks(starts: Sequence[int], counts: Sequence[int]) -> list[int]:
    """The indices `j` where request `j` does not start where request `j - 1` stops."""
    return [j for j in range(1, len(starts)) if starts[j] != starts[j - 1] + counts[j - 1]]


# `chosen` of a run of k adjacent requests is (0, ..., k - 1): shared tuples for short runs.
_RANGES = tuple(tuple(range(k)) for k in range(65))
