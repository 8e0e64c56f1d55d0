"""Start-up checks: unchecked vLLM releases are refused by name; so are a runner no adapter
reads and engine settings that split a step's rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm_runner import UnsupportedEngine
from vllm_runner.engine.compat import (
    CHECKED_VLLM,
    UNCHECKED_VARIABLE,
    check_engine_config,
    check_runner,
    check_version,
    refused_engine_settings,
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


def settings(**parallel: int | bool) -> SimpleNamespace:
    """An engine config with only the fields `check_engine_config` reads."""
    base = {"enable_dbo": False, "ubatch_size": 0, "prefill_context_parallel_size": 1,
            "decode_context_parallel_size": 1}
    return SimpleNamespace(parallel_config=SimpleNamespace(**{**base, **parallel}),
                           speculative_config=None)


def test_plain_engine_settings_pass() -> None:
    check_engine_config(settings())
    check_engine_config(settings(ubatch_size=1))


@pytest.mark.parametrize(("change", "named"), [
    ({"enable_dbo": True}, "enable_dbo"),
    ({"ubatch_size": 2}, "ubatch_size"),
    ({"prefill_context_parallel_size": 2}, "prefill_context_parallel_size=2"),
    ({"decode_context_parallel_size": 2}, "decode_context_parallel_size=2"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
])
def test_settings_that_split_a_steps_rows_are_refused_by_name(change: dict, named: str) -> None:
    with pytest.raises(UnsupportedEngine, match=named):
        check_engine_config(settings(**change))


def test_pipeline_parallelism_is_refused_before_vllm_starts() -> None:
    """A rank of a pipeline holds only some layers: refused from `LLM`'s own arguments, naming
    the setting and what to use instead, before any engine process starts."""
    from vllm_runner import LLM

    with pytest.raises(UnsupportedEngine, match=r"pipeline_parallel_size=2.*tensor_parallel_size"):
        LLM("/nonexistent/model", pipeline_parallel_size=2)
    assert refused_engine_settings({"pipeline_parallel_size": 1}) == []
    assert refused_engine_settings({}) == []


def test_speculative_decoding_is_refused_by_name() -> None:
    config = settings()
    config.speculative_config = SimpleNamespace(method="ngram")
    with pytest.raises(UnsupportedEngine, match="speculative_config"):
        check_engine_config(config)


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
    # A release without the V1 runner (0.34 on): no variable to name, vLLM refuses it itself.
    with pytest.raises(UnsupportedEngine, match=r"SomeOtherRunner$"):
        check_runner(SomeOtherRunner(), (V2,))


def test_the_v2_adapter_loads_where_vllm_has_no_v1_runner() -> None:
    """vLLM 0.34 removed `vllm.v1.worker.gpu_model_runner`: attaching and the V2 adapter must
    not import it (here it is made unimportable, as on 0.34)."""
    import subprocess
    import sys

    probe = ("import sys; sys.modules['vllm.v1.worker.gpu_model_runner'] = None; "
             "import vllm_runner.engine.attach as attach, vllm_runner.engine.v2_runner; "
             "print(attach.v1_runner_class())")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip().splitlines()[-1] == "None"


def test_the_gpu_worker_module_never_imports_vllms_cpu_worker() -> None:
    """vLLM's cpu_worker replaces torch's CUDA events, streams and pin_memory process-wide;
    a GPU worker process imports `vllm_runner.engine.worker`, so that module must not pull it in."""
    import subprocess
    import sys

    probe = ("import sys, vllm_runner.engine.worker; "
             "print('vllm.v1.worker.cpu_worker' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_the_server_command_refuses_an_unchecked_release_before_starting_anything(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import vllm
    from vllm_runner import cli
    monkeypatch.delenv(UNCHECKED_VARIABLE, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.19.1")
    assert cli.main(["serve", "some-model", "--port", "1"]) == 2
    refused = capsys.readouterr().err
    assert refused.startswith("vllm-interp serve: ") and "0.19.1" in refused


def test_our_code_imports_only_what_the_installed_vllm_has() -> None:
    """benchmarks/gpu/check_vllm_imports.py, as run before a GPU session against a staged
    release, passes against the vLLM this suite runs on."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[3] / "benchmarks" / "gpu" / "check_vllm_imports.py"
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    ran = subprocess.run([sys.executable, str(script), str(Path(spec.origin).parents[1])],
                         capture_output=True, text=True, check=False)
    assert ran.returncode == 0, ran.stdout + ran.stderr
