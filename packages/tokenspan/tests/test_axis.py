"""token_axis: per-token tensors are found in every shape engines use; others pass through."""

from __future__ import annotations

import pytest
import torch
from tokenspan import StepLayout, token_axis

LAYOUT = StepLayout.from_counts(["a", "b"], [3, 2], padded_total=8)  # total 5, padded 8


@pytest.mark.parametrize(
    ("shape", "axis"),
    [
        ((5, 16), 0),  # vLLM's flat slab
        ((8, 16), 0),  # padded slab
        ((5,), 0),  # token ids, positions
        ((5, 4, 32), 0),  # heads split out
        ((1, 5, 16), 1),  # singleton batch axis
        ((1, 8, 16), 1),  # singleton batch axis, padded
        ((16, 16), None),  # a weight
        ((), None),  # a scalar
        ((2, 5, 16), None),  # a real batch axis is not a flat slab
        ((1, 16), None),
    ],
)
def test_token_axis(shape: tuple[int, ...], axis: int | None) -> None:
    assert token_axis(torch.zeros(shape), LAYOUT) == axis


@pytest.mark.parametrize("value", [None, 3, "hidden", [torch.zeros(5, 2)], {"h": torch.zeros(5)}])
def test_non_tensors_are_not_per_token(value: object) -> None:
    assert token_axis(value, LAYOUT) is None


def test_single_decode_token_reads_as_axis_zero() -> None:
    decode = StepLayout.from_counts(["a"], [1], [41])
    assert token_axis(torch.zeros(1, 16), decode) == 0
    assert token_axis(torch.zeros(1, 1, 16), decode) == 0
