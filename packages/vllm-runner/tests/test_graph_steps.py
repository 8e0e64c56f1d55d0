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
from vllm_runner.compiled.graph_steps import GraphSteps
from vllm_runner.compiled.in_graph import InGraphRows
from vllm_runner.compiled.repeated_saves import RepeatedSaves
from vllm_runner.compiled.tap_edits import AblateRows, SteerRows, steered_rows
from vllm_runner.compiled.tap_saves import SaveRing
from vllm_runner.ops.program import Program
from vllm_runner.ops.wants import ScheduledRequest
from vllm_runner.runtime.step_plan import plan_step
from vllm_runner.saves.arena import SaveArena
from vllm_runner.saves.store import SaveStore, ToCollect

ROWS, SLOTS = 64, 8
FIRST, SECOND = "layers.0.layer_output", "layers.1.layer_output"
ONE, OTHER = torch.arange(HIDDEN, dtype=torch.float32), -torch.ones(HIDDEN)
#: Programs the graph serves alone, by digest (shared by the requests that run them).
PROGRAMS = {
    "steer": (ops.Add(FIRST, ONE, scale=0.5),),
    "steer twice and save": (ops.Add(FIRST, ONE), ops.Add(FIRST, OTHER), ops.Save(FIRST)),
    "save both": (ops.Save(FIRST), ops.Save(SECOND)),
    "save the second": (ops.Save(SECOND),),
    "steer the second": (ops.Add(SECOND, OTHER),),
    "ablate, steer and save": (ops.ProjectOut(FIRST, OTHER), ops.Add(FIRST, ONE), ops.Save(FIRST)),
    "ablate the second": (ops.ProjectOut(SECOND, ONE),),
}


def graph_taps() -> tuple[dict[str, InGraphRows], dict[str, Any]]:
    """Two graph taps sharing one arena, as `InGraphBuffers` makes them, and their values."""
    cpu = torch.device("cpu")
    arena = SaveArena(HIDDEN, ROWS, cpu, torch.float32)
    taps, values = {}, {}
    for number, host in enumerate(("layers.0", "layers.1")):
        value = values[f"{host}.layer_output"] = residual_value(Toy(), host)
        tables = (value, HIDDEN, ROWS, SLOTS, str(number), cpu, torch.float32)
        taps[value.location] = InGraphRows(
            value, AblateRows(*tables), SteerRows(*tables),
            SaveRing(value, HIDDEN, ROWS, str(number), arena))
        taps[value.location].saves.ring.copy_(torch.randn(
            ROWS, HIDDEN, generator=torch.Generator().manual_seed(number)))
    return taps, values


@st.composite
def steps(draw: Any) -> tuple[list[int], list[int], list[str | None]]:
    """A step's requests: their row counts, first positions and programs (None: none)."""
    count = draw(st.integers(1, 8))
    counts = draw(st.lists(st.integers(1, 6), min_size=count, max_size=count))
    firsts = draw(st.lists(st.integers(0, 50), min_size=count, max_size=count))
    names = draw(st.lists(st.sampled_from([None, *PROGRAMS]), min_size=count, max_size=count))
    return counts, firsts, names


@settings(deadline=None, max_examples=150)
@given(steps(), st.integers(1, 4), st.booleans())
def test_steps_planned_per_program_write_and_save_what_the_general_plan_does(
        step, repeats, follow_on) -> None:
    counts, firsts, names = step
    requests = []
    found = {}
    for path in ("general", "per program"):
        (taps, values), store = graph_taps(), SaveStore()
        graph_steps = GraphSteps(taps, lambda op: list(op.patterns()), values)
        repeated_saves = RepeatedSaves()
        # One list for every step, as the adapters reuse it (`repeated_schedule`): the later
        # steps take the first one's plan with their own positions.
        requests = [ScheduledRequest(key, Program(f"p-{key}", name, PROGRAMS[name]), 100)
                    for key, name in zip(layout_of(counts, firsts).keys, names, strict=True)
                    if name is not None]
        for repeat in range(repeats):
            # Decode steps' positions follow on (their saves are kept as a run of steps:
            # `repeated_saves`); else the later steps' rows land past a gap.
            layout = layout_of(counts, [first + repeat * (count if follow_on else 6)
                                        for first, count in zip(firsts, counts, strict=True)])
            if path == "general":
                wants = plan_step(layout, requests, lambda op: list(op.patterns())).tokens.wants
                for location, rows in taps.items():
                    groups = wants.get(location, [])
                    for table, kind in ((rows.ablate, ops.ProjectOut.kind),
                                        (rows.steer, ops.Add.kind)):
                        table.fill(steered_rows(values[location], groups, store.failed,
                                                table.vectors, kind))
                    rows.saves.take(groups, store.failed, values[location], store)
            else:
                planned = graph_steps.plan(layout, requests)
                assert planned is not None
                for filled in planned.steering:
                    filled.table.write(filled.vectors, filled.index)
                repeated_saves.keep(planned.saves, planned.layout, store)
        # What each row gets added and which direction it loses, and what each request saved
        # (some positions only: a row saved as another position's would show).
        added = [table.table.index_select(0, table.index) for rows in taps.values()
                 for table in (rows.ablate, rows.steer)]
        saved = store.collect([ToCollect(request.program.program_id, 10_000, {
            location: lambda position: position % 3 != 1 for location in taps})
            for request in requests])
        found[path] = (added, saved)
    (added, saved), (added_too, saved_too) = found.values()
    for one, other in zip(added, added_too, strict=True):
        assert torch.equal(one, other)
    assert saved.keys() == saved_too.keys()
    for program_id, values in saved.items():
        assert values.keys() == saved_too[program_id].keys()
        for name, tensor in values.items():
            assert torch.equal(tensor, saved_too[program_id][name]), program_id


def test_a_program_with_other_work_leaves_the_step_to_the_general_plan() -> None:
    taps, values = graph_taps()
    graph_steps = GraphSteps(taps, lambda op: list(op.patterns()), values)
    layout = layout_of([2, 1])
    served = ScheduledRequest("r0", Program("p-r0", "steer", PROGRAMS["steer"]), 100)
    for others in ([ops.Scale(FIRST, 2.0)],  # the taps' Python
                   [ops.Add(FIRST, ONE, steps="decode")],  # an Add at some positions only
                   [ops.Save(FIRST), ops.Add(FIRST, ONE)],  # a save before the steering
                   [ops.ProjectOut(FIRST, ONE, positions=(-1,))],  # some positions only
                   [ops.Add(FIRST, ONE), ops.ProjectOut(FIRST, ONE)],  # ablating the steered
                   [ops.Save("layers.2.layer_output")]):  # a location with no graph tap
        other = ScheduledRequest("r1", Program("p-r1", repr(others), tuple(others)), 100)
        assert graph_steps.plan(layout, [served, other]) is None
    assert graph_steps.plan(layout, [served]) is not None
