"""The runtime built on a loaded model runner: what both engine adapters do in `load_model`."""

from __future__ import annotations

from typing import Any

from vllm_runner.kv_blocks import WrittenBlocks
from vllm_runner.runtime import Runtime
from vllm_runner.settings import device_saves_limit, read_mode


def load_runtime(runner: Any) -> None:
    """Give a vLLM model runner whose model is loaded its runtime (`runner.interp`) and the
    KV-block bookkeeping of requests that edit. The settings are read here, in the worker's
    own process (see `vllm_runner.llm.LLM`)."""
    model = runner.get_model()
    fragments, rank = _tensor_parallel(model)
    runner.interp = Runtime(model, runner.model_config.hf_config, fragments, rank,
                            reads=read_mode(), device_saves_limit=device_saves_limit())
    runner.interp.compiled = runner.interp_compiles = compiles(runner.vllm_config)
    runner.interp_written = WrittenBlocks()
    runner.interp_editing = set()  # requests whose programs edit (their blocks are marked)


def compiles(vllm_config: Any) -> bool:
    """Whether vLLM compiles the model (any compilation mode but none: `enforce_eager=False`,
    on the CPU too, where vLLM traces with Dynamo and compiles with inductor)."""
    from vllm.config import CompilationMode

    return CompilationMode(vllm_config.compilation_config.mode) != CompilationMode.NONE


def _tensor_parallel(model: Any) -> tuple[Any, int]:
    """The model's sharded values (`tpfragments`) and this worker's tensor-parallel rank."""
    from tpfragments.vllm import fragments_for, tp_group

    group = tp_group()
    return (fragments_for(model, group) if group.size > 1 else None), group.rank
