"""Putting the interpretability runner in front of the model runner vLLM built.

The worker lets vLLM build its own model runner, then swaps the runner's class for one with the
adapter's mixin in front: `vllm_v1_runner.RunnerMixin` for the V1 runner (and the CPU runner,
which subclasses it), `vllm_v2_runner.RunnerV2Mixin` for the V2 runner. Any other runner is
refused, and so are engine settings no adapter reads (`compat.check_engine_config`).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1ModelRunner

from vllm_runner.compat import check_engine_config, check_runner
from vllm_runner.vllm_v1_runner import RunnerMixin


def attach(runner: Any) -> None:
    """Swap `runner`'s class for one with its adapter's mixin in front."""
    check_engine_config(runner.vllm_config)
    mixin: type
    if isinstance(runner, V1ModelRunner):
        mixin = RunnerMixin
    else:
        # Imported only for a runner that is not V1: vLLM's V2 module loads Triton kernels, which
        # a V1 worker (every CPU one) never needs.
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2ModelRunner

        from vllm_runner.vllm_v2_runner import RunnerV2Mixin

        check_runner(runner, (V1ModelRunner, V2ModelRunner))
        mixin = RunnerV2Mixin
    base = type(runner)
    runner.__class__ = type(f"Interp{base.__name__}", (mixin, base), {})
