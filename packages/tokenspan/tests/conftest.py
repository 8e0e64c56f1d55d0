"""Shared hypothesis strategies: random step layouts and slabs shaped like engine values."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from tokenspan import Span, StepLayout

settings.register_profile("ci", max_examples=150, deadline=None)
settings.load_profile("ci")


@st.composite
def layouts(
    draw: st.DrawFn, min_requests: int = 0, max_requests: int = 8, max_count: int = 6
) -> StepLayout:
    """A valid layout: up to `max_requests` requests (some empty), maybe padded."""
    n = draw(st.integers(min_requests, max_requests))
    counts = draw(st.lists(st.integers(0, max_count), min_size=n, max_size=n))
    firsts = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    padding = draw(st.integers(0, 3))
    keys = [f"req-{i}" for i in range(n)]
    return StepLayout.from_counts(keys, counts, firsts, padded_total=sum(counts) + padding)


@st.composite
def slabs(draw: st.DrawFn, layout: StepLayout) -> tuple[torch.Tensor, int]:
    """A random slab for `layout`: `[rows, hidden]` or `[1, rows, hidden]`, padded or not."""
    rows = draw(st.sampled_from(sorted({layout.total, layout.padded_total})))
    hidden = draw(st.integers(1, 4))
    # With one real token, [1, rows, h] is ambiguous and token_axis reads it as axis 0 (see its
    # docstring); callers with such values pass axis= explicitly.
    batch_axis = draw(st.booleans()) and rows > 1 and layout.total != 1
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    slab = torch.randn(rows, hidden, generator=generator)
    return (slab.unsqueeze(0), 1) if batch_axis else (slab, 0)


@st.composite
def slab_with_span(draw: st.DrawFn) -> tuple[StepLayout, torch.Tensor, int, Span]:
    """A layout with at least one request, a slab for it, its token axis and one request's span."""
    layout = draw(layouts(min_requests=1))
    slab, axis = draw(slabs(layout))
    return layout, slab, axis, layout[draw(st.sampled_from(layout.keys))]
