"""`vllm-interp serve`: the `vllm serve` argv it builds (`server.command`), `VLLM_PLUGINS`
(`plugins_setting`) and the tensor-parallel size it reads (`_ranks`); no engine is started."""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys

import pytest
from vllm_runner.server import command as module
from vllm_runner.server.command import (
    _ranks,
    plugins_setting,
    serve_command,
    with_additional_config,
)
from vllm_runner.settings import GRAPH_TAPS_KEY, SAES_KEY, TAPS_KEY

MODEL = "/models/tiny-llama"
KV_BYTES = 3 * 2**30


def values_of(command: list[str], option: str) -> list[str]:
    """Every value given to `option`, as `--option value` or `--option=value`."""
    found = [command[index + 1] for index, item in enumerate(command[:-1]) if item == option]
    return found + [item.split("=", 1)[1] for item in command if item.startswith(f"{option}=")]


@pytest.mark.parametrize(("on_cpu", "worker"), [
    (True, "vllm_runner.engine.cpu_worker.InterpCPUWorker"),
    (False, "vllm_runner.engine.worker.InterpGPUWorker")])
def test_command_is_vllm_serve_with_the_interp_worker_eager_on_a_cpu_only(on_cpu: bool,
                                                                           worker: str) -> None:
    """As `LLM`'s default: eager on a CPU; on a GPU vLLM's own (compiled, CUDA graphs)."""
    options = ["--port", "8123", "--dtype", "float32"]
    command = serve_command(MODEL, options, on_cpu=on_cpu, kv_cache_bytes=KV_BYTES)
    assert command[:2] == ["serve", MODEL]
    assert command[2:2 + len(options)] == options  # the user's options, in their order
    assert values_of(command, "--worker-cls") == [worker]
    assert command.count("--enforce-eager") == (1 if on_cpu else 0)
    assert "--no-enforce-eager" not in command


@pytest.mark.parametrize("on_cpu", [True, False])
def test_worker_paths_name_real_classes(on_cpu: bool) -> None:
    path = values_of(serve_command(MODEL, [], on_cpu, None), "--worker-cls")[0]
    module_name, _, class_name = path.rpartition(".")
    # In a process of its own: importing vLLM's CPU worker swaps torch's CUDA streams and events
    # for CPU stand-ins in the whole process, which broke every later GPU engine of the suite.
    found = subprocess.run([sys.executable, "-c", f"import {module_name} as m; "
                            f"print(isinstance(m.{class_name}, type))"],
                           capture_output=True, text=True, timeout=300)
    assert found.stdout.strip() == "True", found.stderr[-2000:]


@pytest.mark.parametrize("given", [["--worker-cls", "my.Worker"], ["--worker-cls=my.Worker"]])
@pytest.mark.parametrize("on_cpu", [True, False])
def test_users_worker_cls_is_kept_and_not_added_again(given: list[str], on_cpu: bool) -> None:
    command = serve_command(MODEL, given, on_cpu, KV_BYTES)
    assert values_of(command, "--worker-cls") == ["my.Worker"]
    assert module.CPU_WORKER not in command and module.GPU_WORKER not in command


@pytest.mark.parametrize("on_cpu", [True, False])
def test_users_enforce_eager_is_not_duplicated(on_cpu: bool) -> None:
    command = serve_command(MODEL, ["--enforce-eager", "--port", "1"], on_cpu, KV_BYTES)
    assert command.count("--enforce-eager") == 1
    assert command.index("--enforce-eager") == 2  # the user's own, where they put it


@pytest.mark.parametrize("given", [["--no-enforce-eager"], ["--port", "1", "--no-enforce-eager"]])
@pytest.mark.parametrize("on_cpu", [True, False])
def test_no_enforce_eager_runs_vllms_compiled_engine(given: list[str], on_cpu: bool) -> None:
    """As `LLM(enforce_eager=False)`: the user's choice is kept and no `--enforce-eager` added."""
    command = serve_command(MODEL, given, on_cpu, KV_BYTES)
    assert "--enforce-eager" not in command and command.count("--no-enforce-eager") == 1


def test_taps_become_the_engines_additional_config_merged_into_the_users() -> None:
    options = ["--port", "1", "--interp-taps", "layers.*.layer_output, layers.1.mlp_neurons",
               "--additional-config={\"mine\": 1}", "--interp-graph-taps=layers.*.layer_output"]
    changed = with_additional_config(options)
    (config,) = values_of(changed, "--additional-config")
    assert json.loads(config) == {
        "mine": 1, TAPS_KEY: ["layers.*.layer_output", "layers.1.mlp_neurons"],
        GRAPH_TAPS_KEY: ["layers.*.layer_output"]}
    assert changed[:2] == ["--port", "1"] and not any("--interp-" in one for one in changed)
    assert with_additional_config(["--port", "1", "--additional-config", "{}"]) == [
        "--port", "1", "--additional-config", "{}"]  # no taps: the user's options as given


def test_each_interp_sae_becomes_one_of_the_engines_saes(tmp_path, monkeypatch) -> None:
    """`--interp-sae NAME=PATH`, once per SAE, as `LLM(saes=...)`: absolute paths in the
    engine's own config, beside the taps; a path that does not exist, a name given twice or a
    value without `=` is refused by name."""
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path)
    changed = with_additional_config([
        "--interp-sae", "res1=a", f"--interp-sae=mlp0={tmp_path / 'a'}",
        "--interp-sae", "gs=a@blocks.3.hook_resid_post", "--interp-taps", "layers.0.layer_output"])
    (config,) = values_of(changed, "--additional-config")
    assert json.loads(config)[SAES_KEY] == {
        "res1": {"path": str(tmp_path / "a"), "site": None},
        "mlp0": {"path": str(tmp_path / "a"), "site": None},
        "gs": {"path": str(tmp_path / "a"), "site": "blocks.3.hook_resid_post"}}
    assert TAPS_KEY in json.loads(config)
    for bad, named in ((["--interp-sae", "res1"], "give NAME=PATH"),
                       (["--interp-sae", "a@b=a"], "not a usable SAE name"),
                       (["--interp-sae", "x=a", "--interp-sae", "x=a"], "given twice"),
                       (["--interp-sae", f"x={tmp_path / 'missing'}"], "does not exist")):
        with pytest.raises(ValueError, match=named):
            with_additional_config(bad)


@pytest.mark.parametrize(("given", "named"), [
    (["--interp-taps"], "--interp-taps needs a value"),
    (["--interp-taps", " , "], "give location patterns"),
    (["--interp-taps", "layers.0.layer_output", "--additional-config", "[1]"], "a JSON object"),
    (["--interp-graph-taps=x", "--additional-config", "{oops"], "is not JSON")])
def test_bad_tap_options_are_refused_naming_them(given: list[str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        with_additional_config(given)


def test_cpu_gets_a_kv_cache_when_the_user_sized_none() -> None:
    command = serve_command(MODEL, ["--port", "1"], on_cpu=True, kv_cache_bytes=KV_BYTES)
    assert values_of(command, "--kv-cache-memory-bytes") == [str(KV_BYTES)]


def test_gpu_gets_no_kv_cache_option() -> None:
    command = serve_command(MODEL, ["--port", "1"], on_cpu=False, kv_cache_bytes=KV_BYTES)
    assert values_of(command, "--kv-cache-memory-bytes") == []


def test_cpu_without_a_computed_size_adds_none() -> None:
    command = serve_command(MODEL, [], on_cpu=True, kv_cache_bytes=None)
    assert values_of(command, "--kv-cache-memory-bytes") == []


@pytest.mark.parametrize("sized", [
    ["--gpu-memory-utilization", "0.5"], ["--gpu-memory-utilization=0.5"],
    ["--kv-cache-memory-bytes", "1000"], ["--kv-cache-memory-bytes=1000"]])
def test_cpu_kv_cache_the_user_sized_is_left_alone(sized: list[str]) -> None:
    command = serve_command(MODEL, sized, on_cpu=True, kv_cache_bytes=KV_BYTES)
    assert str(KV_BYTES) not in command
    assert command[2:2 + len(sized)] == sized
    assert len(values_of(command, "--kv-cache-memory-bytes")) == ("kv-cache" in sized[0])


def test_similar_option_names_do_not_count_as_given() -> None:
    command = serve_command(MODEL, ["--worker-cls-extra", "x", "--enforce-eager-ish"],
                            on_cpu=True, kv_cache_bytes=KV_BYTES)
    assert values_of(command, "--worker-cls") == [module.CPU_WORKER]
    assert command.count("--enforce-eager") == 1


def test_serve_command_does_not_change_the_options_given() -> None:
    options = ["--port", "1"]
    serve_command(MODEL, options, on_cpu=True, kv_cache_bytes=KV_BYTES)
    assert options == ["--port", "1"]


def test_plugins_setting_unset_names_only_ours() -> None:
    assert plugins_setting(None) == "vllm_interp"
    assert plugins_setting("") == "vllm_interp"


def test_plugins_setting_keeps_the_users_plugins_first() -> None:
    assert plugins_setting("a,b") == "a,b,vllm_interp"


@pytest.mark.parametrize("current", ["vllm_interp", "a,vllm_interp", "vllm_interp,b"])
def test_plugins_setting_adds_no_duplicate(current: str) -> None:
    setting = plugins_setting(current)
    assert setting.split(",").count("vllm_interp") == 1
    assert set(setting.split(",")) == set(current.split(","))


@pytest.mark.parametrize(("options", "ranks"), [
    (["--tensor-parallel-size", "2"], 2),
    (["--port", "1", "-tp=4"], 4),
    (["-tp", "8", "--port", "1"], 8),
    (["--tensor-parallel-size=3"], 3),
    (["--port", "1"], 1),
    ([], 1)])
def test_ranks_reads_the_tensor_parallel_size(options: list[str], ranks: int) -> None:
    assert _ranks(options) == ranks


def test_serve_main_imports() -> None:
    serve_main = importlib.import_module("vllm_runner.server.main")
    assert callable(serve_main.main)


def test_every_interp_option_is_named_in_the_help_and_on_the_cli_page() -> None:
    from pathlib import Path

    from vllm_runner import cli
    from vllm_runner.server.settings import OPTIONS

    page = (Path(__file__).parents[3] / "docs" / "cli.md").read_text()
    described = inspect.getsource(cli)
    missing = [option for option in OPTIONS if option not in page or option not in described]
    assert not missing, f"not documented in docs/cli.md and the serve help: {missing}"
