"""narrow and widen: exact rows out and back, nested values, padding, and refused writes."""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import layouts, slab_with_span, slabs
from hypothesis import given
from hypothesis import strategies as st
from tokenspan import LayoutError, Span, SpanShapeError, StepLayout, narrow, widen

Pair = collections.namedtuple("Pair", ["hidden", "residual"])


def rows_of(slab: torch.Tensor, axis: int, span: Span) -> torch.Tensor:
    """The oracle: plain slicing along the token axis."""
    return slab[span.rows] if axis == 0 else slab[:, span.rows]


@given(st.data())
def test_narrow_is_plain_slicing_and_widen_undoes_it(data: st.DataObject) -> None:
    layout = data.draw(layouts())
    slab, axis = data.draw(slabs(layout))
    original = slab.clone()
    for _, span in layout.items():
        part = narrow(slab, span, layout)
        assert torch.equal(part, rows_of(slab, axis, span))
        assert part.data_ptr() == rows_of(slab, axis, span).data_ptr() or len(span) == 0
        widen(slab, span, layout, narrow(slab, span, layout, copy=True))
    assert torch.equal(slab, original)


@given(st.data())
def test_widen_writes_only_its_span(data: st.DataObject) -> None:
    layout, slab, axis, span = data.draw(slab_with_span())
    before = slab.clone()
    replacement = torch.randn_like(narrow(slab, span, layout))
    widen(slab, span, layout, replacement)
    assert torch.equal(rows_of(slab, axis, span), replacement)
    outside = torch.ones(slab.shape[axis], dtype=torch.bool)
    outside[span.rows] = False
    assert torch.equal(slab.index_select(axis, outside.nonzero().squeeze(1)),
                       before.index_select(axis, outside.nonzero().squeeze(1)))


@given(st.data())
def test_widen_with_written_rows_writes_those_rows_alone(data: st.DataObject) -> None:
    """`written_rows` picks, row by row on the device, which of the span's rows take `part`'s
    values; the oracle writes each chosen row by plain indexing. A nested value (both halves of
    a pair) gets the same rows."""
    layout, slab, axis, span = data.draw(slab_with_span())
    chosen = data.draw(st.lists(st.booleans(), min_size=len(span), max_size=len(span)))
    written_rows = torch.tensor(chosen, dtype=torch.bool)
    pair = Pair(slab, slab * 2)
    expected = Pair(slab.clone(), slab * 2)
    replacement = Pair(torch.randn_like(narrow(slab, span, layout)),
                       torch.randn_like(narrow(slab, span, layout)))
    for whole, part in zip(expected, replacement, strict=True):
        for offset, row in enumerate(range(span.start, span.stop)):
            if chosen[offset]:
                whole.select(axis, row).copy_(part.select(axis, offset))
    widen(pair, span, layout, replacement, written_rows=written_rows)
    for got, wanted in zip(pair, expected, strict=True):
        assert torch.equal(got, wanted)


@given(st.data())
def test_padded_rows_are_never_served(data: st.DataObject) -> None:
    layout = data.draw(layouts())
    slab, axis = data.draw(slabs(layout))
    slab.narrow(axis, layout.total, slab.shape[axis] - layout.total).fill_(float("nan"))
    for _, span in layout.items():
        assert not torch.isnan(narrow(slab, span, layout, copy=True)).any()
    for part in layout.split(slab).values():
        assert not torch.isnan(part).any()
    assert sum(part.shape[axis] for part in layout.split(slab).values()) == layout.total


def test_nested_values_keep_structure_and_non_tensor_leaves() -> None:
    layout = StepLayout.from_counts(["a", "b"], [2, 3])
    weight = torch.randn(4, 4)
    extras = {"scale": 2.0, "w": weight, "ids": [torch.arange(5)]}
    value = (torch.arange(10.0).reshape(5, 2), extras, None, Pair(torch.zeros(1, 5, 3), "tag"))
    out = narrow(value, layout["b"], layout, copy=True)
    assert isinstance(out, tuple) and isinstance(out[3], Pair)
    assert torch.equal(out[0], value[0][2:5])
    assert out[1]["scale"] == 2.0 and out[1]["w"] is weight
    assert torch.equal(out[1]["ids"][0], torch.arange(2, 5))
    assert out[2] is None and out[3].residual == "tag"
    assert out[3].hidden.shape == (1, 3, 3)


def test_dtype_and_device_are_preserved() -> None:
    layout = StepLayout.from_counts(["a", "b"], [2, 3])
    for dtype in (torch.float16, torch.bfloat16, torch.int64, torch.bool):
        slab = torch.zeros(5, 3, dtype=dtype)
        part = narrow(slab, layout["b"], layout, copy=True)
        assert part.dtype == dtype and part.device == slab.device
        widen(slab, layout["b"], layout, part)
        assert slab.dtype == dtype


def test_zero_length_span_and_one_token_decode_span() -> None:
    layout = StepLayout.from_counts(["empty", "decode", "prefill"], [0, 1, 4], [7, 41, 0])
    slab = torch.randn(5, 8)
    before = slab.clone()
    assert narrow(slab, layout["empty"], layout).shape == (0, 8)
    widen(slab, layout["empty"], layout, torch.empty(0, 8))
    assert torch.equal(slab, before)
    decode = narrow(slab, layout["decode"], layout)
    assert decode.shape == (1, 8) and torch.equal(decode, slab[0:1])
    widen(slab, layout["decode"], layout, torch.full((1, 8), 3.0))
    assert torch.equal(slab[0], torch.full((8,), 3.0)) and torch.equal(slab[1:], before[1:])


def test_dim_one_layout() -> None:
    layout = StepLayout.from_counts(["a", "b"], [2, 3])
    slab = torch.randn(1, 5, 4)
    part = narrow(slab, layout["b"], layout)
    assert part.shape == (1, 3, 4) and torch.equal(part, slab[:, 2:5])
    widen(slab, layout["b"], layout, torch.zeros(1, 3, 4))
    assert torch.count_nonzero(slab[:, 2:5]) == 0


def test_explicit_axis_overrides_detection() -> None:
    layout = StepLayout.from_counts(["a", "b"], [2, 3])
    heads_first = torch.randn(4, 5, 3)  # [heads, tokens, head_dim]
    assert torch.equal(narrow(heads_first, layout["b"], layout, axis=1), heads_first[:, 2:5])
    with pytest.raises(SpanShapeError, match="fewer than the step's 5 tokens"):
        narrow(heads_first, layout["b"], layout, axis=2)


def test_wrong_shape_write_raises_before_anything_is_written() -> None:
    layout = StepLayout.from_counts(["a", "b"], [2, 3])
    whole = (torch.randn(5, 4), torch.randn(5, 4))
    before = tuple(t.clone() for t in whole)
    good = torch.ones(3, 4)
    with pytest.raises(SpanShapeError, match=r"value\[1\].*expected shape \(3, 4\).*got \(2, 4\)"):
        widen(whole, layout["b"], layout, (good, torch.ones(2, 4)))
    assert all(torch.equal(a, b) for a, b in zip(whole, before, strict=True))


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (torch.ones(3, 4), r"expected a sequence of 2 items"),
        ((torch.ones(3, 4),), r"expected a sequence of 2 items"),
        ((torch.ones(3, 4), 5.0), r"value\[1\]: expected a tensor of shape \(3, 4\).*float"),
    ],
)
def test_structure_mismatch_is_refused(part: object, message: str) -> None:
    layout = StepLayout.from_counts(["a", "b"], [2, 3])
    whole = (torch.randn(5, 4), torch.randn(5, 4))
    with pytest.raises(SpanShapeError, match=message):
        widen(whole, layout["b"], layout, part)


def test_changed_non_token_leaf_is_refused_and_unchanged_one_accepted() -> None:
    layout = StepLayout.from_counts(["a", "b"], [2, 3])
    whole = {"h": torch.randn(5, 4), "scale": 2.0, "w": torch.randn(4, 4)}
    widen(whole, layout["a"], layout, {"h": torch.ones(2, 4), "scale": 2.0, "w": whole["w"]})
    assert torch.equal(whole["h"][:2], torch.ones(2, 4))
    with pytest.raises(SpanShapeError, match=r"value\['scale'\].*not per-token"):
        widen(whole, layout["a"], layout, {"h": torch.ones(2, 4), "scale": 3.0, "w": whole["w"]})
    with pytest.raises(SpanShapeError, match=r"value\['w'\].*not per-token"):
        widen(whole, layout["a"], layout,
              {"h": torch.ones(2, 4), "scale": 2.0, "w": whole["w"].clone()})


def test_source_overlapping_the_slab_is_copied_safely() -> None:
    layout = StepLayout.from_counts(["a", "b"], [3, 3])
    slab = torch.arange(12.0).reshape(6, 2)
    expected = slab.clone()
    expected[3:6] = slab[2:5]
    widen(slab, layout["b"], layout, slab[2:5])  # overlaps the destination by two rows
    assert torch.equal(slab, expected)


def test_stale_span_from_another_step_is_refused() -> None:
    earlier = StepLayout.from_counts(["a", "b"], [4, 4])
    now = StepLayout.from_counts(["a"], [1])
    with pytest.raises(LayoutError, match=r"rows 4:8 reach beyond this step's 1 token rows"):
        narrow(torch.zeros(1, 3), earlier["b"], now)
