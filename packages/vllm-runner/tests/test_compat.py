"""Start-up checks: unchecked vLLM releases are refused by name; the model runner is V1 unless
the user chose; a runner no adapter reads is refused."""

from __future__ import annotations

import pytest
from vllm_runner import UnsupportedEngine
from vllm_runner.compat import (
    CHECKED_VLLM,
    UNCHECKED_VARIABLE,
    V2_VARIABLE,
    check_runner,
    check_version,
    select_runner,
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


@pytest.mark.parametrize("asked", ["1", "true", "True", "0"])
def test_the_users_choice_of_runner_is_kept(monkeypatch: pytest.MonkeyPatch, asked: str) -> None:
    import os

    monkeypatch.setenv(V2_VARIABLE, asked)
    select_runner()
    assert os.environ[V2_VARIABLE] == asked


def test_v1_is_selected_for_the_engine_processes_unless_the_user_chose(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.delenv(V2_VARIABLE, raising=False)
    select_runner()
    assert os.environ[V2_VARIABLE] == "0"


def test_a_runner_no_adapter_reads_is_refused_by_class_name() -> None:
    class V1:
        pass

    class V2:
        pass

    class SomeOtherRunner:
        pass

    check_runner(V1(), (V1, V2))
    check_runner(V2(), (V1, V2))
    with pytest.raises(UnsupportedEngine, match=r"SomeOtherRunner.*VLLM_USE_V2_MODEL_RUNNER=0"):
        check_runner(SomeOtherRunner(), (V1, V2))


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
