"""The engine adapter for vLLM's V2 model runner (`vllm.v1.worker.gpu.model_runner`).

The second adapter beside `vllm_v1_runner`, and like it the only code that reads this runner's
private state. Read in vLLM 0.32 (the CPU wheel, which ships the module but cannot run it: V2
needs Triton's GPU backend) and 0.33; see docs/vllm-runner-internals.md for what was run where.

V2 keeps no `SamplingParams` per request, so each request's program is kept here when V2 adds
it (`add_requests`: new requests and ones resumed after preemption, which V2 re-adds with their
`sampling_params`) and forgotten when it finishes or is preempted (`finish_requests`). V2 has
no `_model_forward`: `prepare_inputs` — called for real batches only, never for profiling,
dummy or capture runs — hands over the step's `InputBatch`, whose plain host fields give the
layout: the step's own request order `req_ids` (uniform decodes first, then by query length),
row offsets `query_start_loc_np`, and first positions `num_computed_tokens_np`, read on the host
so that V2's run-ahead (async scheduling) is not stalled by a device read; `execute_model`
brackets the forward. The sampler's `compute_logits` runs later, in `sample_tokens`, where the
runtime's logits hook serves the sampled rows as under V1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenspan import StepLayout

from vllm_runner.kv_blocks import WrittenBlocks, zero_blocks
from vllm_runner.program import ProgramData, program_data
from vllm_runner.runtime import Runtime
from vllm_runner.runtime_loading import load_runtime
from vllm_runner.step_plan import NO_ROWS, ScheduledRequest
from vllm_runner.vllm_v1_runner import blocks_of, handed_out_blocks

#: A running request's program and its prompt's length, kept from when V2 added it.
Kept = tuple[ProgramData, int]


def scheduled_step(runtime: Runtime, programs: Mapping[str, Kept],
                   batch: Any) -> tuple[StepLayout, list[ScheduledRequest]]:
    """This step's layout from V2's `InputBatch` (plain host attributes only) and its requests
    that run a program, in the step's order; no layout is built for a step without programs."""
    count = int(batch.num_reqs)
    request_ids = list(batch.req_ids[:count])
    scheduled = []
    for request_id in request_ids:
        kept = programs.get(request_id)
        if kept is None:
            continue
        data, prompt_length = kept
        program = runtime.program(data, prompt_length)
        if program is not None:
            scheduled.append(ScheduledRequest(request_id, program, prompt_length))
    if not scheduled:
        return NO_ROWS, scheduled
    layout = StepLayout.from_offsets(request_ids, batch.query_start_loc_np[: count + 1],
                                     batch.num_computed_tokens_np[:count],
                                     padded_total=int(batch.num_tokens_after_padding))
    return layout, scheduled


class RunnerV2Mixin:
    """Put in front of vLLM's V2 model runner class by `runner_attach.attach`."""

    interp: Runtime
    interp_written: WrittenBlocks
    interp_editing: set[str]
    interp_programs: dict[str, Kept]
    interp_in_step: bool

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        result = super().load_model(*args, **kwargs)  # type: ignore[misc]
        load_runtime(self)
        self.interp_programs = {}  # V2 keeps no SamplingParams: the programs are kept here
        self.interp_in_step = False
        return result

    def add_requests(self, scheduler_output: Any) -> None:
        """V2's own, then keep each added request's program (a request re-added after
        preemption or for streamed input brings its `sampling_params` again)."""
        super().add_requests(scheduler_output)  # type: ignore[misc]
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            data = program_data(params.extra_args if params is not None else None)
            if data is None:
                self.interp_programs.pop(new.req_id, None)
                continue
            self.interp_programs[new.req_id] = (data, int(new.prompt_len))
            if self.interp.edits(data):
                self.interp_editing.add(new.req_id)

    def finish_requests(self, scheduler_output: Any) -> None:
        """V2's own, then forget finished and preempted requests' programs (a preempted one
        comes back through `add_requests`)."""
        super().finish_requests(scheduler_output)  # type: ignore[misc]
        gone = set(scheduler_output.finished_req_ids) | set(
            scheduler_output.preempted_req_ids or ())
        for request_id in gone:
            self.interp_programs.pop(request_id, None)
        self.interp_editing.difference_update(scheduler_output.finished_req_ids)

    def update_requests(self, scheduler_output: Any) -> None:
        """Zero the blocks handed out this step that an editing request held (`kv_blocks`) —
        before V2's own update, which copies prefix blocks into fresh ones (copy-on-write) — then
        remember the blocks handed to editing requests now."""
        new_requests = scheduler_output.scheduled_new_reqs
        cached = scheduler_output.scheduled_cached_reqs
        if self.interp_written and (
                reused := self.interp_written.reused(handed_out_blocks(scheduler_output))):
            self._interp_zero_blocks(reused)
        super().update_requests(scheduler_output)  # type: ignore[misc]
        if self.interp_editing:
            for new in new_requests:
                if new.req_id in self.interp_editing:
                    self.interp_written.held_by_editing(blocks_of(new.block_ids))
            for request_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
                if request_id in self.interp_editing:
                    self.interp_written.held_by_editing(blocks_of(ids))

    def _interp_zero_blocks(self, block_ids: list[int]) -> None:
        """Zero KV-cache blocks in every attention layer with V2's own kernel (built on first
        use: vLLM builds it only for caches that always need it), else along each cache's
        blocks axis."""
        runner: Any = self
        if getattr(runner, "kv_block_zeroer", None) is None and hasattr(runner,
                                                                       "_init_kv_zero_meta"):
            runner._init_kv_zero_meta()
        zeroer = getattr(runner, "kv_block_zeroer", None)
        if zeroer is not None:
            zeroer.zero_block_ids(block_ids)
            return
        zero_blocks(list(runner.kv_caches), runner.kv_cache_config.num_blocks, block_ids)

    def prepare_inputs(self, *args: Any, **kwargs: Any) -> Any:
        """V2's inputs of one real batch, then the step's plan (its signature differs between
        releases: everything passes through)."""
        batch = super().prepare_inputs(*args, **kwargs)  # type: ignore[misc]
        layout, scheduled = scheduled_step(self.interp, self.interp_programs, batch)
        self.interp.begin_step(layout, scheduled)
        # V2 runs eager only (`runner_attach`)
        self.interp.count_forward(compiled=False, programs=bool(scheduled))
        self.interp_in_step = True
        return batch

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        """One step of V2; the step's token rows are forgotten when it ends (the sampled rows
        wait for `sample_tokens`)."""
        try:
            return super().execute_model(*args, **kwargs)  # type: ignore[misc]
        finally:
            if self.interp_in_step:
                self.interp_in_step = False
                self.interp.end_step()
