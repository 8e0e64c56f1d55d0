"""Selection.reads(): one read per run of adjacent requests (or of the whole step), checked
against a plain loop over spans and against narrowing each request on its own."""

from __future__ import annotations

import pytest
import torch
from conftest import layouts, slabs
from hypothesis import given
from hypothesis import strategies as st
from tokenspan import RunRead, Span, SpanError, StepLayout, narrow
from tokenspan.span import Key


def loop_plan(layout: StepLayout, keys: list[Key]) -> list[tuple[Span, list[int], list[int],
                                                                 list[Key]]]:
    """The plan, made by walking the selected requests' spans one by one."""
    present = [key for key in set(keys) if key in layout and len(layout[key])]
    spans = sorted(((layout[key], key) for key in present), key=lambda pair: pair[0].start)
    runs: list[tuple[int, int, list[tuple[Span, Key]]]] = []
    for span, key in spans:
        if runs and runs[-1][1] == span.start:
            runs[-1] = (runs[-1][0], span.stop, [*runs[-1][2], (span, key)])
        else:
            runs.append((span.start, span.stop, [(span, key)]))
    selected = sum(len(span) for span, _ in spans)
    if len(runs) > 1 and 2 * selected >= layout.total:
        runs = [(0, layout.total, [pair for _, _, inside in runs for pair in inside])]
    plan = []
    for start, stop, inside in runs:
        sizes: list[int] = []
        chosen: list[int] = []
        at = start
        for span, _ in inside:
            if span.start > at:
                sizes.append(span.start - at)
            chosen.append(len(sizes))
            sizes.append(len(span))
            at = span.stop
        if at < stop:
            sizes.append(stop - at)
        plan.append((Span(start, stop), sizes, chosen, [key for _, key in inside]))
    return plan


@st.composite
def layout_and_keys(draw: st.DrawFn) -> tuple[StepLayout, list[Key]]:
    layout = draw(layouts(max_requests=12))
    keys = draw(st.lists(st.sampled_from([*layout.keys, "absent"])))
    return layout, keys


@given(layout_and_keys())
def test_reads_are_what_a_loop_over_spans_plans(case: tuple[StepLayout, list[Key]]) -> None:
    layout, keys = case
    reads = layout.select(keys).reads()
    assert [(read.span, list(read.sizes), list(read.chosen), list(read.keys))
            for read in reads] == loop_plan(layout, keys)


@given(st.data())
def test_pieces_are_each_requests_rows_as_views(data: st.DataObject) -> None:
    layout, keys = data.draw(layout_and_keys())
    slab, axis = data.draw(slabs(layout))
    selection = layout.select(keys)
    reads = selection.reads()
    assert tuple(key for read in reads for key in read.keys) == selection.keys
    for read in reads:
        assert sum(read.sizes) == len(read.span) and len(read.chosen) == len(read.keys)
        value = slab.narrow(axis, read.span.start, len(read.span))
        pieces = read.pieces(value, axis)
        for key, piece in zip(read.keys, pieces, strict=True):
            assert torch.equal(piece, narrow(slab, layout[key], layout, axis=axis))
            assert piece.data_ptr() == value.narrow(axis, layout[key].start - read.span.start,
                                                    1).data_ptr()


@given(layout_and_keys())
def test_whole_request_runs_match_the_row_index(case: tuple[StepLayout, list[Key]]) -> None:
    # `layout.select(keys)` finds its runs from starts and counts; selecting every position of
    # the same requests goes through the row tensor. Both must agree, and with reads().
    layout, keys = case
    lazy = layout.select(keys)
    every_position = {key: layout[key].positions().tolist() for key in keys if key in layout}
    indexed = layout.select(every_position)
    assert lazy.runs == indexed.runs
    assert lazy.keys == indexed.keys and lazy.counts == indexed.counts
    assert torch.equal(lazy.rows, indexed.rows)
    assert lazy.reads() == indexed.reads()


def test_the_plan_rule() -> None:
    layout = StepLayout.from_counts(list("abcdef"), [2, 3, 1, 4, 2, 0], [10, 0, 5, 7, 0, 0])
    # neighbours merge into one read; an empty request selects nothing
    (read,) = layout.select(["b", "c", "f"]).reads()
    assert read == RunRead(Span(2, 6), (3, 1), (0, 1), ("b", "c"))
    # two runs holding fewer than half of the 12 rows: one read each
    assert layout.select(["a", "e"]).reads() == [
        RunRead(Span(0, 2), (2,), (0,), ("a",)), RunRead(Span(10, 12), (2,), (0,), ("e",))]
    # several runs holding half of the rows or more: one read of the whole step
    assert layout.select(["d", "a", "c"]).reads() == [
        RunRead(Span(0, 12), (2, 3, 1, 4, 2), (0, 2, 3), ("a", "c", "d"))]
    # one run is read alone, however many rows it holds
    assert layout.select(["b"]).reads() == [RunRead(Span(2, 5), (3,), (0,), ("b",))]
    assert layout.select([]).reads() == []
    assert layout.select(["absent"]).reads() == []


def test_pieces_of_a_whole_step_read_skip_the_unselected_rows() -> None:
    layout = StepLayout.from_counts(list("abc"), [2, 1, 3])
    slab = torch.arange(6.0).unsqueeze(0).unsqueeze(-1)  # [1, 6, 1]
    (read,) = layout.select(["a", "c"]).reads()
    pieces = read.pieces(slab, axis=1)
    assert [piece.flatten().tolist() for piece in pieces] == [[0.0, 1.0], [3.0, 4.0, 5.0]]
    span, sizes, chosen, keys = read  # a named tuple
    assert (span, sizes, chosen, keys) == (Span(0, 6), (2, 1, 3), (0, 2), ("a", "c"))


def test_a_selection_of_some_positions_is_refused() -> None:
    layout = StepLayout.from_counts(["a", "b"], [2, 3], [0, 20])
    with pytest.raises(SpanError, match=r"holds 2 of the 3 rows of request 'b'"):
        layout.select({"a": None, "b": [20, 22]}).reads()
    # positions that cover whole requests are whole requests
    assert layout.select({"a": [0, 1], "b": None}).reads() == [
        RunRead(Span(0, 5), (2, 3), (0, 1), ("a", "b"))]


def test_a_whole_request_selection_makes_no_tensor_for_its_plan() -> None:
    layout = StepLayout.from_counts([f"r{i}" for i in range(8)], [3] * 8)
    selection = layout.select(["r1", "r2", "r6"])
    assert selection.runs == [(3, 9), (18, 21)] and len(selection) == 9
    assert len(selection.reads()) == 2
    assert selection._rows is None  # the rows tensor is made only when something needs it
    assert selection.rows.tolist() == [3, 4, 5, 6, 7, 8, 18, 19, 20]
