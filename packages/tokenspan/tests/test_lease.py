"""lease: private copies whose edits land only in their span; untouched leases write nothing."""

from __future__ import annotations

import pytest
import torch
from conftest import layouts, slab_with_span, slabs
from hypothesis import given
from hypothesis import strategies as st
from tokenspan import READ_MODES, SpanShapeError, StepLayout, lease

EDITS = {
    "add_": lambda t: t.add_(1.5),
    "setitem": lambda t: t.__setitem__((..., 0), 7.0),
    "view_mul_": lambda t: t.view(-1).mul_(-2.0) if t.is_contiguous() else t.mul_(-2.0),
    "zero_": lambda t: t.zero_(),
}


def _check_edit_lands_only_in_span(data: st.DataObject) -> None:
    layout, slab, axis, span = data.draw(slab_with_span())
    edit = EDITS[data.draw(st.sampled_from(sorted(EDITS)))]
    expected = slab.clone()
    edit(expected.narrow(axis, span.start, len(span)))
    lent = lease(slab, span, layout)
    edit(lent.value)
    assert lent.commit() == (len(span) > 0)
    assert torch.equal(slab, expected)  # the span changed exactly as edited, nothing else did


@given(st.data())
def test_in_place_edit_lands_only_in_its_span(data: st.DataObject) -> None:
    _check_edit_lands_only_in_span(data)


@given(st.data())
def test_in_place_edit_lands_under_inference_mode(data: st.DataObject) -> None:
    # Engines run their forward under inference mode, where new tensors lack a version counter.
    with torch.inference_mode():
        _check_edit_lands_only_in_span(data)


@given(st.data(), st.sampled_from(READ_MODES), st.booleans())
def test_unmodified_lease_writes_nothing(data: st.DataObject, mode: str, inference: bool) -> None:
    layout = data.draw(layouts())
    slab, _ = data.draw(slabs(layout))
    before = slab.clone()
    with torch.inference_mode(inference):
        slab = slab.clone() if inference else slab
        for _, span in layout.items():
            lent = lease(slab, span, layout, mode=mode)
            assert not lent.changed
            assert lent.commit() is False
    assert torch.equal(slab, before)
    if not inference:
        assert slab._version == 0  # not even a same-value write happened


def test_kept_value_survives_later_in_place_engine_writes() -> None:
    layout = StepLayout.from_counts(["a", "b"], [2, 2])
    slab = torch.randn(4, 3)
    kept = lease(slab, layout["b"], layout).value
    snapshot = kept.clone()
    slab.mul_(0)  # what fused in-place kernels do to their inputs after the read
    assert torch.equal(kept, snapshot)


@pytest.mark.parametrize(
    ("mode", "in_place_lands", "assignment_lands", "kept_is_view"),
    [("lease", True, True, False), ("copy", False, True, False), ("view", True, True, True)],
)
def test_read_modes(mode: str, in_place_lands: bool, assignment_lands: bool,
                    kept_is_view: bool) -> None:
    layout = StepLayout.from_counts(["a", "b"], [2, 2])
    slab = torch.zeros(4, 3)
    lent = lease(slab, layout["b"], layout, mode=mode)
    assert lent.mode == mode
    lent.value.add_(1.0)
    lent.commit()
    assert torch.equal(slab[2:], torch.full((2, 3), 1.0 if in_place_lands else 0.0))
    assert (lent.value.data_ptr() == slab[2:].data_ptr()) == kept_is_view
    lent.value = torch.full((2, 3), 5.0)
    assert lent.commit() is assignment_lands
    assert torch.equal(slab[2:], torch.full((2, 3), 5.0))
    assert torch.count_nonzero(slab[:2]) == 0


def test_nested_value_writes_only_changed_leaves() -> None:
    layout = StepLayout.from_counts(["a", "b"], [2, 3])
    hidden, residual = torch.randn(5, 4), torch.randn(5, 4)
    whole = (hidden, residual, None)
    lent = lease(whole, layout["b"], layout)
    lent.value[1].mul_(2)
    assert lent.commit() is True
    assert hidden._version == 0  # the unchanged half was not rewritten
    assert torch.equal(residual[2:], lent.value[1])
    lent.value = (torch.zeros(3, 4), lent.value[1], None)  # replace the other half, keep this one
    version = residual._version
    assert lent.commit() is True
    assert torch.count_nonzero(hidden[2:]) == 0 and residual._version == version


def test_second_commit_writes_only_new_changes() -> None:
    layout = StepLayout.from_counts(["a"], [3])
    slab = torch.zeros(3, 2)
    lent = lease(slab, layout["a"], layout)
    lent.value.add_(1)
    assert lent.commit() is True
    assert lent.commit() is False
    lent.value.add_(1)
    assert lent.commit() is True and torch.equal(slab, torch.full((3, 2), 2.0))


def test_context_manager_commits_on_success_only() -> None:
    layout = StepLayout.from_counts(["a"], [3])
    slab = torch.zeros(3, 2)
    with lease(slab, layout["a"], layout) as lent:
        lent.value.add_(1)
    assert torch.equal(slab, torch.ones(3, 2))
    with pytest.raises(RuntimeError), lease(slab, layout["a"], layout) as lent:
        lent.value.add_(1)
        raise RuntimeError("user code failed")
    assert torch.equal(slab, torch.ones(3, 2))


def test_wrong_shape_assignment_is_refused_without_writing() -> None:
    layout = StepLayout.from_counts(["a", "b"], [2, 3])
    slab = torch.zeros(5, 4)
    lent = lease(slab, layout["b"], layout)
    lent.value = torch.ones(3, 5)
    with pytest.raises(SpanShapeError, match=r"expected shape \(3, 4\).*got \(3, 5\)"):
        lent.commit()
    assert torch.count_nonzero(slab) == 0


def test_unknown_mode_is_refused() -> None:
    layout = StepLayout.from_counts(["a"], [1])
    with pytest.raises(ValueError, match="read mode must be one of"):
        lease(torch.zeros(1, 2), layout["a"], layout, mode="clone")  # type: ignore[arg-type]
