"""The runtime built on a loaded model runner: what both engine adapters do in `load_model`."""

from __future__ import annotations

import logging
from typing import Any

from vllm_runner.compiled.taps import TAP_OP
from vllm_runner.engine.kv_blocks import WrittenBlocks
from vllm_runner.runtime.door import EngineDoor
from vllm_runner.runtime.runtime import Runtime
from vllm_runner.settings import (
    GRAPH_TAPS_KEY,
    SAES_KEY,
    TAPS_KEY,
    device_saves_limit,
    read_mode,
)

logger = logging.getLogger("vllm.interp")


def load_runtime(runner: Any) -> None:
    """Give a vLLM model runner whose model is loaded its runtime (`runner.interp`) and the
    KV-block bookkeeping of requests that edit. The settings are read here, in the worker's
    own process (see `vllm_runner.client.llm.LLM`)."""
    model = runner.get_model()
    fragments, rank = _tensor_parallel(model)
    runtime = Runtime(model, runner.model_config.hf_config, fragments, rank, reads=read_mode(),
                      device_saves_limit=device_saves_limit())
    runtime.compiled = runner.interp_compiles = compiles(runner.vllm_config)
    install_taps(runtime, runner.vllm_config)
    if saes := (runner.vllm_config.additional_config or {}).get(SAES_KEY):
        runtime.load_saes(saes)
        for name, reason in runtime.sae_table.refused.items():
            logger.warning("vllm-runner: SAE %r refused: %s", name, reason)
    door: EngineDoor = runtime  # what the adapters and the worker's RPCs may use of it
    runner.interp = door
    runner.interp_written = WrittenBlocks()
    runner.interp_editing = set()  # requests whose programs edit (their blocks are marked)


def install_taps(runtime: Runtime, vllm_config: Any) -> None:
    """Install the taps the engine was started with (`taps.TAPS_KEY` in vLLM's
    `additional_config`, set by `LLM(taps=...)`), before vLLM compiles the model, and list the
    tap op among the operators vLLM's piecewise CUDA graphs are split at, so it runs between
    their replays."""
    config = vllm_config.additional_config or {}
    patterns, in_graph = config.get(TAPS_KEY) or [], config.get(GRAPH_TAPS_KEY) or []
    if not patterns:
        return
    scheduler = vllm_config.scheduler_config
    # The most rows one forward runs: a step's tokens, or a CUDA graph's padded batch.
    rows = max(scheduler.max_num_batched_tokens,
               max(vllm_config.compilation_config.cudagraph_capture_sizes or [0]))
    for pattern, reason in runtime.install_taps(patterns, rows, scheduler.max_num_seqs,
                                                in_graph).items():
        logger.warning("vllm-runner: tap %r refused: %s", pattern, reason)
    compilation = vllm_config.compilation_config
    if compilation.splitting_ops is not None and TAP_OP not in compilation.splitting_ops:
        compilation.splitting_ops.append(TAP_OP)
    logger.info("vllm-runner: %d taps (%s): steps whose programs act only there run %s",
                len(runtime.taps), ", ".join(sorted(runtime.taps)),
                "compiled" if runtime.compiled else "eager, as every step of this engine")


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
