"""vllm-runner: per-request interpretability programs inside vLLM's model runner.

`LLM` is vLLM's offline engine with `interventions=` on `generate`, `AsyncLLM` its asyncio
engine (what `vllm serve` runs on) with the same; `ops` holds what a program can do. Programs
travel as plain data in `SamplingParams.extra_args`, run on each request's own rows inside the
worker (tokenspan for rows, vllm-envoys for standard values), and saved values
come back per request.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from vllm_runner import ops
from vllm_runner.errors import (
    EngineDied,
    EngineStartError,
    InterpError,
    InterventionError,
    LocationError,
    SAEsRefused,
    TapsRefused,
    UnsupportedEngine,
)

if TYPE_CHECKING:
    from vllm_runner.client.async_llm import AsyncLLM
    from vllm_runner.client.llm import LLM


def __getattr__(name: str) -> Any:
    """`LLM` and `AsyncLLM` are imported on first use, not with the package: importing vLLM
    configures its logging, which the `vllm-interp` command must set first (quiet, on stderr)."""
    if name == "LLM":
        from vllm_runner.client.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from vllm_runner.client.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'vllm_runner' has no attribute {name!r}")


try:
    __version__ = version("vllm-runner")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["LLM", "AsyncLLM", "EngineDied", "EngineStartError", "InterpError", "InterventionError",
           "LocationError", "SAEsRefused", "TapsRefused", "UnsupportedEngine", "__version__", "ops"]
