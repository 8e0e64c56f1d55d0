"""The engine adapter for vLLM's V1 model runner: the only code that reads its private state.

Checked against the vLLM releases in `vllm_runner.engine.compat.CHECKED_VLLM` (`GPUModelRunner`,
which `CPUModelRunner` subclasses). `engine.attach.attach` swaps the runner's class for one
with `RunnerMixin` in front: `load_model` builds the runtime, `_update_states` zeroes reused KV
blocks, and `_model_forward` — which vLLM documents as the method subclasses may override, and
which its profiling and dummy runs do not call — brackets every real forward with the step's
plan.

Where vLLM compiles the model (`enforce_eager=False`), a step with programs runs the plain
module tree, so its hooks run: `_determine_batch_execution_and_padding` is asked for no CUDA
graph (`force_eager`) and the forward context's `skip_compiled` is set, the switch vLLM itself
uses for encoder inputs. Every other step runs vLLM's compiled (and, on a GPU, replayed) path
untouched.

What is read, per step: the request order `input_batch.req_ids[:num_reqs]` after the runner's
own state update; request i owns rows `query_start_loc.np[i]:[i+1]`, and its first row's
absolute position is `positions[query_start_loc[i]]`; each request's program travels in
`requests[id].sampling_params.extra_args`. The runtime gets plain data: a `StepLayout` and the
decoded programs in step order. The V2 runner's adapter is `engine.v2_runner`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from tokenspan import StepLayout
from vllm.forward_context import get_forward_context
from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1ModelRunner

from vllm_runner.engine.kv_blocks import WrittenBlocks, handed_out_blocks, zero_blocks
from vllm_runner.engine.repeated_schedule import RepeatedSchedule
from vllm_runner.engine.runtime_loading import load_runtime
from vllm_runner.engine.swapped import swapped
from vllm_runner.ops.program import ProgramData, program_data
from vllm_runner.ops.wants import ScheduledRequest
from vllm_runner.runtime.door import EngineDoor, GraphNeed, StepDoor
from vllm_runner.runtime.step_plan import NO_ROWS, acting

#: The vLLM module this adapter reads: vLLM 0.34 removed it, and `engine.attach` imports this
#: adapter only for the runner it defines.
ADAPTED_MODULE = "vllm.v1.worker.gpu_model_runner"


def _extra_args(state: Any) -> dict[str, Any] | None:
    params = getattr(state, "sampling_params", None)
    return params.extra_args if params is not None else None


def scheduled_step(runtime: StepDoor, runner: Any, positions: torch.Tensor,
                   repeated: RepeatedSchedule | None = None
                   ) -> tuple[StepLayout, list[ScheduledRequest]]:
    """This step's layout and its requests that run a program, in step order (the last step's
    list where `repeated` has it; no layout is built for a step without programs)."""
    batch = runner.input_batch
    count = batch.num_reqs
    request_ids = batch.req_ids[:count]
    states: list[Any] = [runner.requests.get(request_id) for request_id in request_ids]

    def find() -> list[ScheduledRequest]:
        found = []
        for request_id, state in zip(request_ids, states, strict=True):
            data = program_data(_extra_args(state))
            if data is None:
                continue
            prompt_length = len(state.prompt_token_ids)
            program = runtime.program(data, prompt_length)
            if program is not None:
                found.append(ScheduledRequest(request_id, program, prompt_length))
        return found

    scheduled = (find() if repeated is None
                 else repeated.requests(runtime, request_ids, states, find))
    if not scheduled:
        return NO_ROWS, scheduled
    offsets = runner.query_start_loc.np[: count + 1]
    firsts = positions.index_select(0, torch.as_tensor(offsets[:-1], dtype=torch.long,
                                                       device=positions.device)).tolist()
    layout = StepLayout.from_offsets(request_ids, offsets, firsts,
                                     padded_total=int(positions.shape[0]))
    scheduled = acting(layout, scheduled)
    return (layout, scheduled) if scheduled else (NO_ROWS, scheduled)


def programs_of(runner: Any, runtime: StepDoor, count: int) -> list[ProgramData]:
    """The programs, as they travel, of the step's first `count` requests that carry one and
    may act at this step (`Runtime.acts_at`: each request's rows start at its computed
    tokens)."""
    requests = runner.requests
    found = []
    for request_id in runner.input_batch.req_ids[:count]:
        state = requests.get(request_id)
        data = program_data(_extra_args(state))
        if data is not None and runtime.acts_at(data, len(state.prompt_token_ids),
                                                state.num_computed_tokens):
            found.append(data)
    return found


class RunnerMixin:
    """Put in front of vLLM's V1 model runner class by `attach`."""

    interp: EngineDoor
    interp_compiles: bool  # whether vLLM compiled the model (`runtime_loading.compiles`)
    interp_written: WrittenBlocks
    interp_editing: set[str]
    interp_repeated: RepeatedSchedule

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        result = super().load_model(*args, **kwargs)  # type: ignore[misc]
        load_runtime(self)
        self.interp_repeated = RepeatedSchedule()
        return result

    def _update_states(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        """Zero the blocks handed out this step that an editing request held (`kv_blocks`),
        then vLLM's state update, then remember the blocks editing requests hold now. Nothing
        to do while no request ever edited."""
        for new in scheduler_output.scheduled_new_reqs:
            data = program_data(_extra_args(new))
            if data is not None and self.interp.edits(data):
                self.interp_editing.add(new.req_id)
        # Before vLLM's update, which copies prefix blocks into fresh ones (copy-on-write).
        if self.interp_written and (
                reused := self.interp_written.reused(handed_out_blocks(scheduler_output))):
            self._interp_zero_blocks(reused)
        result = super()._update_states(scheduler_output, *args, **kwargs)  # type: ignore[misc]
        if self.interp_editing:
            self.interp_editing.difference_update(scheduler_output.finished_req_ids)
            requests = self.requests  # type: ignore[attr-defined]
            for request_id in self.interp_editing:
                state = requests.get(request_id)
                if state is not None:
                    self.interp_written.held_by_editing(
                        block for group in state.block_ids for block in group)
        return result

    def _interp_zero_blocks(self, block_ids: list[int]) -> None:
        """Zero KV-cache blocks in every attention layer: with the GPU runner's own kernel
        (built on first use: vLLM builds it only for caches that always need it), else along
        each layer cache's blocks axis (`kv_blocks.zero_blocks`) — the CPU runner's own zeroing
        covers full-attention layers only, and releases before 0.32 have none."""
        runner: Any = self
        gpu_zeroing = getattr(V1ModelRunner, "_zero_block_ids", None)
        if gpu_zeroing is None or type(runner)._zero_block_ids is not gpu_zeroing:
            zero_blocks(_layer_caches(runner), runner.kv_cache_config.num_blocks, block_ids)
            return
        if not hasattr(runner, "_kv_block_zeroer"):
            runner._init_kv_zero_meta()
        runner._zero_block_ids(block_ids)

    def _determine_batch_execution_and_padding(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's choice of CUDA graph for the step; none where a request's program acts at a
        location no tap serves (its hooks would not run in a replay), and no full graph where
        programs need a tap's Python (a full graph replays the taps' kernels, not their Python;
        the piecewise graphs run the tap op between their pieces). Steering the graph serves
        from its buffers (`tap_edits`) leaves vLLM's choice as it is."""
        count = kwargs.get("num_reqs", args[1] if len(args) > 1 else 0)
        if not self.interp.compiled or not (programs := programs_of(self, self.interp, count)):
            return super()._determine_batch_execution_and_padding(  # type: ignore[misc]
                *args, **kwargs)
        need = self.interp.graph_need(programs)
        if need is GraphNeed.MODULE_TREE:
            kwargs["force_eager"] = True
            return super()._determine_batch_execution_and_padding(  # type: ignore[misc]
                *args, **kwargs)
        if need is GraphNeed.ANY:  # all in the graph (`tap_edits`)
            return super()._determine_batch_execution_and_padding(  # type: ignore[misc]
                *args, **kwargs)
        with pieces_only(self):
            return super()._determine_batch_execution_and_padding(  # type: ignore[misc]
                *args, **kwargs)

    def _model_forward(self, input_ids: Any = None, positions: Any = None,
                       intermediate_tensors: Any = None, inputs_embeds: Any = None,
                       **model_kwargs: Any) -> Any:
        layout, scheduled = scheduled_step(self.interp, self, positions, self.interp_repeated)
        context = get_forward_context()
        if scheduled and self.interp.compiled and self.interp.needs_module_tree(
                [request.program for request in scheduled]):
            context.skip_compiled = True
        # Counted by what runs, not by what was asked for: a test breaks the switch on purpose.
        self.interp.begin_step(layout, scheduled, compiled_forward=self.interp_compiles
                               and not context.skip_compiled)
        try:
            return super()._model_forward(  # type: ignore[misc]
                input_ids=input_ids, positions=positions,
                intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds,
                **model_kwargs)
        finally:
            self.interp.end_step()


@contextlib.contextmanager
def pieces_only(runner: Any) -> Iterator[None]:
    """Within the block, the runner's CUDA-graph dispatcher picks no full graph: vLLM's own
    `invalid_modes` where its dispatcher takes them, else no graph at all (the taps then run
    in the plain forward, never in a replay)."""
    dispatcher: Any = getattr(runner, "cudagraph_dispatcher", None)
    dispatch = getattr(dispatcher, "dispatch", None)
    if dispatch is None:
        yield
        return
    from vllm.config import CUDAGraphMode

    takes_invalid = _takes_invalid_modes(getattr(dispatch, "__func__", dispatch))

    def without_full(*args: Any, **kwargs: Any) -> Any:
        if takes_invalid:
            kwargs["invalid_modes"] = {*(kwargs.get("invalid_modes") or ()), CUDAGraphMode.FULL}
        else:
            kwargs["valid_modes"] = {CUDAGraphMode.NONE}
        return dispatch(*args, **kwargs)

    with swapped(dispatcher, "dispatch", without_full):
        yield


@functools.cache
def _takes_invalid_modes(dispatch: Any) -> bool:
    """Whether a CUDA-graph dispatcher's `dispatch` takes `invalid_modes` (read once per
    release, not at every step)."""
    return "invalid_modes" in inspect.signature(dispatch).parameters


def _layer_caches(runner: Any) -> list[torch.Tensor]:
    """Each attention layer's KV-cache tensor (vLLM's static forward context), once each."""
    found: dict[int, torch.Tensor] = {}
    for context in runner.compilation_config.static_forward_context.values():
        caches = getattr(context, "kv_cache", None)
        for cache in caches if isinstance(caches, (list, tuple)) else [caches]:
            if isinstance(cache, torch.Tensor) and cache.numel():
                found.setdefault(cache.data_ptr(), cache)
    return list(found.values())
