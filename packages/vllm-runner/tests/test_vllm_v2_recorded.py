"""The V2 adapter on steps recorded from vLLM 0.33's real V2 runner on an H200
(benchmarks/gpu/record_v2_steps.py: chunked prompts, a shared prefix, a preempted request).

The oracle is the GPU: each step's device positions at every request's first row, and the rows
of the sampler's logits, both recorded there."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from test_vllm_v2_runner import FakeRuntime, data, runner
from vllm_runner.program import EXTRA_ARGS_KEY
from vllm_runner.step_plan import sampled_rows
from vllm_runner.vllm_v2_runner import scheduled_step

RECORDED = Path(__file__).parent / "fixtures" / "v2_steps_0.33.0.json"
STEPS = json.loads(RECORDED.read_text())["steps"]


def _batch(recorded: dict) -> SimpleNamespace:
    batch = dict(recorded)
    batch["query_start_loc_np"] = np.asarray(batch["query_start_loc_np"], dtype=np.int32)
    batch["num_computed_tokens_np"] = np.asarray(batch["num_computed_tokens_np"],
                                                 dtype=np.int32)
    return SimpleNamespace(**batch)


def _scheduler_output(step: dict) -> SimpleNamespace:
    new = [SimpleNamespace(req_id=n["req_id"], prompt_len=n["prompt_len"],
                           block_ids=tuple(n["block_ids"] or ()),
                           sampling_params=SimpleNamespace(
                               extra_args={EXTRA_ARGS_KEY: data(n["req_id"])}))
           for n in step["new"]]
    cached = step["cached"]
    return SimpleNamespace(
        scheduled_new_reqs=new, finished_req_ids=set(step["finished"]),
        preempted_req_ids=set(step["preempted"]),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=cached["req_ids"],
            new_block_ids=[tuple(ids) if ids else None for ids in cached["new_block_ids"]]))


def test_the_recording_holds_the_cases_it_is_for() -> None:
    assert any(step["preempted"] for step in STEPS)
    assert any(step["batch"]["req_ids"] != list(step["num_scheduled_tokens"]) for step in STEPS)
    assert any(max(step["num_scheduled_tokens"].values()) > 1
               and len(step["num_scheduled_tokens"]) > 1 for step in STEPS)


@pytest.mark.parametrize("index", range(len(STEPS)))
def test_each_recorded_step_gives_the_gpus_rows_and_positions(index: int) -> None:
    """Every request's rows are its own in V2's order, from the first position the GPU used,
    and the sampled rows are as many as the sampler's logits had."""
    step = STEPS[index]
    batch = _batch(step["batch"])
    programs = {request_id: (data(request_id), 1) for request_id in batch.req_ids}
    layout, scheduled = scheduled_step(FakeRuntime(), programs, batch)  # type: ignore[arg-type]
    assert list(layout.keys) == batch.req_ids == [r.request_id for r in scheduled]
    offsets = step["batch"]["query_start_loc_np"]
    for request_id, start, stop, first in zip(batch.req_ids, offsets, offsets[1:],
                                              step["batch"]["device_first_positions"],
                                              strict=False):
        span = layout[request_id]
        assert (span.start, span.stop, span.first_position) == (start, stop, first)
        assert stop - start == step["num_scheduled_tokens"][request_id]
    assert layout.padded_total == batch.num_tokens_after_padding
    assert len(sampled_rows(layout)) == step["logits_rows"][0]


def test_replayed_scheduler_outputs_keep_a_program_for_every_scheduled_request() -> None:
    """Through the recorded adds, finishes and preemptions (a preempted request comes back as a
    new one), every request V2 schedules has its program kept, and none is kept past its end."""
    made = runner(editing=False)
    for step in STEPS:
        output = _scheduler_output(step)
        made.finish_requests(output)
        made.add_requests(output)
        made.update_requests(output)
        assert set(step["batch"]["req_ids"]) <= set(made.interp_programs)
    finished = {request for step in STEPS for request in step["finished"]}
    assert not finished & set(made.interp_programs)
