"""Start-up on a small machine (issue [H] item 1): a KV cache that fits when the user sized none,
the engine in this process on a CPU with one rank, and memory failures re-raised as our error
naming the argument to change. Runs no engine: vLLM's `LLM` is replaced by a recorder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import vllm
import vllm.envs
from vllm_runner.client import engine_start
from vllm_runner.client.engine_start import GIB, MULTIPROCESSING_VARIABLE, cpu_kv_cache_bytes, start
from vllm_runner.errors import EngineStartError


class Recorder:
    """Stands in for `vllm.LLM`: keeps its arguments and the multiprocessing setting it saw."""

    seen: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, model: str, **engine: Any) -> None:
        Recorder.seen.append({"model": model, **engine,
                              "multiprocessing": os.environ.get(MULTIPROCESSING_VARIABLE)})
        vllm.envs.enable_envs_cache()  # as vLLM's in-process engine does once it has started


@pytest.fixture
def recorder(monkeypatch) -> Iterator[type[Recorder]]:
    Recorder.seen = []
    monkeypatch.setattr(vllm, "LLM", Recorder)
    monkeypatch.delenv(MULTIPROCESSING_VARIABLE, raising=False)
    monkeypatch.delenv(engine_start.CPU_KV_CACHE_VARIABLE, raising=False)
    monkeypatch.setattr(engine_start, "_cpu_free_memory", lambda: (4 * GIB, 0))
    yield Recorder
    vllm.envs.disable_envs_cache()


def test_the_kv_cache_is_half_of_what_is_free_after_the_weights_at_most_two_gib() -> None:
    assert cpu_kv_cache_bytes(4 * GIB, GIB // 2, 1) == 5 * GIB // 4  # (4 - 0.5 - 1) / 2
    assert cpu_kv_cache_bytes(64 * GIB, 0, 1) == 2 * GIB             # capped
    assert cpu_kv_cache_bytes(4 * GIB, GIB // 2, 2) == GIB // 2      # (4 - 1 - 1) / 4 per rank
    with pytest.raises(EngineStartError, match="kv_cache_memory_bytes"):
        cpu_kv_cache_bytes(2 * GIB, 2 * GIB, 1)


def test_on_a_cpu_an_unsized_engine_gets_a_kv_cache_and_runs_in_this_process(
        recorder, tmp_path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1024)
    start(str(tmp_path), {}, on_cpu=True)
    (seen,) = recorder.seen
    assert seen["kv_cache_memory_bytes"] == (4 * GIB - 1024 - GIB) // 2 // 2**20 * 2**20
    assert seen["multiprocessing"] == "0"
    assert MULTIPROCESSING_VARIABLE not in os.environ  # restored for later engines,
    assert vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING is True  # and what vLLM reads too


@pytest.mark.parametrize("given", [{"gpu_memory_utilization": 0.3},
                                   {"kv_cache_memory_bytes": GIB},
                                   {"tensor_parallel_size": 2}])
def test_what_the_user_chose_is_kept(recorder, given) -> None:
    start("model", dict(given), on_cpu=True)
    (seen,) = recorder.seen
    if "tensor_parallel_size" in given:  # sized for two ranks, in vLLM's processes
        assert seen["multiprocessing"] is None and seen["kv_cache_memory_bytes"] > 0
    else:
        assert "kv_cache_memory_bytes" not in given or seen["kv_cache_memory_bytes"] == GIB
        assert "gpu_memory_utilization" not in given or "kv_cache_memory_bytes" not in seen


def test_the_variables_the_user_set_are_kept(recorder, monkeypatch) -> None:
    monkeypatch.setenv(MULTIPROCESSING_VARIABLE, "1")
    monkeypatch.setenv(engine_start.CPU_KV_CACHE_VARIABLE, "2")
    start("model", {}, on_cpu=True)
    (seen,) = recorder.seen
    assert seen["multiprocessing"] == "1" and "kv_cache_memory_bytes" not in seen


def test_nothing_is_chosen_on_a_gpu(recorder) -> None:
    start("model", {}, on_cpu=False)
    (seen,) = recorder.seen
    assert "kv_cache_memory_bytes" not in seen and seen["multiprocessing"] is None


@pytest.mark.parametrize("on_cpu, fix", [(True, "--kv-cache-memory-bytes"),
                                         (False, "--gpu-memory-utilization")])
def test_a_memory_failure_names_the_argument_to_change(monkeypatch, on_cpu, fix) -> None:
    def fails(model: str, **engine: Any) -> None:
        raise ValueError("Available memory on node 0 (8.6/10.46 GiB) on startup is less than "
                         "desired CPU memory utilization (0.92, 9.63 GiB).")

    monkeypatch.setattr(vllm, "LLM", fails)
    with pytest.raises(EngineStartError, match="lack of memory") as raised:
        start("model", {"gpu_memory_utilization": 0.92}, on_cpu=on_cpu)
    message = str(raised.value)
    assert fix in message and "8.6/10.46 GiB" in message
    assert message.index("To fix it") < message.index("8.6/10.46")  # our advice first


def test_other_failures_pass_through(monkeypatch) -> None:
    def fails(model: str, **engine: Any) -> None:
        raise OSError("no such model folder")

    monkeypatch.setattr(vllm, "LLM", fails)
    with pytest.raises(OSError, match="no such model"):
        start("model", {"gpu_memory_utilization": 0.5}, on_cpu=True)


@pytest.mark.parametrize(("on_cpu", "given", "expected"), [
    (True, {}, True), (True, {"enforce_eager": None}, True), (False, {}, None),
    (True, {"enforce_eager": False}, False), (False, {"enforce_eager": True}, True)])
def test_an_engine_is_eager_by_default_on_a_cpu_only(monkeypatch, on_cpu: bool,
                                                     given: dict[str, Any],
                                                     expected: bool | None) -> None:
    """`LLM` and `AsyncLLM` leave a GPU engine to vLLM's default (compiled, CUDA graphs) and
    start a CPU one eager, unless the user chose; the user's choice is kept either way."""
    from vllm.platforms import current_platform
    from vllm_runner.client.llm import prepare_engine

    monkeypatch.setattr(current_platform, "is_cpu", lambda: on_cpu)
    engine = dict(given)
    prepare_engine("some-model", engine, None, None)
    assert engine.get("enforce_eager") is expected
