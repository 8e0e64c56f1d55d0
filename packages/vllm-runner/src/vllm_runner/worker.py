"""Worker classes handed to vLLM as dotted paths (`worker_cls`), and the runner mixin.

Checked against the vLLM releases in `vllm_runner.compat.CHECKED_VLLM`. The worker builds
vLLM's own model runner, then swaps its class for one with `RunnerMixin` in front:
`load_model` attaches the runtime, and `_model_forward` — which vLLM documents as the method
subclasses may override, and which its profiling and dummy runs do not call — brackets every
real forward with the step's layout.
Only the V1 runner is supported; the V2 runner is refused with the setting that selects V1.

The CPU worker lives in `vllm_runner.cpu_worker`: importing vLLM's `cpu_worker` replaces
torch's CUDA events, streams and `pin_memory` with no-ops process-wide, so a GPU worker process
must never import it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1ModelRunner
from vllm.v1.worker.gpu_worker import Worker as GPUWorker

from vllm_runner import wire
from vllm_runner.compat import check_runner
from vllm_runner.errors import LocationError
from vllm_runner.kv_blocks import WrittenBlocks
from vllm_runner.program import edits, program_of
from vllm_runner.runtime import Runtime
from vllm_runner.settings import device_saves_limit, read_mode

logger = logging.getLogger("vllm.interp")


class RunnerMixin:
    """Put in front of vLLM's V1 model runner class by `attach`."""

    interp: Runtime
    interp_written: WrittenBlocks
    interp_editing: set[str]

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        result = super().load_model(*args, **kwargs)
        fragments, rank = _tensor_parallel(self.get_model())
        # Read at load, in the worker's own process: see `vllm_runner.llm.LLM`'s settings.
        self.interp = Runtime(self.get_model(), self.model_config.hf_config, fragments, rank,
                              reads=read_mode(), device_saves_limit=device_saves_limit())
        self.interp_written = WrittenBlocks()
        self.interp_editing = set()  # requests whose programs edit (their blocks are marked)
        return result

    def _update_states(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's state update, then: zero the blocks handed out this step that an editing
        request held (`kv_blocks`), before the forward writes into them, and remember the
        blocks editing requests hold now. Nothing to do while no request ever edited."""
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            if edits(program_of(params.extra_args if params is not None else None)):
                self.interp_editing.add(new.req_id)
        result = super()._update_states(scheduler_output, *args, **kwargs)
        if self.interp_written:
            handed_out = [block for new in scheduler_output.scheduled_new_reqs
                          for group in new.block_ids for block in group]
            handed_out += [block for ids in scheduler_output.scheduled_cached_reqs.new_block_ids
                           if ids is not None for group in ids for block in group]
            if reused := self.interp_written.reused(handed_out):
                self._interp_zero_blocks(reused)
        if self.interp_editing:
            self.interp_editing.difference_update(scheduler_output.finished_req_ids)
            for request_id in self.interp_editing:
                state = self.requests.get(request_id)
                if state is not None:
                    self.interp_written.held_by_editing(
                        block for group in state.block_ids for block in group)
        return result

    def _interp_zero_blocks(self, block_ids: list[int]) -> None:
        """Zero KV-cache blocks in every attention layer: with the GPU runner's own kernel
        (built on first use: vLLM builds it only for caches that always need it), else along
        each layer cache's blocks axis (`_zero_blocks_of`) — the CPU runner's own zeroing
        covers full-attention layers only, and releases before 0.32 have none."""
        gpu_zeroing = getattr(V1ModelRunner, "_zero_block_ids", None)
        if gpu_zeroing is None or type(self)._zero_block_ids is not gpu_zeroing:
            _zero_blocks_of(_layer_caches(self), self.kv_cache_config.num_blocks, block_ids)
            return
        if not hasattr(self, "_kv_block_zeroer"):
            self._init_kv_zero_meta()
        self._zero_block_ids(block_ids)

    def _model_forward(self, input_ids: Any = None, positions: Any = None,
                       intermediate_tensors: Any = None, inputs_embeds: Any = None,
                       **model_kwargs: Any) -> Any:
        self.interp.begin_step(self, positions)
        try:
            return super()._model_forward(input_ids=input_ids, positions=positions,
                                          intermediate_tensors=intermediate_tensors,
                                          inputs_embeds=inputs_embeds, **model_kwargs)
        finally:
            self.interp.end_step()


def _layer_caches(runner: Any) -> list[torch.Tensor]:
    """Each attention layer's KV-cache tensor (vLLM's static forward context), once each."""
    found: dict[int, torch.Tensor] = {}
    for context in runner.compilation_config.static_forward_context.values():
        caches = getattr(context, "kv_cache", None)
        for cache in caches if isinstance(caches, (list, tuple)) else [caches]:
            if isinstance(cache, torch.Tensor) and cache.numel():
                found.setdefault(cache.data_ptr(), cache)
    return list(found.values())


def _zero_blocks_of(kv_caches: list[Any], num_blocks: int, block_ids: list[int]) -> None:
    """Zero `block_ids` in each layer's KV cache along its blocks axis: the first of its two
    leading axes that has `num_blocks` entries (`[blocks, ...]` or `[2, blocks, ...]` in vLLM's
    layouts). A cache with neither is reported, not guessed at (and the step goes on: failing
    it would stop every request)."""
    for kv in kv_caches:
        axis = next((axis for axis in (0, 1) if kv.dim() > axis and kv.shape[axis] == num_blocks),
                    None)
        if axis is None:
            logger.error("vllm-interp cannot find the blocks axis of a KV cache shaped %s (%d "
                         "blocks); blocks an edited request held are not zeroed",
                         tuple(kv.shape), num_blocks)
            continue
        kv.index_fill_(axis, torch.tensor(block_ids, dtype=torch.long, device=kv.device), 0)


def _tensor_parallel(model: Any) -> tuple[Any, int]:
    """The model's sharded values (`tpfragments`) and this worker's tensor-parallel rank."""
    from tpfragments.vllm import fragments_for, tp_group

    group = tp_group()
    return (fragments_for(model, group) if group.size > 1 else None), group.rank


def attach(runner: Any) -> None:
    """Swap `runner`'s class for one with `RunnerMixin` in front; refuse runners not checked."""
    check_runner(runner, V1ModelRunner)
    base = type(runner)
    runner.__class__ = type(f"Interp{base.__name__}", (RunnerMixin, base), {})


class WorkerRPC:
    """String-named RPCs the client calls with `collective_rpc` (plain data in and out)."""

    model_runner: Any

    def interp_resolve(self, patterns: list[str]) -> dict[str, Any]:
        """Canonical locations for each pattern, or the error message that refuses it."""
        resolved, errors = {}, {}
        for pattern in patterns:
            try:
                resolved[pattern] = self.model_runner.interp.resolve(pattern)
            except LocationError as error:
                errors[pattern] = str(error)
        return {"resolved": resolved, "errors": errors}

    def interp_collect(self, requests: list[dict[str, Any]],
                       encoded: bool = True) -> dict[str, Any]:
        """Saves and errors of finished requests (`key`, `computed`, `prompt_length`, `ops`).

        As plain data (`wire.encode`) for a client in another process; as the tensors
        themselves (`encoded=False`) for an in-process client, which saves the copies."""
        runtime = self.model_runner.interp
        saved = runtime.collect(requests)
        collected = {request["key"]: {"saved": saved[request["key"]],
                                      "error": runtime.error(request["key"])}
                     for request in requests}
        return wire.encode(collected) if encoded else collected

    def interp_support(self) -> dict[str, str | None]:
        """Every value of the model → `None` if available, else the reason. Runs nothing."""
        return self.model_runner.interp.standard.support()

    def interp_drop(self, keys: list[str]) -> None:
        """Free the saves of requests that will never be collected."""
        self.model_runner.interp.drop(keys)


class InterpGPUWorker(WorkerRPC, GPUWorker):
    """vLLM's GPU worker with the interpretability runner (V1 runner only; see `compat`)."""

    def init_device(self) -> None:
        super().init_device()
        attach(self.model_runner)
