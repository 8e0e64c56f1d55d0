"""Steps planned per program (`graph_steps`) against the general plan, engine-free: for any
layout and any mix of programs the graph serves alone, the steering index written and the rows
saved are the ones the general plan (`step_plan` with `Runtime._serve_in_graph`'s serving)
gives; a program with anything else leaves the step to the general plan."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parts import HIDDEN, Toy, layout_of, residual_value
from vllm_runner import ops
from vllm_runner.graph_steps import GraphSteps
from vllm_runner.in_graph import InGraphRows
from vllm_runner.program import Program
from vllm_runner.step_plan import ScheduledRequest, plan_step
from vllm_runner.store import SaveStore, ToCollect
from vllm_runner.tap_saves import SaveRing
from vllm_runner.tap_steering import SteerRows, steered_rows

ROWS, SLOTS = 64, 8
LOCATION = "layers.0.layer_output"
ONE, OTHER = torch.arange(HIDDEN, dtype=torch.float32), -torch.ones(HIDDEN)
#: Programs the graph serves alone, by digest (shared by the requests that run them).
PROGRAMS = {
    "steer": (ops.Add(LOCATION, ONE, scale=0.5),),
    "steer twice and save": (ops.Add(LOCATION, ONE), ops.Add(LOCATION, OTHER), ops.Save(LOCATION)),
    "save": (ops.Save(LOCATION),),
    "steer other": (ops.Add(LOCATION, OTHER),),
}


def in_graph_rows(value: Any) -> InGraphRows:
    cpu = torch.device("cpu")
    return InGraphRows(value, SteerRows(value, HIDDEN, ROWS, SLOTS, "0", cpu, torch.float32),
                       SaveRing(value, HIDDEN, ROWS, "0", cpu, torch.float32))


def planner(rows: InGraphRows, value: Any) -> GraphSteps:
    return GraphSteps({LOCATION: rows}, lambda op: list(op.patterns()), {LOCATION: value})


@st.composite
def steps(draw: Any) -> tuple[list[int], list[int], list[str | None]]:
    """A step's requests: their row counts, first positions and programs (None: none)."""
    count = draw(st.integers(1, 8))
    counts = draw(st.lists(st.integers(1, 6), min_size=count, max_size=count))
    firsts = draw(st.lists(st.integers(0, 50), min_size=count, max_size=count))
    names = draw(st.lists(st.sampled_from([None, *PROGRAMS]), min_size=count, max_size=count))
    return counts, firsts, names


@settings(deadline=None, max_examples=150)
@given(steps())
def test_a_step_planned_per_program_writes_and_saves_what_the_general_plan_does(step) -> None:
    counts, firsts, names = step
    layout = layout_of(counts, firsts)
    requests = [ScheduledRequest(key, Program(f"p-{key}", name, PROGRAMS[name]), 100)
                for key, name in zip(layout.keys, names, strict=True) if name is not None]
    found = {}
    for path in ("general", "per program"):
        value = residual_value(Toy(), "layers.0")
        rows, store = in_graph_rows(value), SaveStore()
        rows.saves.ring.copy_(torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1)))
        if path == "general":
            groups = plan_step(layout, requests, lambda op: list(op.patterns())).tokens.wants.get(
                LOCATION, [])
            rows.steer.fill(steered_rows(value, groups, store.failed, rows.steer.vectors))
            rows.saves.take(groups, store.failed, value, store)
        else:
            planned = planner(rows, value).plan(layout, requests)
            assert planned is not None
            for tap in planned:
                if tap.index is not None:
                    tap.rows.steer.write(tap.vectors, tap.index)
                tap.rows.saves.keep(tap.saving, store)
        # What each row gets added, and what each request saved (some positions only: a row
        # saved as another position's would show).
        added = rows.steer.table.index_select(0, rows.steer.index)
        saved = store.collect([ToCollect(request.program.program_id, 10_000,
                                         {LOCATION: lambda position: position % 3 != 1})
                               for request in requests])
        found[path] = (added, saved)
    (added, saved), (added_too, saved_too) = found.values()
    assert torch.equal(added, added_too)
    assert saved.keys() == saved_too.keys()
    for program_id, values in saved.items():
        assert values.keys() == saved_too[program_id].keys()
        for name, tensor in values.items():
            assert torch.equal(tensor, saved_too[program_id][name]), program_id


def test_a_program_with_other_work_leaves_the_step_to_the_general_plan() -> None:
    value = residual_value(Toy(), "layers.0")
    graph_steps = planner(in_graph_rows(value), value)
    layout = layout_of([2, 1])
    served = ScheduledRequest("r0", Program("p-r0", "steer", PROGRAMS["steer"]), 100)
    for others in ([ops.Scale(LOCATION, 2.0)],  # the taps' Python
                   [ops.Add(LOCATION, ONE, steps="decode")],  # an Add at some positions only
                   [ops.Save(LOCATION), ops.Add(LOCATION, ONE)],  # a save before the steering
                   [ops.Save("layers.1.layer_output")]):  # a location with no graph tap
        other = ScheduledRequest("r1", Program("p-r1", repr(others), tuple(others)), 100)
        assert graph_steps.plan(layout, [served, other]) is None
    assert graph_steps.plan(layout, [served]) is not None
