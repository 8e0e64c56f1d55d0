"""Extraction over a Ray cluster into object storage (`vllm-interp extract --ray`): two engine
replicas write to an S3 server on 127.0.0.1 (moto's standalone server, reached over HTTP by
s3fs, as any S3-compatible service is) what one engine writes to a local folder; a replica
killed mid-run, or the driver killed and the command run again, still gives every shard once.

"Once" is read from the bucket itself: it keeps every version of every object, so a shard
uploaded twice would show two versions. Each run is the command as a user types it, with the
variables an S3-compatible service needs (docs/scaling.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from conftest import EXTRACTED_LOCATIONS, user_environment
from test_extract import _assert_equal_to_memory
from vllm_runner.cli.extract import extract, load

#: The replicas' engines are the command's own, eager; the suite's engine is only the oracle, so
#: the suite's compiled pass leaves the module out (conftest).
pytestmark = pytest.mark.first_pass_only

#: What Ray names a replica's process (`ray::` and the actor's class, as Ray Data wraps it).
REPLICA_PROCESS = "MapWorker(MapBatches(Replica))"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint():
    """An S3 server of its own on 127.0.0.1 for the module (moto's standalone server)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch):
    """A new bucket that keeps every version of its objects; this process reads it with s3fs
    through the same variables the command gets."""
    import boto3

    for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(name, value)
    name = f"activations-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3", endpoint_url=s3_endpoint, **{
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"]})
    client.create_bucket(Bucket=name)
    client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return client, name


@pytest.fixture
def command(extraction_prompts, model_dir: str, tmp_path, bucket
            ) -> tuple[list[str], dict[str, str], str]:
    """The command, its environment and its output URL: 50 prompts in 13 units of 4 over two
    replicas."""
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("\n".join(extraction_prompts) + "\n")
    url = f"s3://{bucket[1]}/run"
    arguments = [sys.executable, "-m", "vllm_runner.cli", "extract", "--model", model_dir,
                 "--prompts", str(prompt_file), "--save", ",".join(EXTRACTED_LOCATIONS),
                 "--out", url, "--shard-size", "4", "--max-model-len", "128", "--dtype", "float32",
                 "--ray", "--replicas", "2"]
    environment = {**user_environment(), **CREDENTIALS,
                   "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"]}
    return arguments, environment, url


def _versions(bucket) -> dict[str, int]:
    """How many times each object of the bucket was written."""
    client, name = bucket
    counts: dict[str, int] = {}
    for page in client.get_paginator("list_object_versions").paginate(Bucket=name):
        for version in page.get("Versions", []):
            counts[version["Key"]] = counts.get(version["Key"], 0) + 1
    return counts


def _shards(bucket) -> dict[str, int]:
    return {key: count for key, count in _versions(bucket).items()
            if key.endswith(".safetensors")}


def _wait_for_shards(bucket, count: int, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(_shards(bucket)) < count:
        assert process.poll() is None, "the run ended before the kill"
        assert time.monotonic() < deadline, f"fewer than {count} shards after {timeout} s"
        time.sleep(0.2)


def _assert_every_shard_once(bucket, extraction_prompts) -> None:
    shards = _shards(bucket)
    assert len(shards) == -(-len(extraction_prompts) // 4), sorted(shards)
    assert set(shards.values()) == {1}, {k: n for k, n in shards.items() if n != 1}


def test_two_replicas_write_what_one_engine_writes(llm, extraction_prompts, extraction_saves,
                                                   command, bucket, tmp_path) -> None:
    arguments, environment, url = command
    finished = subprocess.run(arguments, env=environment, capture_output=True, text=True,
                              timeout=600)
    assert finished.returncode == 0, finished.stderr[-4000:]
    assert "extract: 100%" in finished.stderr  # one progress bar for the whole run
    _assert_every_shard_once(bucket, extraction_prompts)
    records = list(load(url))
    _assert_equal_to_memory(records, extraction_saves)
    one = extract(llm, extraction_prompts, EXTRACTED_LOCATIONS, tmp_path / "one", shard_size=4,
                  progress=False)
    for spread, alone in zip(records, load(one), strict=True):
        assert set(spread) == set(alone)
        torch.testing.assert_close(spread["token_ids"], alone["token_ids"], rtol=0, atol=0)
        for key in set(alone) - {"index", "token_ids"}:
            torch.testing.assert_close(spread[key], alone[key], rtol=1e-5, atol=1e-5)
    manifests = [json.loads((tmp_path / "one" / "manifest.json").read_text())]
    import fsspec

    with fsspec.open(f"{url}/manifest.json") as file:
        manifests.append(json.load(file))
    assert manifests[0]["shards"] == manifests[1]["shards"]
    assert {**manifests[0]["settings"], "model": None} == {**manifests[1]["settings"],
                                                          "model": None}


def test_a_replica_killed_mid_run_is_replaced_and_no_unit_runs_twice(
        extraction_prompts, extraction_saves, command, bucket, tmp_path) -> None:
    arguments, environment, url = command
    with _running(arguments, environment, tmp_path / "run.log") as run:
        _wait_for_shards(bucket, 2, run)
        # This run's (the Ray cluster the driver started is its child, the replicas its).
        replicas = [process for process in psutil.Process(run.pid).children(recursive=True)
                    if REPLICA_PROCESS in " ".join(process.cmdline())]
        assert len(replicas) == 2, [p.cmdline() for p in replicas]
        replicas[0].kill()
        written_at_kill = len(_shards(bucket))
        run.wait(timeout=600)
    assert written_at_kill < 13, "the run was over before the kill: nothing was tested"
    assert run.returncode == 0, (tmp_path / "run.log").read_text()[-4000:]
    _assert_every_shard_once(bucket, extraction_prompts)
    _assert_equal_to_memory(list(load(url)), extraction_saves)


def test_a_run_whose_driver_was_killed_resumes_with_every_unit_once(
        extraction_prompts, extraction_saves, command, bucket, tmp_path) -> None:
    arguments, environment, url = command
    with _running(arguments, environment, tmp_path / "run.log") as run:
        _wait_for_shards(bucket, 3, run)
        # The driver and the Ray cluster it started, as when its machine goes down.
        os.killpg(run.pid, signal.SIGKILL)
    written_at_kill = len(_shards(bucket))
    assert written_at_kill < 13, "the run was over before the kill: nothing was tested"
    with pytest.raises(ValueError, match="of 13 shards written"):
        list(load(url))
    resumed = subprocess.run(arguments, env=environment, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    _assert_every_shard_once(bucket, extraction_prompts)
    _assert_equal_to_memory(list(load(url)), extraction_saves)


@contextlib.contextmanager
def _running(arguments: list[str], environment: dict[str, str], log: Path
             ) -> Iterator[subprocess.Popen]:
    """The command running in a session of its own, its output in `log` (a pipe nobody reads
    could fill and stop it); killed with the Ray cluster it started if it still runs at the
    end."""
    with log.open("w") as output:
        run = subprocess.Popen(arguments, env=environment, stdout=output,
                               stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield run
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
            run.wait()


def test_a_bad_location_on_the_replicas_is_one_line_and_exit_2(command, tmp_path) -> None:
    """Found only where an engine runs (a replica), it reaches the user as our own error, not
    as Ray's wrapping of it."""
    arguments, environment, _ = command
    arguments = [*arguments[:arguments.index("--save") + 1], "layers.9.layer_output",
                 *arguments[arguments.index("--save") + 2:]]
    finished = subprocess.run(arguments, env=environment, capture_output=True, text=True,
                              timeout=600)
    assert finished.returncode == 2, finished.stderr[-4000:]
    last = finished.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm-interp extract: 'layers.9.layer_output': layer 9"), last
    assert "Traceback" not in finished.stderr


@pytest.mark.parametrize(("given", "chosen"), [
    ({"TMPDIR": "/tmp/" + "x" * 60}, "/tmp"),  # a test runner's or a scheduler's
    ({"TMPDIR": "/tmp/" + "x" * 60, "RAY_TMPDIR": "/scratch/ray"}, "/scratch/ray"),
    ({"TMPDIR": "/tmp/short"}, None),
    ({}, None),
])
def test_ray_sockets_are_kept_under_linuxs_path_limit(monkeypatch: pytest.MonkeyPatch,
                                                      given: dict, chosen: str | None) -> None:
    """A local Ray cluster under a long `TMPDIR` failed to start or hung (seen in CI, whose
    temporary folder is nox's); `/tmp` is chosen then, and a user's `RAY_TMPDIR` kept."""
    from vllm_runner.cli.extract_ray import fit_ray_socket_paths

    for name in ("TMPDIR", "RAY_TMPDIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    fit_ray_socket_paths()
    assert os.environ.get("RAY_TMPDIR") == chosen
