"""lend: one tensor lent to user code, and what to write back after it ran."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_lease import EDITS
from tokenspan import READ_MODES, SpanShapeError, lend


@given(st.sampled_from(READ_MODES), st.booleans(), st.integers(1, 4), st.integers(1, 3))
def test_untouched_or_returned_as_is_writes_nothing(mode: str, inference: bool, rows: int,
                                                    width: int) -> None:
    with torch.inference_mode(inference):
        tensor = torch.randn(rows, width)
        lent = lend(tensor, mode)  # type: ignore[arg-type]
        assert lent.mode == mode
        assert torch.equal(lent.value, tensor)
        assert (lent.value is tensor) == (mode == "view")
        assert lent.written(None) is None
        assert lent.written(lent.value) is None


@given(st.sampled_from(READ_MODES), st.booleans(), st.sampled_from(sorted(EDITS)),
       st.booleans())
def test_in_place_edits_are_written_back_in_lease_mode_only(
    mode: str, inference: bool, edit: str, return_it: bool
) -> None:
    # Engines run under inference mode, where the tensor lent from has no version counter; the
    # private copy has one all the same.
    with torch.inference_mode(inference):
        tensor = torch.randn(3, 4)
        before = tensor.clone()
        lent = lend(tensor, mode)  # type: ignore[arg-type]
        EDITS[edit](lent.value)
        written = lent.written(lent.value if return_it else None)
    if mode == "lease":
        assert written is lent.value
    else:
        assert written is None
    # a private copy never touches the lent tensor; a view's edits are already in it
    assert torch.equal(tensor, lent.value if mode == "view" else before)


@pytest.mark.parametrize("mode", READ_MODES)
def test_a_replacement_is_written_back_in_every_mode(mode: str) -> None:
    lent = lend(torch.zeros(2, 3), mode)  # type: ignore[arg-type]
    replacement = torch.ones(2, 3)
    assert lent.written(replacement) is replacement
    lent.value.add_(1.0)  # a replacement wins over an in-place edit
    assert lent.written(replacement) is replacement


@pytest.mark.parametrize("mode", ["lease", "copy"])
def test_a_copy_is_private(mode: str) -> None:
    tensor = torch.zeros(2, 3)
    lent = lend(tensor, mode)  # type: ignore[arg-type]
    assert lent.value.data_ptr() != tensor.data_ptr()
    tensor.add_(1.0)  # the engine overwrites what it lent from...
    assert torch.count_nonzero(lent.value) == 0  # ...and the lent copy is intact


def test_bad_results_and_modes_are_refused() -> None:
    lent = lend(torch.zeros(2, 3))
    with pytest.raises(SpanShapeError, match=r"expected a tensor of shape \(2, 3\) or None"):
        lent.written([1.0, 2.0])
    with pytest.raises(ValueError, match="read mode must be one of"):
        lend(torch.zeros(1), "clone")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["lease", "copy"])
def test_an_owned_tensor_is_lent_as_it_is_and_its_edits_are_seen_in_lease_mode(mode) -> None:
    """A private copy the caller made already is not copied again; in lease mode an in-place
    edit is written back, in copy mode it is not."""
    tensor = torch.zeros(2, 3)
    lent = lend(tensor, mode, owned=True)
    assert lent.value is tensor
    assert lent.written(None) is None
    lent.value.add_(1)
    assert (lent.written(None) is tensor) == (mode == "lease")
