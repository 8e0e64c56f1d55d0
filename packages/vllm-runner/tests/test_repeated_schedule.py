"""A step that schedules the same requests as the last one reuses its list of requests with
programs (`repeated_schedule`), and only then: any change of requests, order, kept program or a
failure makes the adapter find every request's program again. Through V2's `scheduled_step`,
on fakes shaped like its `InputBatch` and the runtime."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from vllm_runner import ops
from vllm_runner.engine.repeated_schedule import RepeatedSchedule
from vllm_runner.engine.v2_runner import scheduled_step
from vllm_runner.ops.program import Program


class Runtime:
    """What `scheduled_step` and `RepeatedSchedule` ask of the runtime, recorded."""

    def __init__(self, editing: bool = False) -> None:
        self.editing = editing
        self.looked_up: list[str] = []
        self.any_failed = False
        self.edits_noted = 0

    def program(self, data, prompt_length):
        self.looked_up.append(data["program_id"])
        # A program that acts at every step (one with no op acts on no step past its prompt).
        ops_run = (ops.Add("layers.0.layer_output", torch.ones(4)),) if self.editing else (
            ops.Save("layers.0.layer_output"),)
        return Program(data["program_id"], "digest", ops_run)

    def note_edits(self) -> None:
        self.edits_noted += 1


def decode_step(req_ids, first=10):
    offsets = np.arange(len(req_ids) + 1, dtype=np.int32)
    return SimpleNamespace(req_ids=list(req_ids), num_reqs=len(req_ids),
                           query_start_loc_np=offsets,
                           num_computed_tokens_np=np.full(len(req_ids), first, dtype=np.int32),
                           num_tokens_after_padding=len(req_ids))


def kept(program_id):
    return ({"program_id": program_id, "digest": "digest", "ops": []}, 4)


def test_the_same_requests_again_reuse_the_list_and_get_the_new_positions() -> None:
    runtime, repeated = Runtime(), RepeatedSchedule()
    programs = {"a": kept("pa"), "c": kept("pc")}
    _, first = scheduled_step(runtime, programs, decode_step(["a", "b", "c"], 10), repeated)
    layout, again = scheduled_step(runtime, programs, decode_step(["a", "b", "c"], 11),
                                   repeated)
    assert again is first and [request.request_id for request in again] == ["a", "c"]
    assert runtime.looked_up == ["pa", "pc"]  # found once, at the first step
    assert [layout[key].first_position for key in ("a", "b", "c")] == [11, 11, 11]


def test_any_change_finds_every_program_again() -> None:
    runtime, repeated = Runtime(), RepeatedSchedule()
    programs = {"a": kept("pa"), "b": kept("pb")}
    scheduled_step(runtime, programs, decode_step(["a", "b"]), repeated)
    changes = []
    # Another order (V2 orders its steps itself).
    _, found = scheduled_step(runtime, programs, decode_step(["b", "a"]), repeated)
    changes.append([request.request_id for request in found] == ["b", "a"])
    # A request more, then one fewer.
    programs["c"] = kept("pc")
    _, found = scheduled_step(runtime, programs, decode_step(["b", "a", "c"]), repeated)
    changes.append(len(found) == 3)
    _, found = scheduled_step(runtime, programs, decode_step(["b", "a"]), repeated)
    changes.append(len(found) == 2)
    # The same ids, but one request re-added (after preemption) with its program kept anew.
    programs["a"] = kept("pa2")
    _, found = scheduled_step(runtime, programs, decode_step(["b", "a"]), repeated)
    changes.append(found[1].program.program_id == "pa2")
    assert all(changes)
    assert runtime.looked_up == ["pa", "pb", "pb", "pa", "pb", "pa", "pc", "pb", "pa",
                                 "pb", "pa2"]


def test_a_failure_anywhere_makes_the_list_stale() -> None:
    runtime, repeated = Runtime(), RepeatedSchedule()
    programs = {"a": kept("pa")}
    scheduled_step(runtime, programs, decode_step(["a"]), repeated)
    runtime.any_failed = True
    scheduled_step(runtime, programs, decode_step(["a"]), repeated)
    runtime.any_failed = False
    scheduled_step(runtime, programs, decode_step(["a"]), repeated)
    assert runtime.looked_up == ["pa", "pa"]


def test_a_reused_list_of_editing_programs_marks_the_step_as_editing() -> None:
    for editing in (False, True):
        runtime, repeated = Runtime(editing), RepeatedSchedule()
        programs = {"a": kept("pa")}
        for _ in range(3):
            scheduled_step(runtime, programs, decode_step(["a"]), repeated)
        assert runtime.edits_noted == (2 if editing else 0)
