"""Selection: many requests' rows as one index, checked against a per-request loop."""

from __future__ import annotations

import pytest
import torch
from conftest import layouts, slabs
from hypothesis import given
from hypothesis import strategies as st
from tokenspan import LayoutError, SpanShapeError, StepLayout, narrow


@st.composite
def wanted_rows(draw: st.DrawFn, layout: StepLayout) -> dict:
    """Some requests (and a few that are not in this step), each all rows or some positions."""
    chosen = draw(st.lists(st.sampled_from([*layout.keys, "absent"]), unique=True))
    wanted = {}
    for key in chosen:
        if draw(st.booleans()):
            wanted[key] = None
        else:
            wanted[key] = draw(st.lists(st.integers(0, 60), max_size=6))
    return wanted


def loop_oracle(layout: StepLayout, wanted: dict) -> dict:
    """Per request, the slab rows a plain loop over spans would pick."""
    picked = {}
    for key, span in layout.items():
        if key not in wanted:
            continue
        positions = span.positions().tolist()
        keep = positions if wanted[key] is None else [p for p in positions if p in wanted[key]]
        rows = [span.start + positions.index(p) for p in keep]
        if rows:
            picked[key] = rows
    return picked


@given(st.data())
def test_selection_picks_what_a_loop_picks(data: st.DataObject) -> None:
    layout = data.draw(layouts())
    wanted = data.draw(wanted_rows(layout))
    oracle = loop_oracle(layout, wanted)
    selection = layout.select(wanted)
    assert selection.keys == tuple(oracle)
    assert selection.counts == tuple(len(rows) for rows in oracle.values())
    assert selection.rows.tolist() == [row for rows in oracle.values() for row in rows]
    assert selection.positions.tolist() == layout.positions()[selection.rows].tolist()
    assert [selection.keys[i] for i in selection.owners.tolist()] == [
        key for key, rows in oracle.items() for _ in rows
    ]


@given(st.data())
def test_gather_split_scatter_add_match_per_request_loops(data: st.DataObject) -> None:
    layout = data.draw(layouts())
    slab, axis = data.draw(slabs(layout))
    selection = layout.select(data.draw(wanted_rows(layout)))
    gathered = selection.gather(slab)
    per_request = selection.split(gathered, axis=axis)
    for key, part in per_request.items():
        rows = selection.rows[selection.owners == selection.keys.index(key)]
        assert torch.equal(part, slab.index_select(axis, rows))

    # scatter: selected rows take the new values, every other row is bitwise unchanged
    replaced = slab.clone()
    new = torch.randn_like(gathered)
    selection.scatter(replaced, new)
    expected = slab.clone()
    expected.index_copy_(axis, selection.rows, new)
    assert torch.equal(replaced, expected)

    # add a different vector per request: equals adding to each request's rows in a loop
    vectors = torch.randn(len(selection.keys), slab.shape[-1])
    added = slab.clone()
    selection.add(added, selection.per_row(vectors).reshape(gathered.shape))
    looped = slab.clone()
    for i in range(len(selection.keys)):
        rows = selection.rows[selection.owners == i]
        looped.index_add_(axis, rows, vectors[i].expand(*narrow_shape(slab, axis, len(rows))))
    assert torch.equal(added, looped)


def narrow_shape(slab: torch.Tensor, axis: int, rows: int) -> tuple[int, ...]:
    shape = list(slab.shape)
    shape[axis] = rows
    return tuple(shape)


def test_whole_requests_and_split_views() -> None:
    layout = StepLayout.from_counts(["a", "b", "c"], [2, 0, 3], [0, 4, 10], padded_total=8)
    slab = torch.arange(16.0).reshape(8, 2)
    views = layout.split(slab)
    assert list(views) == ["a", "b", "c"]
    assert torch.equal(views["c"], narrow(slab, layout["c"], layout))
    views["c"].zero_()  # views share storage
    assert torch.count_nonzero(slab[2:5]) == 0
    everything = layout.select()
    assert everything.keys == ("a", "c") and everything.rows.tolist() == [0, 1, 2, 3, 4]
    assert layout.select(["c"]).positions.tolist() == [10, 11, 12]


def test_one_vector_for_every_selected_row() -> None:
    layout = StepLayout.from_counts(["a", "b"], [2, 3], [0, 20])
    slab = torch.zeros(5, 4)
    layout.select({"b": [21, 22]}).add(slab, torch.ones(4))
    assert slab.sum(dim=1).tolist() == [0, 0, 0, 4, 4]


def test_bad_inputs_are_named() -> None:
    layout = StepLayout.from_counts(["a", "b"], [2, 3])
    selection = layout.select(["b"])
    with pytest.raises(SpanShapeError, match=r"expected shape \(3, 4\) for 3 selected rows"):
        selection.scatter(torch.zeros(5, 4), torch.zeros(2, 4))
    with pytest.raises(SpanShapeError, match=r"cannot broadcast a delta of shape \(3,\)"):
        selection.add(torch.zeros(5, 4), torch.zeros(3))
    with pytest.raises(SpanShapeError, match=r"one value per selected request \(1\)"):
        selection.per_row(torch.zeros(2, 4))
    with pytest.raises(LayoutError, match=r"'a': positions must be absolute"):
        layout.select({"a": [-1]})
    with pytest.raises(SpanShapeError, match=r"no token axis"):
        selection.gather(torch.zeros(4, 4))


@pytest.mark.parametrize("every", [1, 2, 3])
def test_long_runs_take_the_slicing_path_and_match_the_index_path(every: int) -> None:
    # Requests of 40 rows: on CPU these are sliced run by run instead of indexed; the result
    # must be bitwise what the indexed kernels give.
    layout = StepLayout.from_counts([f"r{i}" for i in range(12)], [40] * 12, list(range(12)))
    selection = layout.select(layout.keys[::every])
    assert selection._by_runs(torch.device("cpu"))
    assert len(selection.runs) == (1 if every == 1 else len(selection.keys))
    slab = torch.randn(480, 8)
    part = torch.randn(len(selection), 8)
    assert torch.equal(selection.gather(slab), slab.index_select(0, selection.rows))
    for method, reference in (("scatter", torch.Tensor.index_copy_),
                              ("add", torch.Tensor.index_add_)):
        sliced, indexed = slab.clone(), slab.clone()
        getattr(selection, method)(sliced, part)
        reference(indexed, 0, selection.rows, part)
        assert torch.equal(sliced, indexed), method


def test_runs_merge_neighbouring_requests() -> None:
    layout = StepLayout.from_counts(["a", "b", "c", "d"], [2, 3, 0, 4], [0, 0, 0, 7])
    assert layout.select(["a", "b", "d"]).runs == [(0, 9)]
    assert layout.select(["a", "d"]).runs == [(0, 2), (5, 9)]
    assert layout.select({"b": [0, 2], "d": [7]}).runs == [(2, 3), (4, 6)]
    assert layout.select([]).runs == []
