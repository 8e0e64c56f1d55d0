"""The V2 adapter on steps recorded from each checked vLLM release's real V2 runner on a GPU
(benchmarks/gpu/record_v2_steps.py: chunked prompts, a shared prefix, a preempted request), one
fixture per release (`fixtures/v2_steps_<release>.json`).

The oracle is the GPU: each step's device positions at every request's first row, and the rows
of the sampler's logits, both recorded there."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from test_vllm_v2_runner import FakeRuntime, data, runner
from vllm_runner.engine.v2_runner import scheduled_step
from vllm_runner.ops.program import EXTRA_ARGS_KEY
from vllm_runner.runtime.step_plan import sampled_rows

RECORDINGS = {path.stem.removeprefix("v2_steps_"): json.loads(path.read_text())["steps"]
              for path in sorted((Path(__file__).parent / "fixtures").glob("v2_steps_*.json"))}
EACH_STEP = [pytest.param(steps[index], id=f"{release}-step{index}")
             for release, steps in RECORDINGS.items() for index in range(len(steps))]
EACH_RECORDING = pytest.mark.parametrize("steps", list(RECORDINGS.values()), ids=list(RECORDINGS))


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


def test_every_checked_gpu_release_has_a_recording() -> None:
    from vllm_runner.engine.compat import CHECKED_VLLM

    gpu_releases = {release for release, where in CHECKED_VLLM.items() if "CUDA" in where}
    assert gpu_releases <= set(RECORDINGS)


@EACH_RECORDING
def test_the_recording_holds_the_cases_it_is_for(steps: list[dict]) -> None:
    assert any(step["preempted"] for step in steps)
    assert any(step["batch"]["req_ids"] != list(step["num_scheduled_tokens"]) for step in steps)
    assert any(max(step["num_scheduled_tokens"].values()) > 1
               and len(step["num_scheduled_tokens"]) > 1 for step in steps)


@pytest.mark.parametrize("step", EACH_STEP)
def test_each_recorded_step_gives_the_gpus_rows_and_positions(step: dict) -> None:
    """Every request's rows are its own in V2's order, from the first position the GPU used,
    and the sampled rows are as many as the sampler's logits had."""
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


@EACH_RECORDING
def test_replayed_scheduler_outputs_keep_a_program_for_every_scheduled_request(
        steps: list[dict]) -> None:
    """Through the recorded adds, finishes and preemptions (a preempted request comes back as a
    new one), every request V2 schedules has its program kept, and none is kept past its end."""
    made = runner(editing=False)
    for step in steps:
        output = _scheduler_output(step)
        made.finish_requests(output)
        made.add_requests(output)
        made.update_requests(output)
        assert set(step["batch"]["req_ids"]) <= set(made.interp_programs)
    finished = {request for step in steps for request in step["finished"]}
    assert not finished & set(made.interp_programs)
