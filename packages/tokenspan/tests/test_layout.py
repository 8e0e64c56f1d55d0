"""StepLayout: construction, validation that names the offending request, and lookups."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import layouts
from hypothesis import given
from tokenspan import LayoutError, Span, StepLayout


@given(layouts())
def test_spans_cover_the_real_rows_disjointly_and_in_order(layout: StepLayout) -> None:
    covered = []
    for key, span in layout.items():
        assert span == layout[key]
        covered.extend(range(span.start, span.stop))
    assert covered == list(range(layout.total))
    assert layout.total <= layout.padded_total


@given(layouts())
def test_every_constructor_builds_the_same_layout(layout: StepLayout) -> None:
    offsets = [*layout.starts, layout.total]
    spans = [layout[key] for key in layout]
    same = [
        StepLayout.from_offsets(layout.keys, offsets, layout.first_positions, layout.padded_total),
        StepLayout.from_spans(layout.keys, spans, layout.padded_total),
        StepLayout.from_offsets(
            layout.keys, torch.tensor(offsets), torch.tensor(layout.first_positions),
            layout.padded_total,
        ),
    ]
    assert all(other == layout for other in same)


@given(layouts())
def test_vectorised_positions_and_owners_match_each_span(layout: StepLayout) -> None:
    expected_positions = [p for _, span in layout.items() for p in span.positions().tolist()]
    expected_owners = [i for i, count in enumerate(layout.counts) for _ in range(count)]
    assert layout.positions().tolist() == expected_positions
    assert layout.request_indices().tolist() == expected_owners


def test_offsets_as_engines_hand_them_over() -> None:
    # vLLM's query_start_loc is a numpy buffer; pass its first num_reqs + 1 entries.
    query_start_loc = np.array([0, 5, 16, 16, 16], dtype=np.int32)
    layout = StepLayout.from_offsets(["a", "b"], query_start_loc[:3], first_positions=[0, 0])
    assert layout["b"] == Span(5, 16, 0)
    assert layout.total == 16 and layout.padded_total == 16
    assert isinstance(layout["b"].start, int)


def test_chunked_prefill_step_from_the_environment_notes() -> None:
    # Three prompts of 5, 20 and 2 tokens, budget 16: step 2 of the run in ENVIRONMENT.md.
    layout = StepLayout.from_offsets(["r0", "r1", "r2"], [0, 1, 10, 12], [5, 11, 0])
    assert layout["r0"].positions().tolist() == [5]
    assert layout["r1"].positions().tolist() == list(range(11, 20))
    assert layout["r2"].positions().tolist() == [0, 1]


def test_empty_layout() -> None:
    layout = StepLayout.from_counts([], [])
    assert len(layout) == 0 and layout.total == 0
    assert layout.positions().tolist() == []
    assert list(layout.items()) == []


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: StepLayout.from_counts(["a", "b"], [3, -1]), r"'b' \(index 1\).*negative"),
        (lambda: StepLayout.from_offsets(["a", "b"], [0, 4, 2]), r"'b' \(index 1\).*negative"),
        (lambda: StepLayout.from_offsets(["a"], [2, 4]), r"must start at 0.*gap"),
        (lambda: StepLayout.from_spans(["a"], [(1, 3)]), r"'a'.*rows 0:1 belong to no request"),
        (lambda: StepLayout.from_spans(["a", "b"], [(0, 3), (2, 5)]), r"'b'.*overlaps.*'a'"),
        (lambda: StepLayout.from_spans(["a", "b"], [(0, 3), (4, 5)]), r"'b'.*rows 3:4.*gap"),
        (
            lambda: StepLayout.from_spans(["a", "b", "c"], [(0, 3), (3, 5), (1, 2)]),
            r"'c'.*before the previous request 'b'.*order",
        ),
        (
            lambda: StepLayout.from_counts(["a", "b"], [3, 4], padded_total=5),
            r"'b' \(index 1\) ends at row 7, beyond the padded total of 5",
        ),
        (lambda: StepLayout.from_counts(["a", "a"], [1, 1]), r"'a' appears more than once"),
        (lambda: StepLayout.from_counts(["a", "b"], [1]), r"2 keys but 1 counts"),
        (lambda: StepLayout.from_offsets(["a", "b"], [0, 1]), r"one entry more than keys"),
        (
            lambda: StepLayout.from_counts(["a", "b"], [1, 1], first_positions=[0, -2]),
            r"'b'.*negative first position",
        ),
        (lambda: StepLayout.from_spans(["a"], [(3, 1)]), r"end \(row 1\) before it starts"),
        (lambda: StepLayout.from_counts(["a"], "x"), r"integers"),
    ],
)
def test_invalid_layouts_name_the_offending_request(build, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(LayoutError, match=message):
        build()


def test_unknown_key_names_the_known_ones() -> None:
    layout = StepLayout.from_counts(["a", "b"], [1, 2])
    with pytest.raises(KeyError, match=r"'zz' is not in this step's layout.*'a', 'b'"):
        layout["zz"]
    assert "a" in layout and "zz" not in layout
    assert layout.index("b") == 1


def test_span_basics() -> None:
    span = Span(4, 7, first_position=10)
    assert len(span) == 3
    assert span.rows == slice(4, 7)
    assert span.last_position == 12
    assert span.positions().tolist() == [10, 11, 12]
    assert len(Span(3, 3)) == 0 and Span(3, 3).positions().numel() == 0
    with pytest.raises(LayoutError, match="negative row"):
        Span(-1, 2)
    with pytest.raises(LayoutError, match="first position"):
        Span(0, 2, first_position=-1)


def test_repr_is_readable() -> None:
    layout = StepLayout.from_counts(["a", "b"], [1, 2], [0, 7], padded_total=4)
    assert repr(layout) == "StepLayout({'a': 0:1@0, 'b': 1:3@7}, total=3, padded=4)"
