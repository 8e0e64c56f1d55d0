"""The runtime's parts without an engine: a step plan over a `StepLayout`, ops served on a
plain tensor standing for the engine's slab, alone and together, and hooks on a torch module.
The oracle is plain torch on each request's own rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parts import HIDDEN, Toy, layout_of, residual_value, scheduled, services
from vllm_runner import ops, serving
from vllm_runner.hooks import Hooks
from vllm_runner.step_plan import NOTHING_PLANNED, plan_step, sampled_rows


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
    serving.serve(value, engine_rows, plan.tokens, used)
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


def test_positions_limit_an_edit_to_the_rows_it_keeps() -> None:
    layout = layout_of([3, 3], firsts=[0, 5])
    program = [ops.Scale("layers.0.layer_output", 0.0, positions=(-1,))]  # prompt_length 6
    plan = plan_step(layout, scheduled(layout, program, prompt_length=6), locations_of)
    engine_rows = slab(6)
    serving.serve(residual_value(Toy()), engine_rows, plan.tokens, services())
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
    serving.serve(residual_value(Toy()), engine_rows, plan.tokens, used)
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
    serving.serve(residual_value(Toy()), engine_rows, plan.tokens, services())
    factor = 1.0 if reads == "copy" else 2.0  # a copy's in-place edits stay in the copy
    torch.testing.assert_close(engine_rows[:2], factor * slab(4)[:2])
    torch.testing.assert_close(engine_rows[2:], slab(4)[2:])


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
    from vllm_runner.runtime import keep_logits_finite

    logits = torch.tensor([[1.5, float("nan"), float("-inf")], [float("inf"), -2.0, 0.25]])
    keep_logits_finite(logits)
    top = torch.finfo(torch.float32).max
    assert torch.equal(logits, torch.tensor([[1.5, 0.0, float("-inf")], [top, -2.0, 0.25]]))
