"""The `vllm-interp` command: `--help` for each subcommand, `support`'s table, bad arguments
refused before any engine starts, and `demo` end to end on the embedded model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import as_in_a_terminal, user_environment
from vllm_runner.cli import build_parser, support_table

COMMAND = [sys.executable, "-m", "vllm_runner.cli"]


@pytest.mark.parametrize("subcommand", ["demo", "extract", "support"])
def test_every_subcommand_has_help(subcommand: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([subcommand, "--help"])
    assert exit_info.value.code == 0
    assert "--model" in capsys.readouterr().out


def test_bad_positions_are_refused_by_the_parser(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["extract", "--prompts", "p", "--save", "x", "--out", "o",
                                   "--positions", "last"])
    assert "comma-separated integers" in capsys.readouterr().err


@pytest.mark.parametrize(("given", "said"), [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--ray", "--replicas", "0"], "--replicas must be at least 1"),
])
def test_replicas_without_ray_or_below_one_are_refused_before_any_engine(
        given: list[str], said: str, tmp_path, capsys) -> None:
    from vllm_runner import cli
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["extract", "--prompts", str(prompts), "--save", "logits", "--out",
                  str(tmp_path / "out"), *given])
    assert exit_info.value.code == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_support_table_groups_layers_and_gives_reasons(llm) -> None:
    table = support_table(llm.support())
    lines = {line.split()[0]: line for line in table.splitlines()[1:] if not line.startswith(" ")}
    assert lines["layer_output"].split()[-1] == "0-2"
    assert lines["logits"].split()[-1] == "model"
    assert lines["mlp.mlp_activation"].split()[-1] == "-"
    assert "not gated" not in table and "this MLP is gated" in table


def test_engine_arguments_pass_through_typed(capsys) -> None:
    arguments = build_parser().parse_args(
        ["support", "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", "1048576",
         "--engine-arg", "max_num_seqs=16", "--engine-arg", "enable-prefix-caching=false",
         "--engine-arg", "served_model_name=tiny"])
    assert arguments.gpu_memory_utilization == 0.3
    assert arguments.kv_cache_memory_bytes == 2**20
    assert dict(arguments.engine_arg) == {"max_num_seqs": 16, "enable_prefix_caching": False,
                                          "served_model_name": "tiny"}
    for bad in (["--gpu-memory-utilization", "1.5"], ["--engine-arg", "no-equals-sign"]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["support", *bad])
        assert exit_info.value.code == 2
    assert "expected" in capsys.readouterr().err


@pytest.mark.parametrize(("given", "eager"), [([], True),
                                             (["--engine-arg", "enforce_eager=false"], False)])
def test_the_commands_engines_run_eager_unless_asked(monkeypatch, given: list[str],
                                                     eager: bool) -> None:
    """Every request of `demo`, `extract` and `support` runs a program where no tap serves, so
    compiling would buy nothing: eager on a GPU too, unless the user says otherwise."""
    import vllm_runner.client.llm
    from vllm_runner import cli
    started: list[dict] = []
    monkeypatch.setattr(vllm_runner.client.llm, "LLM",
                        lambda model, **engine: started.append(engine))
    cli._llm(build_parser().parse_args(["support", *given]))
    assert started[0]["enforce_eager"] is eager


def _command(*arguments: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *arguments], env=user_environment(),
                          capture_output=True, text=True, timeout=timeout)


def test_support_prints_only_its_table_and_vllm_is_quiet(model_dir: str) -> None:
    completed = _command("support", "--model", model_dir)
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = completed.stdout.splitlines()
    assert lines[0].split() == ["value", "available"]
    assert all(not line or line[0] in " abcdefghijklmnopqrstuvwxyz_" for line in lines), lines
    assert not [line for line in lines if "WARNING" in line or "INFO" in line]
    assert "INFO" not in completed.stderr and "WARNING" not in completed.stderr


def test_a_bad_location_is_one_line_and_exit_2(model_dir: str, tmp_path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    completed = _command("extract", "--model", model_dir, "--prompts", str(prompts), "--save",
                         "layers.0.mlp_nurons", "--out", str(tmp_path / "out"))
    assert completed.returncode == 2, completed.stderr[-3000:]
    assert completed.stderr.strip().splitlines() == [
        line for line in completed.stderr.strip().splitlines() if "Traceback" not in line]
    assert completed.stderr.strip().splitlines()[-1].startswith(
        "vllm-interp extract: 'layers.0.mlp_nurons' is not a location")


def test_extract_writes_an_saes_sparse_features(model_dir: str, sae_dirs, tmp_path) -> None:
    """`vllm-interp extract --sae NAME=PATH --top-k K`, as a user runs it: the engine loads the
    SAE, and each prompt's shard entries are its top features per token (no --save needed)."""
    from vllm_runner.cli.extract import load

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nthe cat sat\n")
    completed = _command("extract", "--model", model_dir, "--prompts", str(prompts), "--sae",
                         f"res1={sae_dirs['res1']}", "--top-k", "5", "--out", str(tmp_path / "o"))
    assert completed.returncode == 0, completed.stderr[-3000:]
    records = list(load(tmp_path / "o"))
    assert [set(record) for record in records] == [
        {"index", "token_ids", "res1.features.indices", "res1.features.values"}] * 2
    for record in records:
        assert record["res1.features.values"].shape == (len(record["token_ids"]), 5)
        assert bool((record["res1.features.indices"] >= 0).any())


def test_other_extraction_settings_are_refused_before_the_engine_starts(tmp_path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"settings": {"shard_size": 3}, "shards": []}))
    started = time.monotonic()
    completed = _command("extract", "--model", "no-such-model", "--prompts", str(prompts),
                         "--save", "layers.0.layer_output", "--out", str(out))
    assert completed.returncode == 2
    assert "holds an extraction with other settings" in completed.stderr
    assert "Traceback" not in completed.stderr
    assert time.monotonic() - started < 30  # no engine was started (no such model either)


def test_ctrl_c_stops_extract_with_one_line_and_exit_130_and_it_resumes(model_dir,
                                                                          tmp_path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt number {i} is here\n" for i in range(400)))
    out = tmp_path / "out"
    arguments = [*COMMAND, "extract", "--model", model_dir, "--prompts", str(prompts), "--save",
                 "layers.*.layer_output", "--out", str(out), "--shard-size", "8"]
    child = subprocess.Popen(arguments, env=user_environment(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True,
                             preexec_fn=as_in_a_terminal)
    try:
        deadline = time.monotonic() + 240
        while not (out / "shard-00001.safetensors").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(child.pid, signal.SIGINT)
        sent = time.monotonic()
        _, stderr = child.communicate(timeout=60)
        assert time.monotonic() - sent < 30
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    assert child.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "vllm-interp extract: interrupted. Run the same command again to resume: finished "
        "shards are kept.")
    resumed = subprocess.run(arguments, env=user_environment(), capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert [shard["index"] for shard in manifest["shards"]] == list(range(50))


def test_demo_runs_end_to_end_on_the_embedded_model(tmp_path) -> None:
    completed = subprocess.run([*COMMAND, "demo", "--out", str(tmp_path / "demo")],
                               env=user_environment(), capture_output=True, text=True,
                               timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "1. Steering at layers." in completed.stdout
    assert "2. Logit lens" in completed.stdout
    # docs/cli.md shows what it prints: the page must be what a user sees.
    page = (Path(__file__).parents[3] / "docs" / "cli.md").read_text()
    shown = page.split("What it printed on this machine")[1].split("```")[1].strip("\n")
    assert shown in completed.stdout, completed.stdout
    for figure in ("logit_lens.png", "attention_pattern.png"):
        data = (tmp_path / "demo" / figure).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000, figure
    print(completed.stdout)


def test_a_failed_prompt_in_extract_is_one_line_and_exit_1(monkeypatch, tmp_path,
                                                            capsys) -> None:
    from vllm_runner import cli
    failed = SimpleNamespace(
        error="save at layers.0.layer_output: positions [-50] are before the start",
        prompt_token_ids=[1, 2], saved={})

    class Engine:  # what extract needs of an LLM, whose one request failed
        def resolve(self, patterns):
            return {}

        def generate(self, *args, **kwargs):
            return [failed]

    monkeypatch.setattr(cli, "_llm", lambda arguments, saes=None: Engine())
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi\n")
    code = cli.main(["extract", "--prompts", str(prompts), "--save", "layers.0.layer_output",
                     "--out", str(tmp_path / "out"), "--positions", "-50"])
    assert code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "vllm-interp extract: prompt 0 ('hi'): save at layers.0.layer_output: positions [-50] "
        "are before the start")


@pytest.mark.parametrize("hiding", [UnboundLocalError, ValueError])
def test_ctrl_c_hidden_by_an_error_in_cleanup_is_still_one_line_and_exit_130(
        monkeypatch, tmp_path, capsys, hiding: type[Exception]) -> None:
    # vLLM 0.32's tokenizer pool, interrupted between `try:` and taking a tokenizer, fails in
    # its `finally` and raises UnboundLocalError with the KeyboardInterrupt as its context.
    from vllm_runner import cli
    def interrupted_in_cleanup(parser, arguments):
        try:
            raise KeyboardInterrupt
        finally:
            raise hiding("cannot access local variable 'tok'")

    monkeypatch.setattr(cli, "_run", interrupted_in_cleanup)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi\n")
    code = cli.main(["extract", "--prompts", str(prompts), "--save", "layers.0.layer_output",
                     "--out", str(tmp_path / "out")])
    assert code == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "vllm-interp extract: interrupted. Run the same command again to resume: finished "
        "shards are kept."]


def test_an_error_not_raised_during_ctrl_c_is_not_called_an_interruption(monkeypatch,
                                                                          tmp_path) -> None:
    from vllm_runner import cli
    def fails(parser, arguments):
        raise UnboundLocalError("a bug of ours")

    monkeypatch.setattr(cli, "_run", fails)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi\n")
    with pytest.raises(UnboundLocalError, match="a bug of ours"):
        cli.main(["extract", "--prompts", str(prompts), "--save", "layers.0.layer_output",
                  "--out", str(tmp_path / "out")])
