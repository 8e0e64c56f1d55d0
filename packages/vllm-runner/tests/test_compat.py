"""Start-up checks: unchecked vLLM releases and the V2 model runner are refused by name."""

from __future__ import annotations

import pytest
from vllm_runner import UnsupportedEngine
from vllm_runner.compat import (
    CHECKED_VLLM,
    UNCHECKED_VARIABLE,
    V2_VARIABLE,
    check_runner,
    check_version,
    select_v1_runner,
)


def test_checked_releases_pass_with_or_without_a_build_label() -> None:
    for release in CHECKED_VLLM:
        check_version(release)
        check_version(f"{release}+cpu")


def test_an_unchecked_release_is_refused_naming_the_checked_ones_and_the_way_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UNCHECKED_VARIABLE, raising=False)
    with pytest.raises(UnsupportedEngine) as refused:
        check_version("0.19.1")
    message = str(refused.value)
    assert "0.19.1" in message and UNCHECKED_VARIABLE in message
    assert all(release in message for release in CHECKED_VLLM)
    monkeypatch.setenv(UNCHECKED_VARIABLE, "1")
    check_version("0.19.1")


@pytest.mark.parametrize("asked", ["1", "true", "True"])
def test_an_explicit_v2_runner_is_refused_with_the_setting_that_selects_v1(
        monkeypatch: pytest.MonkeyPatch, asked: str) -> None:
    monkeypatch.setenv(V2_VARIABLE, asked)
    with pytest.raises(UnsupportedEngine, match=f"{V2_VARIABLE}=0"):
        select_v1_runner()


@pytest.mark.parametrize("asked", [None, "0"])
def test_v1_is_selected_for_the_engine_processes(monkeypatch: pytest.MonkeyPatch,
                                                 asked: str | None) -> None:
    if asked is None:
        monkeypatch.delenv(V2_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(V2_VARIABLE, asked)
    select_v1_runner()
    import os

    assert os.environ[V2_VARIABLE] == "0"


def test_a_runner_that_is_not_v1_is_refused_by_class_name() -> None:
    class V1:
        pass

    class SomeOtherRunner:
        pass

    check_runner(V1(), V1)
    with pytest.raises(UnsupportedEngine, match=r"SomeOtherRunner.*VLLM_USE_V2_MODEL_RUNNER=0"):
        check_runner(SomeOtherRunner(), V1)


def test_the_gpu_worker_module_never_imports_vllms_cpu_worker() -> None:
    """vLLM's cpu_worker replaces torch's CUDA events, streams and pin_memory process-wide;
    a GPU worker process imports `vllm_runner.worker`, so that module must not pull it in."""
    import subprocess
    import sys

    probe = ("import sys, vllm_runner.worker; "
             "print('vllm.v1.worker.cpu_worker' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip().splitlines()[-1] == "False"
