"""The rules' local math against the engine's layout arithmetic, over many generated layouts.

Pieces come from `engine_layouts.generic_piece` (vLLM's `shard_rank = rank // replicas`
arithmetic), never from the rule under test, so agreement means something.
"""

from __future__ import annotations

from collections import Counter

import engine_layouts as engine
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from simulated import bits_equal, simulated_group
from tpfragments import Fragments, Item, Part, Partial, Replicated, Shard, Stacked

SIZES = (1, 2, 3, 4, 6, 8)


@st.composite
def stacked_layouts(draw: st.DrawFn) -> tuple[Stacked, int, list[tuple[int, int | None, int]],
                                              tuple[int, ...]]:
    """A group size, a `Stacked` rule valid for it, its parts and a logical shape."""
    size = draw(st.sampled_from(SIZES))
    parts: list[tuple[int, int | None, int]] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["plain", "heads", "padded"]))
        if kind == "plain":
            parts.append((size * draw(st.integers(0, 4)), None, 0))
        elif kind == "heads":
            divisors = [u for u in range(1, size + 1) if size % u == 0]
            units = draw(st.sampled_from(divisors + [size * m for m in (1, 2, 3)]))
            parts.append((units * draw(st.integers(1, 3)), units, 0))
        else:
            real = draw(st.integers(1, 20))
            padded = -(-real // size) * size + size * draw(st.integers(0, 2))
            parts.append((real, None, padded - real))
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(-ndim, ndim - 1))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[dim] = sum(length for length, _, _ in parts)
    rule = Stacked([Part(length, units=units, padding=padding)
                    for length, units, padding in parts], dim=dim)
    return rule, size, parts, tuple(shape)


def _logical_parts(logical: torch.Tensor, parts: list[tuple[int, int | None, int]], dim: int
                   ) -> list[tuple[torch.Tensor, int | None, int]]:
    lengths = [length for length, _, _ in parts]
    return [(tensor, units, padding) for tensor, (_, units, padding)
            in zip(logical.split(lengths, dim=dim), parts, strict=True)]


@settings(max_examples=300, deadline=None)
@given(stacked_layouts(), st.integers(0, 2**31 - 1))
def test_stacked_matches_the_engine_layout(layout: tuple, seed: int) -> None:
    rule, size, parts, shape = layout
    logical = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    pieces = [engine.generic_piece(_logical_parts(logical, parts, rule.dim), rank, size, rule.dim)
              for rank in range(size)]
    assert rule.whole_shape(pieces[0].shape, size) == logical.shape
    assert rule.piece_shape(logical.shape, size) == pieces[0].shape
    assert bits_equal(rule.assemble(torch.stack(pieces)), logical)
    for rank in range(size):
        assert bits_equal(rule.split(logical, rank, size), pieces[rank])


@settings(max_examples=200, deadline=None)
@given(stacked_layouts(), st.integers(0, 2**31 - 1), st.data())
def test_a_visit_hands_back_exactly(layout: tuple, seed: int, data: st.DataObject) -> None:
    """Unedited: the engine's own object. Edited in place: the engine's layout of the edit."""
    rule, size, parts, shape = layout
    generator = torch.Generator().manual_seed(seed)
    logical = torch.randn(shape, generator=generator)
    pieces = [engine.generic_piece(_logical_parts(logical, parts, rule.dim), rank, size, rule.dim)
              for rank in range(size)]
    edit = torch.randn(shape, generator=generator)
    mask = torch.rand(shape, generator=generator) < data.draw(st.floats(0, 1))
    for rank in range(size):
        counts: Counter = Counter()
        fragments = Fragments({"x": (rule, simulated_group(rank, pieces, counts))})
        with torch.inference_mode():
            piece = pieces[rank].clone()
            whole, back = fragments.whole("x", piece)
            assert bits_equal(whole, logical)
            assert back() is piece
            whole, back = fragments.whole("x", piece)
            whole[mask] = edit[mask]
            edited = whole.clone()
            new_piece = back()
        expected = engine.generic_piece(_logical_parts(edited, parts, rule.dim), rank, size,
                                        rule.dim)
        assert bits_equal(new_piece, expected)
        assert sum(counts.values()) == (0 if size == 1 else 2)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(SIZES), st.integers(1, 12), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_shard_with_units_matches_vllm_heads(size: int, heads_per: int, width: int,
                                             seed: int) -> None:
    """Heads cut contiguously, or replicated when the ranks outnumber them (vLLM's KV heads)."""
    candidates = [u for u in range(1, 3 * size + 1) if u % size == 0 or size % u == 0]
    units = candidates[heads_per % len(candidates)]
    logical = torch.randn(3, units * width, generator=torch.Generator().manual_seed(seed))
    pieces = [engine.heads_piece(logical, rank, size, units) for rank in range(size)]
    rule = Shard(-1, units=units)
    assert rule.whole_shape(pieces[0].shape, size) == logical.shape
    assert bits_equal(rule.assemble(torch.stack(pieces)), logical)
    assert all(bits_equal(rule.split(logical, rank, size), pieces[rank]) for rank in range(size))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(SIZES), st.integers(0, 2**31 - 1), st.floats(0, 1),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
def test_partial_edit_reduces_to_the_edit_and_keeps_untouched_partials(
        size: int, seed: int, fraction: float, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(seed)
    # Magnitudes spread over decades, so that the order of a sum matters for rounding.
    partials = [(torch.randn(4, 6, generator=generator)
                 * 10 ** torch.randint(-3, 4, (4, 6), generator=generator)).to(dtype)
                for _ in range(size)]
    edit = torch.randn(4, 6, generator=generator).to(dtype)
    mask = torch.rand(4, 6, generator=generator) < fraction
    new_pieces = []
    for rank in range(size):
        fragments = Fragments({"x": (Partial(), simulated_group(rank, partials))})
        with torch.inference_mode():
            piece = partials[rank].clone()
            whole, back = fragments.whole("x", piece)
            whole[mask] = edit[mask]
            edited = whole.clone()
            new_pieces.append(back())
        if size > 1:
            untouched = ~mask
            assert bits_equal(new_pieces[-1][untouched], partials[rank][untouched])
    # The engine's reduction (here: in rank order) of the new pieces.
    total = new_pieces[0].clone()
    for new_piece in new_pieces[1:]:
        total += new_piece
    assert bits_equal(total, edited)


def test_partial_never_rewrites_an_unedited_piece_as_whole_over_size() -> None:
    partials = [torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.7, 0.05, 1e-8]),
                torch.tensor([1e8, -1e8, 3.0])]
    for rank in range(3):
        fragments = Fragments({"x": (Partial(), simulated_group(rank, partials))})
        piece = partials[rank].clone()
        _, back = fragments.whole("x", piece)
        assert back() is piece
        assert bits_equal(piece, partials[rank])


def test_partial_edit_to_nan_and_infinity_reaches_the_engine() -> None:
    partials = [torch.ones(4), torch.ones(4)]
    handed = []
    for rank in range(2):
        whole, back = Fragments({"x": (Partial(), simulated_group(rank, partials))}).whole(
            "x", partials[rank].clone())
        whole[1] = float("nan")
        whole[2] = float("inf")
        handed.append(back())
    total = handed[0] + handed[1]
    assert total[0] == 2 and total[1].isnan() and total[2] == float("inf") and total[3] == 2


def test_split_of_partial_puts_the_whole_on_rank_zero() -> None:
    whole = torch.randn(3, 4)
    pieces = Partial().pieces(whole, 3)
    assert bits_equal(pieces[0], whole) and pieces[0] is not whole
    assert all(torch.count_nonzero(piece) == 0 for piece in pieces[1:])
    assert bits_equal(pieces[0] + pieces[1] + pieces[2], whole)


def test_replicated_is_the_piece_itself() -> None:
    piece = torch.randn(2, 3)
    assert Replicated().whole(piece, simulated_group(1, [piece, piece])) is piece
    assert Replicated().split(piece, 1, 2) is piece
    assert Replicated().shares_storage(8)


def test_gate_up_un_interleaves_what_a_plain_gather_would_interleave() -> None:
    gate, up = torch.arange(8.0).reshape(1, 8), 100 + torch.arange(8.0).reshape(1, 8)
    pieces = [engine.merged_piece([gate, up], rank, 2) for rank in range(2)]
    assert pieces[0].tolist() == [[0, 1, 2, 3, 100, 101, 102, 103]]
    naive = torch.cat(pieces, dim=-1)
    assert not torch.equal(naive, torch.cat([gate, up], dim=-1))
    assert torch.equal(Stacked([8, 8]).assemble(torch.stack(pieces)), torch.cat([gate, up], -1))


def test_grouped_query_attention_keeps_one_copy_of_each_replicated_kv_head() -> None:
    heads, kv_heads, head, size = 4, 1, 2, 4
    q = torch.arange(heads * head, dtype=torch.float32).reshape(1, -1)
    k = 50 + torch.arange(kv_heads * head, dtype=torch.float32).reshape(1, -1)
    v = 90 + torch.arange(kv_heads * head, dtype=torch.float32).reshape(1, -1)
    pieces = [engine.qkv_piece(q, k, v, rank, size, heads, kv_heads) for rank in range(size)]
    # The one KV head is replicated on all 4 ranks.
    assert all(piece[0, 2:4].tolist() == [50, 51] for piece in pieces)
    rule = Stacked([Part(heads * head, units=heads), Part(kv_heads * head, units=kv_heads),
                    Part(kv_heads * head, units=kv_heads)])
    whole = rule.assemble(torch.stack(pieces))
    assert whole.tolist() == [q[0].tolist() + k[0].tolist() + v[0].tolist()]
    assert all(torch.equal(rule.split(whole, rank, size), pieces[rank]) for rank in range(size))


def test_rules_compare_by_value() -> None:
    assert Shard(-1) == Shard(-1) and Shard(-1) != Shard(0) and Shard(1, units=2) != Shard(1)
    assert Stacked([4, Part(4)]) == Stacked([Part(4), 4])
    assert Item(0, Partial()) == Item(0, Partial()) != Item(1, Partial())
    assert len({Replicated(), Replicated(), Partial()}) == 2
    shown = "Stacked(parts=[Part(8, units=4), 2], dim=0)"
    assert repr(Stacked([Part(8, units=4), 2], dim=0)) == shown


@pytest.mark.parametrize("bad", [dict(size=-1), dict(size=4, units=0), dict(size=4, units=3),
                                 dict(size=3, padding=-1)])
def test_part_refuses_impossible_definitions(bad: dict) -> None:
    with pytest.raises(ValueError):
        Part(**bad)


def test_collectives_depend_on_rule_and_size_only() -> None:
    for rule, expected in [(Replicated(), 0), (Shard(0), 1), (Stacked([2, 2]), 1),
                           (Partial(), 1), (Item(0, Shard(-1)), 1), (Item(0, Replicated()), 0)]:
        assert rule.collectives(1) == 0
        assert [rule.collectives(size) for size in (2, 4, 8)] == [expected] * 3
