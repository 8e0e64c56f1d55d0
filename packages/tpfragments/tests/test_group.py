"""`Group`: validation, and checks on what injected collectives return."""

from __future__ import annotations

import pytest
import torch
from tpfragments import Group


def test_rank_and_size_are_validated() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        Group(0, 0)
    with pytest.raises(ValueError, match="rank 2 is outside a group of size 2"):
        Group(2, 2)
    assert repr(Group(1, 2, name="tp")) == "Group(name='tp', rank=1, size=2)"


def test_a_group_of_one_needs_no_collectives() -> None:
    group = Group.single()
    piece = torch.randn(3)
    assert group.all_gather(piece).shape == (1, 3)
    assert group.all_reduce(piece) is piece


def test_an_all_gather_that_concatenates_instead_of_stacking_is_caught() -> None:
    group = Group(0, 2, all_gather=lambda t: torch.cat([t, t]), all_reduce=lambda t: t)
    with pytest.raises(RuntimeError, match=r"must stack.*giving \(2, 3, 4\)"):
        group.all_gather(torch.zeros(3, 4))


def test_an_all_reduce_of_the_wrong_shape_is_caught() -> None:
    group = Group(0, 2, all_gather=lambda t: t, all_reduce=lambda t: t.sum())
    with pytest.raises(RuntimeError, match="all_reduce returned shape"):
        group.all_reduce(torch.zeros(3))


def test_a_missing_collective_is_named() -> None:
    with pytest.raises(RuntimeError, match="without an all_gather"):
        Group(0, 2, all_reduce=lambda t: t).all_gather(torch.zeros(1))
    with pytest.raises(RuntimeError, match="without an all_reduce"):
        Group(0, 2, all_gather=lambda t: t).all_reduce(torch.zeros(1))


def test_from_torch_needs_an_initialised_process_group() -> None:
    with pytest.raises(RuntimeError, match="not initialised"):
        Group.from_torch()
