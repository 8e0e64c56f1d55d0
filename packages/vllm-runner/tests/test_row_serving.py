"""The runtime's parts without an engine: a step plan over a `StepLayout`, ops served on a
plain tensor standing for the engine's slab, alone and together, and hooks on a torch module.
The oracle is plain torch on each request's own rows."""

from __future__ import annotations

from itertools import pairwise
from unittest import mock

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from parts import (
    HIDDEN,
    Toy,
    layout_of,
    residual_value,
    scheduled,
    served_through,
    services,
)
from vllm_runner import ops
from vllm_runner.ops.checks import (
    finite_on_the_host,
    non_finite_counts,
    non_finite_counts_on_device,
)
from vllm_runner.runtime import row_serving
from vllm_runner.runtime.hooks import Hooks
from vllm_runner.runtime.step_plan import NOTHING_PLANNED, plan_step, sampled_rows
from vllm_runner.saves.store import SaveStore


def locations_of(op: ops.Op) -> list[str]:
    return list(op.patterns())


def slab(total: int) -> torch.Tensor:
    return torch.arange(total * HIDDEN, dtype=torch.float32).reshape(total, HIDDEN)


def test_a_plan_groups_requests_running_one_program_per_op() -> None:
    layout = layout_of([3, 1, 2])
    program = [ops.Save("layers.0.layer_output"), ops.Scale("layers.0.layer_output", 2.0)]
    plan = plan_step(layout, scheduled(layout, program), locations_of)
    groups = plan.tokens.wants["layers.0.layer_output"]
    assert [len(group) for group in groups] == [3, 3]  # one group per op, every request in each
    assert [type(group[0].op) for group in groups] == [ops.Save, ops.Scale]  # in program order
    assert [want.span for want in groups[0]] == [layout[key] for key in layout.keys]
    assert plan.locations() == ["layers.0.layer_output"]
    assert plan_step(layout, [], locations_of) is NOTHING_PLANNED


def test_a_digest_that_does_not_match_its_ops_breaks_no_one_elses_plan() -> None:
    """The digest travels with a request's ops: one whose ops differ in number from another's
    under the same digest gets groups of its own, and every request is planned."""
    layout = layout_of([2, 1, 1])
    one = [ops.Save("layers.0.layer_output")]
    two = [ops.Save("layers.0.layer_output"), ops.Scale("layers.0.layer_output", 2.0)]
    requests = [*scheduled(layout, one)[:2], *scheduled(layout, two)[2:]]
    groups = plan_step(layout, requests, locations_of).tokens.wants["layers.0.layer_output"]
    assert [[want.request_id for want in group] for group in groups] == [
        ["r0", "r1"], ["r2"], ["r2"]]
    assert [type(group[0].op) for group in groups] == [ops.Save, ops.Save, ops.Scale]
    # and at the sampled rows: the first op of each reads the logits here
    one, two = [ops.Save("logits")], [ops.Save("logits"), ops.Save("layers.0.layer_output")]
    requests = [*scheduled(layout, one, prompt_length=1)[:2],
                *scheduled(layout, two, prompt_length=1)[2:]]
    groups = plan_step(layout, requests, locations_of).sampled.wants["logits"]
    assert [[want.request_id for want in group] for group in groups] == [["r0", "r1"], ["r2"]]


def test_a_chunk_that_ends_before_its_prompt_waits_at_no_sampled_value() -> None:
    layout = layout_of([4, 1], firsts=[0, 9])  # r0: a first chunk of a 10-token prompt
    plan = plan_step(layout, scheduled(layout, [ops.Save("logits")], prompt_length=10),
                     locations_of)
    (group,) = plan.sampled.wants["logits"]
    assert [want.request_id for want in group] == ["r1"]
    assert sampled_rows(layout)["r0"].first_position == 3  # its last row this step


def test_a_want_is_made_only_for_the_kind_of_rows_its_op_acts_at() -> None:
    """The plan runs before every forward with programs, for every request: an op at token rows
    gets no sampled-row wants (nor is the sampled rows' layout built), and the reverse."""
    layout = layout_of([3, 1])
    plan = plan_step(layout, scheduled(layout, [ops.Save("layers.0.layer_output")]),
                     locations_of)
    assert not plan.sampled.wants and len(plan.sampled.layout) == 0
    both = [ops.Save("logits"), ops.Save("layers.0.layer_output")]
    plan = plan_step(layout, scheduled(layout, both, prompt_length=1), locations_of)
    (logits,) = plan.sampled.wants["logits"]
    (layer,) = plan.tokens.wants["layers.0.layer_output"]
    assert [type(want.op) for want in (*logits, *layer)] == [ops.Save] * 4
    assert {want.op.location for want in logits} == {"logits"}
    assert {want.op.location for want in layer} == {"layers.0.layer_output"}
    assert [want.span for want in logits] == [plan.sampled.layout[key] for key in layout.keys]
    mid_prompt = plan_step(layout, scheduled(layout, both, prompt_length=100), locations_of)
    assert not mid_prompt.sampled.wants  # no request sampled: the sampler gets no hook
    assert mid_prompt.locations() == ["layers.0.layer_output"]


def test_skip_waits_at_the_layer_input_and_output() -> None:
    layout = layout_of([2])
    plan = plan_step(layout, scheduled(layout, [ops.Skip(1)]), locations_of)
    assert plan.locations() == ["layers.1.layer_input", "layers.1.layer_output"]


@settings(deadline=None, max_examples=40)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=8), st.data())
def test_requests_served_together_get_what_each_would_alone(counts, data) -> None:
    """The same Add on a group of requests (together: one edit per run of rows) equals the
    Add on each request's own rows; requests outside the group are untouched; a Save of the
    edited value keeps each request's own rows."""
    layout = layout_of(counts)
    chosen = data.draw(st.lists(st.sampled_from(list(layout.keys)), min_size=1, unique=True))
    vector = torch.tensor([1.0, -2.0, 0.5, 3.0])
    program = [ops.Add("layers.0.layer_output", vector, 2.0), ops.Save("layers.0.layer_output")]
    requests = [request for request in scheduled(layout, program)
                if request.request_id in chosen]
    plan = plan_step(layout, requests, locations_of)
    value = residual_value(Toy())
    before = slab(layout.total)
    engine_rows = before.clone()
    used = services()
    row_serving.serve(value, engine_rows, plan.tokens, used)
    expected = before.clone()
    for key in chosen:
        span = layout[key]
        expected[span.start:span.stop] += 2.0 * vector
    torch.testing.assert_close(engine_rows, expected, rtol=0, atol=0)
    collected = used.store.collect([(f"p-{key}", 1000, {"layers.0.layer_output": None})
                                    for key in chosen])
    for key in chosen:
        span = layout[key]
        torch.testing.assert_close(collected[f"p-{key}"]["layers.0.layer_output"],
                                   expected[span.start:span.stop].unsqueeze(0))


@settings(deadline=None, max_examples=60)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 12)), min_size=2, max_size=6),
       st.lists(st.integers(-8, 14), max_size=4).map(lambda found: tuple(found) or None),
       st.sampled_from(["all", "prefill", "decode"]), st.integers(4, 9), st.data())
def test_filtered_edits_served_together_equal_each_request_served_alone(
        requests, positions, steps, prompt_length, data) -> None:
    """An `Add` with `positions` and `steps` on a group (one edit per run, the rows it does not
    keep written back as read) equals the same op served request by request (`serve_one`),
    whatever the rows, first positions and filters; and the rows both keep (`selected_rows`) are
    those the op's own `keeps(prompt_length)` keeps, position by position (what collection and
    the graph taps use)."""
    layout = layout_of([count for count, _ in requests], [first for _, first in requests])
    chosen = data.draw(st.lists(st.sampled_from(list(layout.keys)), min_size=2, unique=True))
    op = ops.Add("layers.0.layer_output", torch.tensor([1.0, -2.0, 0.5, 3.0]),
                 positions=positions, steps=steps)
    wanted = [request._replace(prompt_length=prompt_length + index) for index, request in
              enumerate(scheduled(layout, [op])) if request.request_id in chosen]
    plan = plan_step(layout, wanted, locations_of)
    together, alone = slab(layout.total), slab(layout.total)
    value = residual_value(Toy())
    # together, not one by one
    assert served_through("_edit_together", value, together, plan.tokens, services()) == [True]
    (group,) = plan.tokens.wants["layers.0.layer_output"]
    for want in group:
        row_serving.serve_one(want, value, alone, layout, 1, services())
    torch.testing.assert_close(together, alone, rtol=0, atol=0)
    for want in group:
        positions = want.span.positions()
        length = want.step.prompt_length
        keep = op.position_filter(length)
        assert keep is not None or not op.filtered
        expected = [keep is None or keep(position) for position in positions.tolist()]
        assert op.selected_rows(positions, torch.full_like(positions, length)).tolist() == expected


@settings(deadline=None, max_examples=60)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 12)), min_size=2, max_size=6),
       st.lists(st.integers(-8, 14), max_size=3).map(lambda found: tuple(found) or None),
       st.sampled_from(["all", "prefill", "decode"]), st.integers(4, 9), st.booleans(),
       st.data())
def test_an_edit_not_finite_on_some_requests_rows_fails_them_alone_served_together_or_not(
        requests, positions, steps, prompt_length, as_on_a_gpu, data) -> None:
    """A `Scale` that overflows to infinity on the slab's larger values (with `positions` and
    `steps` filters) on a group: the requests whose kept rows overflow fail with the usual
    error and keep their rows as they were, the others are edited — served together
    (`_edit_together`: each member's edit counted and written where its count allows, the
    counts read afterwards) as served one by one, on the host and with the counts made as on a
    GPU (`non_finite_counts_on_device`). No infinity is ever written."""
    layout = layout_of([count for count, _ in requests], [first for _, first in requests])
    chosen = data.draw(st.lists(st.sampled_from(list(layout.keys)), min_size=2, unique=True))
    op = ops.Scale("layers.0.layer_output", 1e37, positions=positions, steps=steps)
    wanted = [request._replace(prompt_length=prompt_length + index) for index, request in
              enumerate(scheduled(layout, [op])) if request.request_id in chosen]
    plan = plan_step(layout, wanted, locations_of)
    value = residual_value(Toy())
    (group,) = plan.tokens.wants["layers.0.layer_output"]
    results = []
    with mock.patch.object(row_serving, "non_finite_counts",
                           non_finite_counts_on_device if as_on_a_gpu else non_finite_counts), \
            mock.patch.object(row_serving, "finite_on_the_host",
                              (lambda edits: False) if as_on_a_gpu else finite_on_the_host):
        for together in (True, False):
            engine_rows, used = slab(layout.total), services()
            if together:
                assert served_through("_edit_together", value, engine_rows, plan.tokens,
                                      used) == [True]
            else:
                for want in group:
                    row_serving.serve_one(want, value, engine_rows, layout, 1, used)
            results.append((engine_rows, {want.request_id: used.store.error(want.program_id)
                                          for want in group}))
    (together_rows, together_errors), (alone_rows, alone_errors) = results
    torch.testing.assert_close(together_rows, alone_rows, rtol=0, atol=0)
    assert torch.isfinite(together_rows).all()
    assert together_errors == alone_errors
    expected = slab(layout.total)  # by hand: each request's kept rows scaled, unless one overflows
    for want in group:
        span, length = want.span, want.step.prompt_length
        rows = expected[span.start:span.stop]
        keep = op.selected_rows(span.positions(), torch.full((len(span),), length)).view(-1, 1)
        scaled = torch.where(keep, rows * 1e37, rows)
        refused = not bool(torch.isfinite(scaled).all())
        assert (together_errors[want.request_id] is not None) is refused
        if refused:
            assert "non-finite" in (together_errors[want.request_id] or "")
        else:
            expected[span.start:span.stop] = scaled
    torch.testing.assert_close(together_rows, expected, rtol=0, atol=0)


def test_positions_limit_an_edit_to_the_rows_it_keeps() -> None:
    layout = layout_of([3, 3], firsts=[0, 5])
    program = [ops.Scale("layers.0.layer_output", 0.0, positions=(-1,))]  # prompt_length 6
    plan = plan_step(layout, scheduled(layout, program, prompt_length=6), locations_of)
    engine_rows = slab(6)
    row_serving.serve(residual_value(Toy()), engine_rows, plan.tokens, services())
    zeroed = [row for row in range(6) if not engine_rows[row].any()]
    assert zeroed == [3]  # r1's first row holds position 5, the prompt's last


def test_a_failing_request_fails_alone() -> None:
    """A vector that fits no request's rows fails each request that runs it, with the op and
    the location in its error; a request running another program is still served."""
    layout = layout_of([2, 2])
    bad = scheduled(layout, [ops.Add("layers.0.layer_output", torch.ones(7))], digest="bad")
    good = scheduled(layout, [ops.Scale("layers.0.layer_output", 2.0)], digest="good")
    plan = plan_step(layout, [bad[0], good[1]], locations_of)
    engine_rows, used = slab(4), services()
    row_serving.serve(residual_value(Toy()), engine_rows, plan.tokens, used)
    assert used.store.failed("p-r0") and not used.store.failed("p-r1")
    assert (used.store.error("p-r0") or "").startswith("add at layers.0.layer_output: ValueError")
    torch.testing.assert_close(engine_rows[:2], slab(4)[:2])  # nothing written for r0
    torch.testing.assert_close(engine_rows[2:], 2 * slab(4)[2:])


@pytest.mark.parametrize("reads", ["lease", "copy", "view"])
def test_a_call_writes_back_what_its_read_mode_says(reads) -> None:
    layout = layout_of([2, 2])

    def double_in_place(value, context):
        value.mul_(2)

    plan = plan_step(layout, scheduled(layout, [ops.Call("layers.0.layer_output",
                                                         double_in_place, reads)])[:1],
                     locations_of)
    engine_rows = slab(4)
    row_serving.serve(residual_value(Toy()), engine_rows, plan.tokens, services())
    factor = 1.0 if reads == "copy" else 2.0  # a copy's in-place edits stay in the copy
    torch.testing.assert_close(engine_rows[:2], factor * slab(4)[:2])
    torch.testing.assert_close(engine_rows[2:], slab(4)[2:])


class RowwiseCalls:
    """A rowwise `Call`'s function that doubles its rows, notes the rows and positions of each
    call, and leaves NaN in any row it is given at position `poisoned` (as a bad input would)."""

    def __init__(self, poisoned: int | None = None, raises: bool = False,
                 returns: bool = False) -> None:
        self.poisoned, self.raises, self.returns = poisoned, raises, returns
        self.calls: list[tuple[int, list[int], int | None]] = []
        self.prompt_lengths: list[list[int]] = []

    def __call__(self, value: torch.Tensor, context: ops.CallContext) -> torch.Tensor | None:
        positions = context.positions.tolist()
        self.calls.append((value.shape[1], positions, context.prompt_length))
        self.prompt_lengths.append(context.prompt_lengths.tolist())
        if self.raises and len(positions) > 2:
            raise RuntimeError("fails on more than two rows")
        edited = value * 2 if self.returns else value.mul_(2)
        if self.poisoned in positions:
            edited[0, positions.index(self.poisoned)] = float("nan")
        return edited if self.returns else None


@settings(deadline=None, max_examples=40)
@given(st.lists(st.integers(1, 5), min_size=2, max_size=7), st.data())
def test_a_rowwise_call_runs_once_for_its_group_and_equals_each_alone(counts, data) -> None:
    """A rowwise `Call` on a group of requests (any of them, so their rows may be several runs)
    is one call a step, given every member's rows in slab order with their own positions;
    what it writes equals the call on each request's rows alone, and nothing else moves."""
    layout = layout_of(counts, firsts=data.draw(st.lists(st.integers(0, 50), min_size=len(counts),
                                                          max_size=len(counts))))
    chosen = data.draw(st.lists(st.sampled_from(list(layout.keys)), min_size=2, unique=True))
    returns = data.draw(st.booleans())
    function = RowwiseCalls(returns=returns)
    requests = [request._replace(prompt_length=60 + index) for index, request in
                enumerate(scheduled(layout, [ops.Call("layers.0.layer_output", function,
                                                      rowwise=True)]))
                if request.request_id in chosen]
    plan = plan_step(layout, requests, locations_of)
    engine_rows = slab(layout.total)
    row_serving.serve(residual_value(Toy()), engine_rows, plan.tokens, services())
    expected, positions, prompt_lengths = slab(layout.total), [], []
    for index, key in enumerate(layout.keys):  # slab order
        span = layout[key]
        if key in chosen:
            expected[span.start:span.stop] *= 2
            positions += span.positions().tolist()
            prompt_lengths += [60 + index] * len(span)
    torch.testing.assert_close(engine_rows, expected, rtol=0, atol=0)
    assert function.calls == [(len(positions), positions, None)]
    assert function.prompt_lengths == [prompt_lengths]


def test_a_group_acting_at_every_layer_serves_each_location_with_its_own_rows() -> None:
    """One op at two layers is one group visiting two locations in a step (its rows selected
    at the first visit and kept): a rowwise `Call` and an `Add` edit the group's rows at each,
    and rows of requests outside the group stay as they were."""
    layout = layout_of([2, 3, 1, 2])
    both_layers = ["layers.0.layer_output", "layers.1.layer_output"]
    function = RowwiseCalls()
    program = [ops.Call("layers.*.layer_output", function, rowwise=True),
               ops.Add("layers.*.layer_output", torch.ones(HIDDEN))]
    requests = [request for request in scheduled(layout, program) if request.request_id != "r1"]
    plan = plan_step(layout, requests, lambda op: both_layers)
    expected = slab(layout.total)
    kept = [row for key in ("r0", "r2", "r3")
            for row in range(layout[key].start, layout[key].stop)]
    for location in both_layers:
        engine_rows = slab(layout.total)
        row_serving.serve(residual_value(Toy(), location.rsplit(".", 1)[0]), engine_rows,
                      plan.tokens, services())
        want = expected.clone()
        want[kept] = 2 * expected[kept] + 1
        torch.testing.assert_close(engine_rows, want, rtol=0, atol=0)
    assert [rows for rows, _, _ in function.calls] == [len(kept)] * 2


@pytest.mark.parametrize("failure", ["nan", "raises"])
def test_a_rowwise_call_that_fails_on_the_group_fails_only_its_culprit(failure) -> None:
    """A NaN left in one request's rows fails that request alone, with nothing written for it
    (each request's rows are checked on their own, on the device); a call that raises on the
    group falls back to one call per request. The others are edited either way."""
    layout = layout_of([2, 2, 2], firsts=[0, 10, 20])
    function = RowwiseCalls(poisoned=11 if failure == "nan" else None,
                            raises=failure == "raises")
    plan = plan_step(layout, scheduled(layout, [ops.Call("layers.0.layer_output", function,
                                                         rowwise=True)]), locations_of)
    engine_rows, used = slab(6), services()
    row_serving.serve(residual_value(Toy()), engine_rows, plan.tokens, used)
    # together, then alone where the group's call raised
    assert [rows for rows, _, _ in function.calls] == ([6] if failure == "nan" else [6, 2, 2, 2])
    if failure == "nan":
        assert [used.store.failed(f"p-r{i}") for i in range(3)] == [False, True, False]
        assert "NaN" in (used.store.error("p-r1") or "")
        torch.testing.assert_close(engine_rows[2:4], slab(6)[2:4])  # nothing written for r1
        edited = [0, 1, 4, 5]
    else:
        assert not any(used.store.failed(f"p-r{i}") for i in range(3))
        edited = list(range(6))
    torch.testing.assert_close(engine_rows[edited], 2 * slab(6)[edited])


def test_a_rowwise_call_with_nan_in_a_later_run_of_rows_refuses_that_request_alone() -> None:
    """Members r0 and r3 of four adjacent requests: their rows are two runs (a gap between);
    NaN in r3's rows fails r3 alone, its rows and the gap's left as they were, r0 edited."""
    layout = layout_of([2, 2, 2, 2], firsts=[0, 10, 20, 30])
    function = RowwiseCalls(poisoned=31)
    requests = [request for request in scheduled(layout, [ops.Call(
        "layers.0.layer_output", function, rowwise=True)]) if request.request_id in ("r0", "r3")]
    plan = plan_step(layout, requests, locations_of)
    engine_rows, used = slab(8), services()
    row_serving.serve(residual_value(Toy()), engine_rows, plan.tokens, used)
    assert [rows for rows, _, _ in function.calls] == [4]
    assert [used.store.failed(f"p-r{i}") for i in (0, 3)] == [False, True]
    assert "NaN" in (used.store.error("p-r3") or "")
    torch.testing.assert_close(engine_rows[:2], 2 * slab(8)[:2], rtol=0, atol=0)
    torch.testing.assert_close(engine_rows[2:], slab(8)[2:], rtol=0, atol=0)


def test_a_rowwise_call_is_one_object_for_every_request_running_its_program() -> None:
    """Programs share their decoded ops by digest when every `Call` in them is rowwise (one
    function for the group); a plain `Call` is unpickled per request, as it may keep state."""
    from vllm_runner.ops.program import ProgramCache, encode, encode_ops, program_digest

    cache = ProgramCache()
    for rowwise in (True, False):
        data = encode_ops([ops.Call("layers.0.layer_output", _double, rowwise=rowwise)])
        first, second = (cache.get(encode(f"{rowwise}-{i}", data, program_digest(data)))
                         for i in range(2))
        assert (first.ops[0] is second.ops[0]) is rowwise
        assert first.ops[0].rowwise is rowwise


def test_the_cache_says_once_a_program_acting_on_its_prompt_only_was_decoded() -> None:
    """Until such a program is decoded, every program acts at every step and the adapters ask
    none of them per request (`Runtime.every_program_acts`); after, they ask (it never goes
    back: a wrong `True` would skip a step some program acts at)."""
    from vllm_runner.ops.program import ProgramCache, encode, encode_ops, program_digest

    cache = ProgramCache()
    for number, op in enumerate([ops.Save("layers.0.layer_output"), ops.Add(
            "layers.0.layer_output", torch.ones(4), steps="decode")]):
        data = encode_ops([op])
        cache.get(encode(f"every-{number}", data, program_digest(data)))
    assert not cache.seen_prompt_only
    data = encode_ops([ops.Save("layers.0.layer_output", positions=(-1,))])
    assert cache.get(encode("last", data, program_digest(data))).prompt_only
    assert cache.seen_prompt_only
    data = encode_ops([ops.Save("layers.0.layer_output")])
    cache.get(encode("every-again", data, program_digest(data)))
    assert cache.seen_prompt_only


def _double(value: torch.Tensor, context: ops.CallContext) -> torch.Tensor:
    return value * 2


@settings(deadline=None, max_examples=30)
@given(st.lists(st.integers(1, 5), min_size=2, max_size=6), st.data())
def test_requests_running_one_lens_share_one_projection_and_each_keeps_its_own(counts,
                                                                              data) -> None:
    """A `Lens` on a group of requests projects their rows once (joined over the planned
    reads, which may span requests outside the group); each keeps the top-k of its own rows."""
    layout = layout_of(counts, firsts=[10 * i for i in range(len(counts))])
    chosen = data.draw(st.lists(st.sampled_from(list(layout.keys)), min_size=2, unique=True))
    projected: list[int] = []

    def lens(rows: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        projected.append(rows.shape[1])
        return rows[0, :, :top_k] * 0.5, rows[0, :, :top_k].long()

    requests = [request for request in scheduled(layout, [ops.Lens("layers.0.layer_output", 2)])
                if request.request_id in chosen]
    plan = plan_step(layout, requests, locations_of)
    used = row_serving.Services(SaveStore(), lens)
    row_serving.serve(residual_value(Toy()), slab(layout.total), plan.tokens, used)
    assert len(projected) == 1
    names = ("layers.0.layer_output.lens_tokens", "layers.0.layer_output.lens_probs")
    found = used.store.collect([(f"p-{key}", 1000, dict.fromkeys(names)) for key in chosen])
    for key in chosen:
        rows = slab(layout.total)[layout[key].rows, :2].unsqueeze(0)
        torch.testing.assert_close(found[f"p-{key}"][names[0]], rows.long())
        torch.testing.assert_close(found[f"p-{key}"][names[1]], rows * 0.5)


def test_rowwise_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="rowwise must be True or False, not 'yes'"):
        ops.Call("layers.0.layer_output", _double, rowwise="yes")  # type: ignore[arg-type]


def test_hooks_are_installed_for_wanted_locations_only_and_see_the_output() -> None:
    module = Toy()
    value = residual_value(module)
    seen: list[tuple[str, torch.Tensor]] = []
    hooks = Hooks({value.location: value}, lambda location, _, raw: seen.append((location, raw)))
    hooks.sync([value.location])
    module(torch.zeros(2, HIDDEN))
    hooks.sync([])
    module(torch.zeros(2, HIDDEN))
    assert len(hooks) == 0 and len(seen) == 1
    location, raw = seen[0]
    assert location == "layers.0.layer_output" and torch.equal(raw, torch.ones(2, HIDDEN))


def test_the_sampler_gets_finite_logits_after_a_step_with_edits() -> None:
    """NaN and +inf (an edit overflowed a later layer) become finite; -inf (a banned token) and
    every finite logit stay as they are."""
    from vllm_runner.runtime.runtime import keep_logits_finite

    logits = torch.tensor([[1.5, float("nan"), float("-inf")], [float("inf"), -2.0, 0.25]])
    keep_logits_finite(logits)
    top = torch.finfo(torch.float32).max
    assert torch.equal(logits, torch.tensor([[1.5, 0.0, float("-inf")], [top, -2.0, 0.25]]))


@settings(deadline=None, max_examples=200)
@given(st.lists(st.tuples(st.one_of(st.none(), st.lists(st.integers(-6, 14), max_size=3).map(
           tuple)), st.sampled_from(["all", "prefill", "decode"])), min_size=1, max_size=3),
       st.integers(1, 8), st.integers(0, 14), st.integers(1, 4))
def test_a_request_is_left_out_of_a_step_only_where_none_of_its_ops_keeps_a_row(
        filters, prompt_length, first, count) -> None:
    """`step_plan.acting` leaves a request out of a step (no hook, no eager forward, the full
    graph) only where no op of its program would keep any row of the step — checked against
    each op's own `keeps` — and does leave out every step past the prompt of a program whose
    ops all act on the prompt only."""
    from vllm_runner.ops.program import Program
    from vllm_runner.ops.wants import ScheduledRequest
    from vllm_runner.runtime.step_plan import acting

    program = Program("p", "d", tuple(ops.Save("layers.0.layer_output", positions=positions,
                                               steps=steps) for positions, steps in filters))
    layout = layout_of([count], [first])
    kept = acting(layout, [ScheduledRequest("r0", program, prompt_length)])
    keeps_a_row = any(keep is None or any(keep(position) for position in
                                          range(first, first + count))
                      for keep in (op.position_filter(prompt_length) for op in program.ops))
    if not kept:
        assert not keeps_a_row
    prompt_only = all(steps == "prefill" or (positions is not None and all(
        position < 0 for position in positions)) for positions, steps in filters)
    assert (not kept) == (prompt_only and first >= prompt_length)
    requests = [ScheduledRequest("r0", program, prompt_length)]
    assert (acting(layout, requests) is requests) == bool(kept)  # a repeated schedule's list


@settings(deadline=None, max_examples=300)
@given(st.one_of(st.none(), st.lists(st.integers(-9, 30), max_size=4).map(tuple)),
       st.sampled_from(["all", "prefill", "decode"]), st.integers(1, 12), st.integers(0, 25),
       st.integers(1, 9))
def test_the_runs_an_op_keeps_are_the_rows_its_keeps_keeps(positions, steps, prompt_length,
                                                           first, count) -> None:
    """`RowOp.selected_runs`, worked out from `positions` and `steps`, against the op's own
    `keeps` asked row by row: the same rows, as maximal runs in order."""
    op = ops.Save("layers.0.layer_output", positions=positions, steps=steps)
    keep = op.position_filter(prompt_length)
    rows = [row for row in range(count) if keep is None or keep(first + row)]
    runs = op.selected_runs(first, count, prompt_length)
    assert [row for start, stop in runs for row in range(start, stop)] == rows
    assert all(stop > start for start, stop in runs)
    assert all(before[1] < after[0] for before, after in pairwise(runs))


@pytest.mark.parametrize("stream", [False, True])
def test_a_save_with_positions_keeps_only_the_rows_it_names(stream) -> None:
    """`Save(positions=(-1, -3))` over a prompt's chunk keeps two one-row copies, not the
    chunk (a probe of the prompt's last token kept every prompt row at every layer until its
    collection); what is collected is the same rows."""
    from parts import stream_value

    layout = layout_of([5, 4], firsts=[0, 0])
    program = [ops.Save("layers.0.layer_output", positions=(-1, -3))]
    plan = plan_step(layout, scheduled(layout, program, prompt_length=5), locations_of)
    rows = slab(layout.total)
    raw = (rows, torch.ones_like(rows)) if stream else rows
    value = (stream_value if stream else residual_value)(Toy())
    used = services()
    kept = []
    save_rows = used.store.save_rows
    used.store.save_rows = lambda location, axis, owners, values: kept.extend(  # type: ignore[method-assign]
        (owner, tuple(piece.shape)) for owner, piece in zip(owners, values, strict=True)
    ) or save_rows(location, axis, owners, values)
    row_serving.serve(value, raw, plan.tokens, used)
    # r0 positions 2 and 4; r1 (4 of 5 rows) position 2: one gather, three one-row pieces
    assert kept == [(("p-r0", 2), (1, 1, HIDDEN)), (("p-r0", 4), (1, 1, HIDDEN)),
                    (("p-r1", 2), (1, 1, HIDDEN))]
    whole = rows + 1 if stream else rows
    keep = program[0].position_filter(5)
    collected = used.store.collect([("p-r0", 5, {"layers.0.layer_output": keep}),
                                    ("p-r1", 4, {"layers.0.layer_output": keep})])
    torch.testing.assert_close(collected["p-r0"]["layers.0.layer_output"],
                               whole[[2, 4]].unsqueeze(0))
    torch.testing.assert_close(collected["p-r1"]["layers.0.layer_output"],
                               whole[[7]].unsqueeze(0))


def fake_lens(rows: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A lens whose results are a function of each row alone (as the model's is): its first
    `top_k` values halved, and as integers."""
    return rows[0, :, :top_k] * 0.5, rows[0, :, :top_k].long()


class SavesSeen(SaveStore):
    """A store that also lists what it was given: (name, device, rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.device, int]] = []

    def save(self, program_id: str, location: str, first_position: int, value: torch.Tensor,
             token_axis: int | None, fill: float | None = None,
             width_is_position: bool = True) -> None:
        self.seen.append((location, value.device, value.shape[1]))
        super().save(program_id, location, first_position, value, token_axis, fill,
                     width_is_position)


def test_a_lens_that_keeps_no_row_saves_its_empty_results_once_where_the_engines_rows_are(
        ) -> None:
    """A prompt's first chunk does not reach `positions=(-1,)`: its lens keeps one empty piece
    of each result, made on the engine's device (a later chunk's row, computed there, is joined
    to it: a CPU piece beside a GPU row failed the request's collection), and no more at later
    steps that keep none."""
    layout = layout_of([3], firsts=[0])
    op = ops.Lens("layers.0.layer_output", 2, positions=(-1,))
    wanted = scheduled(layout, [op], prompt_length=10)
    (group,) = plan_step(layout, wanted, locations_of).tokens.wants["layers.0.layer_output"]
    store = SavesSeen()
    used = row_serving.Services(store, fake_lens)
    for _ in range(2):
        row_serving.serve_one(group[0], residual_value(Toy()), slab(layout.total).to("meta"),
                              layout, 1, used)
    assert not store.any_failed
    names = op.saved_names("layers.0.layer_output")
    assert store.seen == [(name, torch.device("meta"), 0) for name in names]


@settings(deadline=None, max_examples=80)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 12)), min_size=2, max_size=6),
       st.lists(st.integers(-8, 14), max_size=4).map(tuple),
       st.sampled_from(["all", "prefill", "decode"]), st.integers(4, 9), st.booleans(),
       st.sampled_from(["save", "lens"]), st.data())
def test_filtered_saves_and_lenses_served_together_equal_each_request_served_alone(
        requests, positions, steps, prompt_length, stream, kind, data) -> None:
    """A `Save` or a `Lens` with `positions` and `steps` on a group (one gather of the rows its
    members keep; one projection for the lens) collects what the same op served request by
    request (`serve_one`) does, whatever the rows, first positions and filters, on a plain
    value and on the stream's two halves; a member that keeps no row still gets its names back
    (empty)."""
    from parts import stream_value

    layout = layout_of([count for count, _ in requests], [first for _, first in requests])
    chosen = data.draw(st.lists(st.sampled_from(list(layout.keys)), min_size=2, unique=True))
    filters = {"positions": positions or None, "steps": steps}
    op = (ops.Save("layers.0.layer_output", **filters) if kind == "save"
          else ops.Lens("layers.0.layer_output", 2, **filters))
    assume(op.filtered)  # an unfiltered one is served together another way
    wanted = [request._replace(prompt_length=prompt_length + index) for index, request in
              enumerate(scheduled(layout, [op])) if request.request_id in chosen]
    plan = plan_step(layout, wanted, locations_of)
    rows = slab(layout.total)
    raw = (rows, rows / 3) if stream else rows
    value = (stream_value if stream else residual_value)(Toy())
    together, alone = (row_serving.Services(SaveStore(), fake_lens) for _ in range(2))
    way = "_save_selected_together" if kind == "save" else "_results_selected_together"
    assert served_through(way, value, raw, plan.tokens, together) == [True]
    (group,) = plan.tokens.wants["layers.0.layer_output"]
    for want in group:
        row_serving.serve_one(want, value, raw, layout, 1, alone)
    names = op.saved_names("layers.0.layer_output")
    collect = [(f"p-{want.request_id}", 100, dict.fromkeys(
        names, op.position_filter(want.step.prompt_length))) for want in group]
    mine, theirs = together.store.collect(collect), alone.store.collect(collect)
    assert mine.keys() == theirs.keys()
    for program in mine:
        assert mine[program].keys() == theirs[program].keys() == set(names)
        for name in names:
            torch.testing.assert_close(mine[program][name], theirs[program][name],
                                       rtol=0, atol=0)
