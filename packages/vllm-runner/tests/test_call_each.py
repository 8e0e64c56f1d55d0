"""Plain `Call`s of a group served between one read and one write (`row_serving._call_each`): each
request's function, its errors and what lands in the engine's rows must be exactly what serving
each request alone (`serve_one`, the path every engine-level test checks against transformers)
gives — whatever each function does."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from parts import (
    HIDDEN,
    Toy,
    layout_of,
    residual_value,
    served_through,
    services,
    stream_value,
)
from vllm_runner import ops
from vllm_runner.ops.checks import (
    non_finite_counts,
    non_finite_counts_on_device,
    non_finite_each,
)
from vllm_runner.ops.program import Program
from vllm_runner.ops.wants import ScheduledRequest
from vllm_runner.runtime import row_serving
from vllm_runner.runtime.step_plan import plan_step
from vllm_runner.saves.store import SaveStore

#: What one request's function does with the rows it is lent.
BEHAVIOURS = ("in place", "returns", "untouched", "raises", "nan", "wrong shape", "float64",
              "huge")


class Function:
    """One request's function: notes what it was given, then acts as `behaviour` says."""

    def __init__(self, behaviour: str, seen: list[tuple[Any, ...]]) -> None:
        self.behaviour, self.seen = behaviour, seen

    def __call__(self, value: torch.Tensor, context: ops.CallContext) -> Any:
        self.seen.append((context.location, context.positions.tolist(), context.prompt_length,
                          value.clone()))
        behaviour = self.behaviour
        if behaviour == "in place":
            value.mul_(2)
            return None
        if behaviour == "returns":
            return value * 3 + 1
        if behaviour == "untouched":
            return None
        if behaviour == "raises":
            raise RuntimeError("this request's function fails")
        if behaviour == "nan":
            edited = value * 2
            edited[0, -1, 0] = float("nan")
            return edited
        if behaviour == "wrong shape":
            return value[:, :, :1]
        if behaviour == "float64":
            return value.double() * 5
        return value * 1e36  # finite values whose float32 sum overflows


def served(counts: list[int], firsts: list[int], chosen: list[str],
           behaviours: dict[str, str], reads: str, stream: bool, alone: bool
           ) -> tuple[Any, dict[str, str | None], list[tuple[Any, ...]]]:
    """The engine's rows after one visit of `chosen` requests' calls (all of them one program,
    each with its own function), the requests' errors and what each function was given."""
    layout = layout_of(counts, firsts)
    seen: list[tuple[Any, ...]] = []
    requests = [ScheduledRequest(key, Program(f"p-{key}", "same", (ops.Call(
        "layers.0.layer_output", Function(behaviours[key], seen), reads),)), 40 + index)
        for index, key in enumerate(layout.keys) if key in chosen]
    plan = plan_step(layout, requests, lambda op: ["layers.0.layer_output"])
    rows = torch.arange(layout.total * HIDDEN, dtype=torch.float32).reshape(layout.total, HIDDEN)
    raw: Any = (rows, torch.full_like(rows, 0.5) - rows / 7) if stream else rows
    value = (stream_value if stream else residual_value)(Toy())
    used = services()
    if alone:
        for group in plan.tokens.wants["layers.0.layer_output"]:
            for want in group:
                row_serving.serve_one(want, value, raw, layout, 1, used)
    else:
        together = served_through("_call_each", value, raw, plan.tokens, used)
        assert together == ([True] if len(chosen) > 1 else [])
    errors = {key: used.store.error(f"p-{key}") for key in chosen}
    return raw, errors, seen


@settings(deadline=None, max_examples=80)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 30)), min_size=2, max_size=7),
       st.sampled_from(["lease", "copy"]), st.booleans(), st.booleans(), st.data())
@example([(2, 0), (1, 5), (3, 9)], "lease", True, True, None)
def test_plain_calls_of_a_group_equal_each_request_served_alone(requests, reads, stream,
                                                                as_on_a_gpu, data) -> None:
    """Every behaviour of a function, mixed in one step over adjacent and separate rows, in both
    copying read modes, on a plain value and on the stream's two halves (where an untouched
    request's rows must not be rewritten): the engine's rows equal bit for bit, each request
    fails alone with the same error, and each function was given the same rows and context —
    also with the results checked as on a GPU (`non_finite_counts_on_device`: every request's
    rows written where its count allows, the counts read afterwards). No NaN is ever written."""
    with mock.patch.object(row_serving, "non_finite_counts",
                           non_finite_counts_on_device if as_on_a_gpu else non_finite_counts):
        _group_equals_each_alone(requests, reads, stream, data)


def _group_equals_each_alone(requests, reads, stream, data) -> None:
    counts, firsts = [count for count, _ in requests], [first for _, first in requests]
    keys = [f"r{index}" for index in range(len(requests))]
    if data is None:  # the explicit example: every request untouched but one, between them
        chosen, behaviours = keys, {"r0": "untouched", "r1": "in place", "r2": "untouched"}
    else:
        chosen = data.draw(st.lists(st.sampled_from(keys), min_size=2, unique=True))
        behaviours = {key: data.draw(st.sampled_from(BEHAVIOURS)) for key in keys}
    together = served(counts, firsts, chosen, behaviours, reads, stream, alone=False)
    alone = served(counts, firsts, chosen, behaviours, reads, stream, alone=True)
    for mine, theirs in zip(*(result[0] if stream else (result[0],)
                              for result in (together, alone)), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)
        assert torch.isfinite(mine).all()  # a refused result is never written
    assert together[1] == alone[1]
    for key in chosen:
        error = together[1][key]
        assert (error is not None) is (behaviours[key] in ("raises", "nan", "wrong shape"))
        if behaviours[key] == "raises":  # the user's own line, not ours
            assert "this request's function fails" in error and __file__ in error
        elif error is not None:  # a refused result: the error names what is wrong, no traceback
            assert "vllm_runner" not in error, error
    by_request = [sorted(result[2], key=lambda seen: seen[2]) for result in (together, alone)]
    assert len(by_request[0]) == len(by_request[1]) == len(chosen)
    for mine, theirs in zip(*by_request, strict=True):  # one call each, sorted by prompt length
        assert mine[:3] == theirs[:3]
        assert torch.equal(mine[3], theirs[3])


def test_an_untouched_request_beside_edited_ones_keeps_both_halves_of_its_stream() -> None:
    """The fused stream is written as (whole stream, zeros): a request whose function changed
    nothing must keep its two halves as they were, even between requests that were edited."""
    raw, errors, _ = served([2, 1, 2], [0, 0, 0], ["r0", "r1", "r2"],
                            {"r0": "in place", "r1": "untouched", "r2": "returns"}, "lease",
                            stream=True, alone=False)
    hidden, residual = raw
    rows = torch.arange(5 * HIDDEN, dtype=torch.float32).reshape(5, HIDDEN)
    before = rows + (torch.full_like(rows, 0.5) - rows / 7)
    assert errors == {"r0": None, "r1": None, "r2": None}
    torch.testing.assert_close(hidden[2], rows[2], rtol=0, atol=0)  # r1 untouched
    torch.testing.assert_close(residual[2], 0.5 - rows[2] / 7, rtol=0, atol=0)
    torch.testing.assert_close(hidden[:2], 2 * before[:2])
    torch.testing.assert_close(hidden[3:], 3 * before[3:] + 1)
    assert not residual[[0, 1, 3, 4]].any()


def test_a_group_of_plain_calls_never_waits_for_the_device_to_check_their_edits(
        monkeypatch) -> None:
    """Sixteen requests' edits are checked on the device without the host reading an answer
    while the group is served (it waited there once a step, in the middle of the forward);
    the answers are read once, together, when the store is next asked about a failure. (On
    the host the answer is at hand, so it is checked as a GPU checks it here.)"""
    monkeypatch.setattr(row_serving, "non_finite_counts", non_finite_counts_on_device)
    events: list[Any] = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda self: events.append((self.dtype, self.shape)) or tolist(self))
    settle = SaveStore.settle
    monkeypatch.setattr(SaveStore, "settle", lambda self: events.append("read") or settle(self))
    served([1] * 16, [9] * 16, [f"r{index}" for index in range(16)],
           {f"r{index}": "returns" for index in range(16)}, "lease", stream=True, alone=False)
    # (the functions ask for their positions: one each, on the host)
    answers = [event for event in events if event == "read" or event[1] != torch.Size([1])]
    assert answers[0] == "read" and answers[1:] == [(torch.long, torch.Size([16]))]


def test_each_private_copy_has_memory_of_its_own_and_the_pieces_values_and_layout() -> None:
    """One multi-tensor copy makes them (`row_serving.private_copies`): no copy is a view that
    could reach another request's rows through its storage, and each is laid out as `clone`
    laid it out (a slice along the tokens axis of queries is not dense: made contiguous)."""
    whole = torch.randn(2, 3, 8, 4)  # (batch heads tokens head_dim): tokens on axis 2
    pieces = list(whole.split([3, 5], 2))
    copies = row_serving.private_copies(pieces)
    for piece, copy in zip(pieces, copies, strict=True):
        assert torch.equal(copy, piece) and copy.stride() == piece.clone().stride()
        assert copy._base is None and copy.untyped_storage().nbytes() == piece.numel() * 4
    assert row_serving.private_copies([]) == []


def test_private_copies_are_made_the_same_on_a_torch_without_one_clone_for_all(
        monkeypatch) -> None:
    """`torch._foreach_clone` is recent: without it each copy is allocated apart and filled
    by one multi-tensor copy, with the same storage, values and layout."""
    pieces = list(torch.randn(2, 3, 8, 4).split([3, 5], 2))
    expected = row_serving.private_copies(pieces)
    monkeypatch.setattr(row_serving, "_CLONE_ALL", None)
    copies = row_serving.private_copies(pieces)
    for piece, copy, made in zip(pieces, copies, expected, strict=True):
        assert torch.equal(copy, made) and copy.stride() == made.stride()
        assert copy._base is None and copy.untyped_storage().nbytes() == piece.numel() * 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_edits_are_checked_for_nan_and_infinity_together_in_every_float_dtype(dtype) -> None:
    """`non_finite_each`: the count of NaN and infinite values of each edit; finite values
    whose sum overflows (float16's range ends at 65504) are finite. `non_finite_counts` and
    `non_finite_counts_on_device` count the same (along either token axis), and say which
    rows may be written (those of an edit whose count is 0), for one edit, edits of a row
    each and edits of several."""
    large = torch.full((4, 64), torch.finfo(dtype).max / 2, dtype=dtype)
    nan = torch.ones(2, 64, dtype=dtype)
    nan[1, 3] = float("nan")
    infinite = torch.zeros(1, 64, dtype=dtype)
    infinite[0, :2] = float("inf")
    edits = [large, nan, torch.zeros(0, 64, dtype=dtype), infinite]
    assert non_finite_each(edits, "x") == [0, 1, 0, 2]
    # counted without the host: what a GPU runs (and, on the host, the one sum each)
    for counted in (non_finite_counts_on_device(edits, 0), non_finite_counts(edits, 0),
                    non_finite_counts_on_device([edit.T for edit in edits], 1)):
        assert counted is not None
        counts, passed_rows = counted
        assert counts.tolist() == [0, 1, 0, 2] and passed_rows.dtype == torch.bool
        assert passed_rows.tolist() == [True] * 4 + [False] * 3
    for alone, expected in ((large, 0), (nan, 1), (infinite, 2)):  # one owner: one sum
        counts, passed_rows = non_finite_counts_on_device([alone], 0)
        assert counts.tolist() == [expected]
        assert passed_rows.tolist() == [expected == 0] * alone.shape[0]
    single_rows = [large[:1], nan[1:], infinite, nan[:1]]  # owners of a row each (decode)
    counts, passed_rows = non_finite_counts_on_device([row.T for row in single_rows], 1)
    assert counts.tolist() == [0, 1, 2, 0] and passed_rows.tolist() == [True, False, False, True]
    assert non_finite_counts([large], 0) is None  # on the host, all finite: nothing held back
    assert non_finite_counts([torch.ones(2, 3, dtype=torch.long)], 0) is None  # not floating
    # Owners other than the edits (an edit of a run of rows holds several requests' rows):
    # the rows, joined, counted for the owner of each.
    runs = [torch.cat([large[:3], nan]), infinite]  # rows: 3 large, 2 of which one NaN, 1 inf
    for counted in (non_finite_counts(runs, 0, [2, 3, 1]),
                    non_finite_counts_on_device([run.T for run in runs], 1, [2, 3, 1])):
        assert counted is not None
        counts, passed_rows = counted
        assert counts.tolist() == [0, 1, 2]
        assert passed_rows.tolist() == [True, True, False, False, False, False]
