"""Bad input gets a clear error naming the location, the rule and the shapes, before any
collective runs (a rank raising after its peers entered a collective would leave them waiting)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from simulated import simulated_group
from tpfragments import (
    FragmentError,
    Fragments,
    GroupSizeError,
    Item,
    Part,
    Partial,
    PieceShapeError,
    Shard,
    Stacked,
    WholeShapeError,
)

QKV = Stacked([Part(32, units=8), Part(8, units=2), Part(8, units=2)], -1)


def _fragments(rule, size: int = 2, counts: Counter | None = None) -> Fragments:
    group = simulated_group(0, [torch.zeros(1)] * size, counts)
    return Fragments({"layers.3.self_attn.qkv_proj.output": (rule, group)})


@pytest.mark.parametrize(("rule", "piece", "size", "error", "words"), [
    (QKV, torch.zeros(5, 23), 2, PieceShapeError, ["is 23 long", "16 + 4 + 4 = 24", "(5, 23)"]),
    (QKV, torch.zeros(5), 2, PieceShapeError, ["is 5 long", "(5,)"]),
    (Shard(2), torch.zeros(5, 4), 2, PieceShapeError, ["2 dimensions, too few for dim 2"]),
    (Item(0, Shard(-1)), torch.zeros(5, 4), 2, PieceShapeError, ["expected a tuple"]),
    (Shard(-1), (torch.zeros(5, 4), None), 2, PieceShapeError, ["Item(0, rule)"]),
    (Shard(-1, units=3), torch.zeros(5, 4), 2, GroupSizeError, ["does not divide 3 units"]),
    (Shard(-1, units=3), torch.zeros(5, 4), 4, GroupSizeError, ["3 units cannot be replicated"]),
    (Stacked([Part(12, units=3)]), torch.zeros(5, 6), 2, GroupSizeError,
     ["does not divide 3 units"]),
    (Stacked([Part(6), Part(6)]), torch.zeros(5, 2), 4, GroupSizeError,
     ["4 ranks does not divide length 6"]),
    (Stacked([Part(100, padding=28)]), torch.zeros(5, 32), 3, GroupSizeError,
     ["3 ranks does not divide length 128"]),
    (Shard(-1, units=4), torch.zeros(5, 3), 2, PieceShapeError, ["not a whole number of 4 units"]),
])
def test_a_piece_that_does_not_fit_is_refused_before_any_collective(
        rule, piece, size: int, error: type, words: list[str]) -> None:
    counts: Counter = Counter()
    fragments = _fragments(rule, size, counts)
    with pytest.raises(error) as raised:
        fragments.whole("layers.3.self_attn.qkv_proj.output", piece)
    message = str(raised.value)
    assert message.startswith("layers.3.self_attn.qkv_proj.output: ")
    assert f"rule {rule!r}" in message
    for word in words:
        assert word in message
    assert raised.value.location == "layers.3.self_attn.qkv_proj.output"
    assert raised.value.rule == rule
    assert sum(counts.values()) == 0


@pytest.mark.parametrize("rule", [QKV, Shard(-1), Partial(), Item(0, Shard(-1))])
def test_an_edited_whole_of_the_wrong_shape_is_refused(rule) -> None:
    size = 2
    if rule == QKV:
        pieces = [torch.randn(5, 24) for _ in range(size)]
    else:
        pieces = [torch.randn(5, 4) for _ in range(size)]
    fragments = Fragments({"here": (rule, simulated_group(0, pieces))})
    value = (pieces[0], None) if isinstance(rule, Item) else pieces[0]
    whole, back = fragments.whole("here", value)
    wrong = torch.zeros(whole.shape[0] + 1, whole.shape[1])
    with pytest.raises(WholeShapeError) as raised:
        back(wrong)
    message = str(raised.value)
    assert message.startswith("here: the edited whole has shape")
    assert raised.value.shapes["edited"] == tuple(wrong.shape)
    assert raised.value.shapes["whole"] == tuple(whole.shape)
    assert raised.value.shapes["piece"] == tuple(pieces[0].shape)
    with pytest.raises(WholeShapeError, match="expected a tensor"):
        back([1.0])  # type: ignore[arg-type]


def test_splitting_a_whole_that_does_not_fit() -> None:
    fragments = _fragments(QKV)
    with pytest.raises(WholeShapeError, match=r"parts add up to 48.*whole \(5, 47\)"):
        fragments.split("layers.3.self_attn.qkv_proj.output", torch.zeros(5, 47))
    with pytest.raises(GroupSizeError, match="3 ranks does not divide length 8"):
        Shard(0).split(torch.zeros(8), 0, 3)
    with pytest.raises(WholeShapeError, match="not a whole number of 3 units"):
        Shard(0, units=3).split(torch.zeros(8), 0, 1)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        Shard(0).split(torch.zeros(8), 2, 2)


def test_every_error_is_a_fragment_error_and_a_value_error() -> None:
    for error in (PieceShapeError, WholeShapeError, GroupSizeError):
        assert issubclass(error, FragmentError) and issubclass(error, ValueError)


def test_unnamed_values_still_get_a_clear_message() -> None:
    with pytest.raises(GroupSizeError, match=r"^<unnamed value>: a group of 3 ranks"):
        Shard(0).split(torch.zeros(8), 0, 3)
