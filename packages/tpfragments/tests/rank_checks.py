"""The checks each rank runs inside a real gloo group (spawned by `tpf_ranks.run_ranks`).

For every rule and layout in `cases(size)`, each rank, inside `torch.inference_mode()` as vLLM's
forward runs:

1. builds the same random logical tensor (a shared seed) and its own piece as the engine lays
   it out (`engine_layouts`, vLLM's arithmetic);
2. visit 1, read only: `Fragments.whole` equals the logical tensor bit for bit, three readers
   share it, and `back()` returns the engine's very object with its bits unchanged;
3. visit 2, in-place edit of some rows through a view: the new piece is the engine's layout of
   the edited whole (for `Partial`: the engine's all-reduce of the new pieces is the edited
   whole, and untouched rows keep every rank's original partial);
4. visit 3, replacement by a new tensor (float64, converted back to the piece's dtype): same;
5. a replacement of the wrong shape raises `WholeShapeError` naming the location.

Every collective goes through counting wrappers; each rank reports its counts so the test can
assert exactly one collective per gathering visit, none in `back`, and equal counts on all ranks.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import engine_layouts as engine
import torch
import torch.distributed as dist
from simulated import bits_equal
from torch import Tensor
from tpfragments import (
    Fragments,
    Group,
    GroupSizeError,
    Item,
    Part,
    Partial,
    PieceShapeError,
    Replicated,
    Rule,
    Shard,
    Stacked,
    WholeShapeError,
)

TOKENS = 5
EDITED_ROWS = slice(1, 4, 2)  # rows 1 and 3: a strided view, edited in place


@dataclass
class Case:
    """One rule and one engine layout to check."""

    name: str
    rule: Rule
    shape: tuple[int, ...]
    piece: Callable[[Tensor, int, int], Tensor]
    dtype: torch.dtype = torch.float32
    partial: bool = False
    bias: bool = False
    expected_collectives: int = 1
    extra: dict = field(default_factory=dict)


def _split_last(whole: Tensor, widths: list[int]) -> list[Tensor]:
    return list(whole.split(widths, dim=-1))


def cases(size: int) -> list[Case]:
    """Every rule and layout, with sizes valid for groups of 2 and 4 ranks."""
    head = 4
    qkv_gqa = [8 * head, 2 * head, 2 * head]
    qkv_mqa = [4 * head, 1 * head, 1 * 6]  # v_head_size 6 differs from head_size 4
    return [
        Case("replicated", Replicated(), (TOKENS, 16), lambda w, r, s: w.clone(),
             expected_collectives=0),
        Case("column-output", Shard(-1), (TOKENS, 24), engine.column_piece),
        Case("row-input-dim0", Shard(0), (8, 6), lambda w, r, s: engine.column_piece(w, r, s, 0)),
        Case("attention-query-2d", Shard(1, units=8), (TOKENS, 8 * head),
             lambda w, r, s: engine.heads_piece(w, r, s, 8)),
        Case("attention-query-3d", Shard(1, units=8), (TOKENS, 8, head),
             lambda w, r, s: engine.heads_piece(w, r, s, 8, dim=1)),
        Case("attention-kv-one-head", Shard(1, units=1), (TOKENS, head),
             lambda w, r, s: engine.heads_piece(w, r, s, 1)),
        Case("attention-kv-two-heads", Shard(1, units=2), (TOKENS, 2 * head),
             lambda w, r, s: engine.heads_piece(w, r, s, 2)),
        Case("gate-up", Stacked([12, 12], -1), (TOKENS, 24),
             lambda w, r, s: engine.merged_piece(_split_last(w, [12, 12]), r, s)),
        Case("qkv-gqa", Stacked([Part(qkv_gqa[0], units=8), Part(qkv_gqa[1], units=2),
                                 Part(qkv_gqa[2], units=2)], -1),
             (TOKENS, sum(qkv_gqa)),
             lambda w, r, s: engine.qkv_piece(*_split_last(w, qkv_gqa), r, s, 8, 2)),
        Case("qkv-mqa-v-head-size", Stacked([Part(qkv_mqa[0], units=4), Part(qkv_mqa[1], units=1),
                                             Part(qkv_mqa[2], units=1)], -1),
             (TOKENS, sum(qkv_mqa)),
             lambda w, r, s: engine.qkv_piece(*_split_last(w, qkv_mqa), r, s, 4, 1)),
        Case("qkv-gqa-bf16", Stacked([Part(qkv_gqa[0], units=8), Part(qkv_gqa[1], units=2),
                                      Part(qkv_gqa[2], units=2)], -1),
             (TOKENS, sum(qkv_gqa)),
             lambda w, r, s: engine.qkv_piece(*_split_last(w, qkv_gqa), r, s, 8, 2),
             dtype=torch.bfloat16),
        Case("vocab-logits-padded", Stacked([Part(100, padding=28), Part(0)], -1), (TOKENS, 100),
             lambda w, r, s: engine.vocab_piece(w, r, s, 100, 0, dim=-1)),
        Case("vocab-weight-added", Stacked([Part(100, padding=28), Part(10, padding=54)], 0),
             (110, 4), lambda w, r, s: engine.vocab_piece(w, r, s, 100, 10, dim=0)),
        Case("partial", Partial(), (TOKENS, 16), lambda w, r, s: w, partial=True),
        Case("partial-bf16", Partial(), (TOKENS, 16), lambda w, r, s: w, partial=True,
             dtype=torch.bfloat16),
        Case("row-output-tuple", Item(0, Partial()), (TOKENS, 16), lambda w, r, s: w,
             partial=True, bias=True),
        Case("column-output-tuple", Item(0, Shard(-1)), (TOKENS, 24), engine.column_piece,
             bias=True),
    ]


def _counting_group(counts: Counter) -> Group:
    base = Group.from_torch()

    def all_gather(tensor: Tensor) -> Tensor:
        counts["all_gather"] += 1
        return base.all_gather(tensor)

    def all_reduce(tensor: Tensor) -> Tensor:
        counts["all_reduce"] += 1
        return base.all_reduce(tensor)

    return Group(base.rank, base.size, all_gather=all_gather, all_reduce=all_reduce,
                 name="counted-gloo")


def _engine_sum(piece: Tensor) -> Tensor:
    """The engine's own later reduction of the pieces (an uncounted gloo all-reduce)."""
    with torch.inference_mode(False):
        total = piece.clone()
        dist.all_reduce(total)
    return total


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _run_case(case: Case, rank: int, size: int, seed: int) -> dict:
    counts: Counter = Counter()
    group = _counting_group(counts)
    location = f"layers.0.{case.name}"
    fragments = Fragments({location: (case.rule, group)})
    shared = torch.Generator().manual_seed(seed)
    report: dict = {"visits": []}

    with torch.inference_mode():
        # The logical whole (or, for partial sums, every rank's partial) is the same on all ranks.
        if case.partial:
            partials = [torch.randn(case.shape, generator=shared).to(case.dtype)
                        for _ in range(size)]
            piece = partials[rank].clone()
            logical = _engine_sum(piece)
        else:
            logical = torch.randn(case.shape, generator=shared).to(case.dtype)
            piece = case.piece(logical, rank, size)
        bias = torch.randn(case.shape[-1], generator=shared) if case.bias else None
        value = (piece, bias) if case.bias else piece
        original_bits = piece.clone()

        # Visit 1: read only, by three readers.
        before = sum(counts.values())
        whole, back = fragments.whole(location, value)
        readers = [whole[0].clone(), whole.sum(), whole.narrow(0, 1, 2).abs().max()]
        gathered = sum(counts.values()) - before
        _check(len(readers) == 3, "readers")
        _check(bits_equal(whole, logical), f"whole differs from the logical tensor: "
               f"max |diff| {(whole.double() - logical.double()).abs().max().item()}")
        _check(case.expected_collectives == 0 or not whole.is_inference(),
               "a gathered whole must be a normal tensor with a version counter")
        _check(not back.changed(), "an unedited visit reports a change")
        before = sum(counts.values())
        handed = back()
        report["back_collectives"] = sum(counts.values()) - before
        _check(handed is value, "an unedited visit must hand back the engine's own object")
        _check(bits_equal(piece, original_bits), "the engine's piece changed during a read")
        report["visits"].append(gathered)

        # Visit 2: an in-place edit of rows 1 and 3 through a strided view.
        before = sum(counts.values())
        whole, back = fragments.whole(location, value)
        report["visits"].append(sum(counts.values()) - before)
        rows = whole[EDITED_ROWS]
        rows.mul_(2).add_(1)
        edited = whole.clone()
        # A whole that shares the engine's storage needs no handing back: the edit landed.
        _check(back.changed() == (case.expected_collectives > 0),
               "an in-place edit of a gathered whole went unnoticed")
        before = sum(counts.values())
        handed = back()
        report["back_collectives"] += sum(counts.values()) - before
        _check_handed(case, handed, value, edited, piece, rank, size, edited_rows=EDITED_ROWS)

        # Visit 3: a replacement, made in float64 and converted to the piece's dtype.
        before = sum(counts.values())
        whole, back = fragments.whole(location, value)
        report["visits"].append(sum(counts.values()) - before)
        replacement = torch.randn(whole.shape, generator=shared, dtype=torch.float64)
        handed = back(replacement)
        _check_handed(case, handed, value, replacement.to(case.dtype), piece, rank, size,
                      edited_rows=None)

        # A replacement of the wrong shape: a clear error, before anything is handed back.
        whole, back = fragments.whole(location, value)
        wrong = torch.zeros((*whole.shape[:-1], whole.shape[-1] + 1), dtype=whole.dtype)
        try:
            back(wrong)
        except WholeShapeError as error:
            _check(location in str(error) and repr(case.rule) in str(error),
                   f"the error does not name the location and rule: {error}")
        else:
            raise AssertionError("a wrong-shaped replacement was accepted")
    report["total"] = dict(counts)
    return report


def _check_handed(case: Case, handed: object, value: object, edited: Tensor, piece: Tensor,
                  rank: int, size: int, edited_rows: slice | None) -> None:
    """The new piece must make the engine see exactly `edited`."""
    if case.bias:
        _check(isinstance(handed, tuple) and handed[1] is value[1],
               "the bias must pass through untouched")
        new_piece = handed[0]
    else:
        new_piece = handed
    _check(new_piece.dtype == piece.dtype, f"dtype changed to {new_piece.dtype}")
    if case.partial:
        total = _engine_sum(new_piece)
        _check(bits_equal(total, edited), "the engine's reduction of the new pieces is not "
               f"the edit: max |diff| {(total.double() - edited.double()).abs().max().item()}")
        if edited_rows is not None:
            untouched = torch.ones(piece.shape[0], dtype=torch.bool)
            untouched[edited_rows] = False
            _check(bits_equal(new_piece[untouched], piece[untouched]),
                   "rows the edit left alone must keep the rank's original partial")
            if rank > 0:
                _check(bool((new_piece[edited_rows] == 0).all()),
                       "edited rows must be zero on ranks other than 0")
    else:
        expected = case.piece(edited, rank, size)
        _check(bits_equal(new_piece, expected),
               "the new piece is not the engine's layout of the edited whole")


def _run_errors(rank: int, size: int) -> dict:
    """Bad input fails on every rank before any collective, and the group stays usable."""
    counts: Counter = Counter()
    group = _counting_group(counts)
    fragments = Fragments({
        "qkv": (Stacked([Part(32, units=8), Part(8, units=2), Part(8, units=2)], -1), group),
        "heads": (Shard(1, units=3), group),
        "ok": (Shard(-1), group),
    })
    with torch.inference_mode():
        try:
            fragments.whole("qkv", torch.zeros(TOKENS, 7))
        except PieceShapeError as error:
            _check("qkv" in str(error) and "(5, 7)" in str(error), str(error))
        else:
            raise AssertionError("a piece of the wrong width was accepted")
        try:
            fragments.whole("heads", torch.zeros(TOKENS, 4))
        except GroupSizeError as error:
            _check("heads" in str(error) and "3 units" in str(error), str(error))
        else:
            raise AssertionError("3 heads over an even group were accepted")
        _check(sum(counts.values()) == 0, f"collectives ran before a refusal: {dict(counts)}")
        # The group is still in step: a real gather succeeds on every rank.
        whole, _ = fragments.whole("ok", torch.full((2, 3), float(rank)))
        expected = torch.cat([torch.full((2, 3), float(r)) for r in range(size)], dim=-1)
        _check(torch.equal(whole, expected), "the group fell out of step after a refusal")
    return {"total": dict(counts)}


def _run_edges(rank: int, size: int) -> dict:
    """A step with no tokens, and a 0-d tensor, through real collectives."""
    group = Group.from_torch()
    with torch.inference_mode():
        empty = torch.zeros(0, 6)
        whole, back = Fragments({"x": (Shard(-1), group)}).whole("x", empty)
        _check(whole.shape == (0, 6 * size), f"empty whole has shape {tuple(whole.shape)}")
        _check(back() is empty, "an empty piece must come back as itself")
        scalars = group.all_gather(torch.tensor(float(rank)))
        _check(scalars.tolist() == [float(r) for r in range(size)], f"0-d gather: {scalars}")
        total, back = Fragments({"y": (Partial(), group)}).whole("y", torch.tensor(1.5))
        _check(total.item() == 1.5 * size and back().item() == 1.5, "0-d partial sum")
    return {}


def battery(rank: int, size: int, port: int) -> dict:
    """Run every case and the error checks; report per check, never stopping at the first."""
    results: dict[str, dict] = {}
    for index, case in enumerate(cases(size)):
        try:
            results[case.name] = {"ok": True, **_run_case(case, rank, size, seed=1000 + index)}
        except Exception:  # report and carry on; the test asserts per case
            results[case.name] = {"ok": False, "error": traceback.format_exc()}
    for name, check in (("errors-before-collectives", _run_errors), ("edges", _run_edges)):
        try:
            results[name] = {"ok": True, **check(rank, size)}
        except Exception:  # report and carry on; the test asserts per check
            results[name] = {"ok": False, "error": traceback.format_exc()}
    return results
