"""`Fragments` and `Back`: one collective per visit, edit detection, handing back exactly."""

from __future__ import annotations

from collections import Counter, namedtuple

import engine_layouts as engine
import pytest
import torch
from simulated import bits_equal, simulated_group
from tpfragments import (
    Back,
    Fragments,
    Group,
    Item,
    Part,
    Partial,
    Replicated,
    Shard,
    Stacked,
    UnknownLocationError,
)


def _column_visit(rank: int = 1, size: int = 2, counts: Counter | None = None
                  ) -> tuple[Fragments, torch.Tensor, torch.Tensor]:
    logical = torch.randn(3, 8)
    pieces = [engine.column_piece(logical, r, size) for r in range(size)]
    group = simulated_group(rank, pieces, counts)
    return Fragments({"mlp.up.output": (Shard(-1), group)}), logical, pieces[rank]


def test_one_collective_however_many_readers() -> None:
    counts: Counter = Counter()
    fragments, _, piece = _column_visit(counts=counts)
    whole, back = fragments.whole("mlp.up.output", piece)
    reads = [whole[row].clone() for row in range(3)] + [whole.mean(), whole.T.contiguous()]
    assert len(reads) == 5 and counts == Counter(all_gather=1)
    assert back() is piece
    assert counts == Counter(all_gather=1)


def test_edits_made_inside_inference_mode_are_detected() -> None:
    # vLLM runs the forward under inference mode, where new tensors have no version counter.
    with torch.inference_mode():
        fragments, logical, piece = _column_visit()
        assert piece.is_inference()
        whole, back = fragments.whole("mlp.up.output", piece)
        assert not whole.is_inference()
        assert not back.changed()
        whole[:, 0] += 1.0
        assert back.changed()
        new_piece = back()
    assert new_piece is not piece
    expected = logical.clone()
    expected[:, 0] += 1.0
    assert bits_equal(new_piece, engine.column_piece(expected, 1, 2))


def test_an_edit_through_a_view_is_detected() -> None:
    with torch.inference_mode():
        fragments, _, piece = _column_visit()
        whole, back = fragments.whole("mlp.up.output", piece)
        whole.narrow(1, 4, 2).zero_()
        assert back.changed()


def test_a_replacement_is_converted_to_the_pieces_dtype() -> None:
    fragments, _, piece = _column_visit()
    whole, back = fragments.whole("mlp.up.output", piece)
    replacement = torch.randn(whole.shape, dtype=torch.float64)
    new_piece = back(replacement)
    assert new_piece.dtype == torch.float32
    assert bits_equal(new_piece, engine.column_piece(replacement.float(), 1, 2))


def test_back_with_the_whole_is_back_without_arguments() -> None:
    fragments, _, piece = _column_visit()
    whole, back = fragments.whole("mlp.up.output", piece)
    assert back(whole) is piece


def test_a_replicated_whole_is_the_engines_tensor_and_in_place_edits_land() -> None:
    counts: Counter = Counter()
    piece = torch.randn(2, 4)
    group = simulated_group(0, [piece, piece.clone()], counts)
    whole, back = Fragments({"x": (Replicated(), group)}).whole("x", piece)
    assert whole is piece
    whole.add_(1.0)
    assert not back.changed() and back() is piece
    assert sum(counts.values()) == 0


def test_item_rules_pass_the_bias_through() -> None:
    logical = torch.randn(3, 8)
    pieces = [engine.column_piece(logical, r, 2) for r in range(2)]
    bias = torch.randn(4)
    fragments = Fragments({"qkv.output": (Item(0, Shard(-1)), simulated_group(0, pieces))})
    value = (pieces[0], bias)
    whole, back = fragments.whole("qkv.output", value)
    assert bits_equal(whole, logical)
    assert back() is value
    handed = back(torch.zeros_like(whole))
    assert isinstance(handed, tuple) and handed[1] is bias
    assert torch.count_nonzero(handed[0]) == 0


def test_item_rules_rebuild_lists_and_namedtuples() -> None:
    Pair = namedtuple("Pair", "output bias")
    piece = torch.randn(2, 3)
    group = simulated_group(0, [piece])
    for value in ([piece, None], Pair(piece, None)):
        whole, back = Fragments({"x": (Item(0, Partial()), group)}).whole("x", value)
        handed = back(torch.ones_like(whole))
        assert type(handed) is type(value) and handed[1] is None
        assert torch.equal(handed[0], torch.ones(2, 3))


def test_split_of_a_never_gathered_value() -> None:
    group = simulated_group(1, [torch.zeros(2, 2)] * 2)
    fragments = Fragments({"a": (Shard(-1), group), "b": (Partial(), group),
                           "c": (Item(0, Shard(0)), group)})
    whole = torch.arange(8.0).reshape(2, 4)
    assert torch.equal(fragments.split("a", whole), whole[:, 2:])
    assert torch.equal(fragments.split("b", whole), torch.zeros(2, 4))
    assert torch.equal(fragments.split("c", whole), whole[1:])


def test_registry() -> None:
    group = Group.single()
    fragments = Fragments()
    fragments.add("a.output", Shard(-1), group)
    fragments.add("a.output", Shard(-1), group)  # the same entry again is fine
    with pytest.raises(ValueError, match="already registered"):
        fragments.add("a.output", Shard(0), group)
    with pytest.raises(TypeError):
        fragments.add("b", "Shard(-1)", group)  # type: ignore[arg-type]
    assert "a.output" in fragments and "b" not in fragments
    assert list(fragments) == ["a.output"] and len(fragments) == 1
    assert fragments.rule("a.output") == Shard(-1) and fragments.group("a.output") is group
    with pytest.raises(UnknownLocationError, match=r"a\.outptu.*known locations: a\.output"):
        fragments.whole("a.outptu", torch.zeros(1))


def test_collectives_per_visit_is_the_same_on_every_rank() -> None:
    for rank in range(4):
        group = simulated_group(rank, [torch.zeros(1)] * 4)
        fragments = Fragments({"r": (Replicated(), group), "s": (Shard(0), group),
                               "q": (Stacked([Part(4, units=1)]), group),
                               "p": (Partial(), group)})
        assert [fragments.collectives_per_visit(loc) for loc in "rsqp"] == [0, 1, 1, 1]


def test_a_group_of_one_communicates_nothing_and_shares_storage() -> None:
    counts: Counter = Counter()
    group = simulated_group(0, [torch.zeros(3, 4)], counts)
    for rule in (Shard(-1), Stacked([2, 2]), Partial(), Shard(1, units=4)):
        piece = torch.randn(3, 4)
        whole, back = Fragments({"x": (rule, group)}).whole("x", piece)
        assert whole is piece and back() is piece
    assert sum(counts.values()) == 0


def test_padding_is_dropped_even_in_a_group_of_one() -> None:
    rule = Stacked([Part(5, padding=3)], dim=0)
    piece = torch.tensor([1.0, 2, 3, 4, 5, 0, 0, 0])
    whole, back = Fragments({"x": (rule, Group.single())}).whole("x", piece)
    assert whole.tolist() == [1, 2, 3, 4, 5] and back() is piece
    whole[0] = 9
    assert back().tolist() == [9, 2, 3, 4, 5, 0, 0, 0]


def test_back_repr_names_the_location() -> None:
    fragments, _, piece = _column_visit()
    _, back = fragments.whole("mlp.up.output", piece)
    assert isinstance(back, Back) and "mlp.up.output" in repr(back)
