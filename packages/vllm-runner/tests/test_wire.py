"""Collected saves cross processes as plain data: through vLLM's own msgpack transport (engine
core to client) and pickle (worker to engine core) every tensor comes back equal, with its dtype
and shape, in writable memory of its own; the worker sends memoryviews only where msgpack is
the whole way."""

from __future__ import annotations

import errno
import multiprocessing
import os
import pickle
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult
from vllm_runner.engine.worker import WorkerRPC
from vllm_runner.saves import host_copies, shm_files, wire
from vllm_runner.saves.per_process import PerProcess
from vllm_runner.settings import SHARED_SAVES_VARIABLE, shared_saves_memory


def left_behind() -> list[str]:
    """This process's files in shared memory that still exist."""
    return [name for name in os.listdir(shm_files.DIRECTORY)
            if name.startswith(f"vllm-interp-{os.getpid()}-")]


def collected() -> wire.Collected:
    return {"a": {"error": None,
                  "saved": {"layers.0.layer_output": torch.randn(1, 7, 5),
                            "layers.0.mlp_neurons": torch.randn(1, 7, 9).bfloat16(),
                            "next_token_ids": torch.arange(3).reshape(1, 3),
                            "strided": torch.randn(5, 7).t().unsqueeze(0),
                            "empty": torch.empty(1, 0, 4)}},
            "b": {"error": "save at layers.9: no such layer", "saved": {}}}


def moved(sent: wire.Collected, into: Any = None) -> wire.Collected:
    """A copy of `sent` after its tensors moved to the host as a collection moves them
    (`SaveStore.collect`): each request's `into` its places in a file, if given."""
    copied = {key: {**result, "saved": dict(result["saved"])} for key, result in sent.items()}
    mover = host_copies.ToHost(host_copies.staging_buffer)
    for key, result in copied.items():
        mover.add_all(result["saved"], into(key, result["saved"]) if into else None)
    mover.flush()
    return copied


def encoded(sent: wire.Collected, views: bool = False, shared: bool = False) -> wire.Collected:
    """`wire.encode` of `sent` as a worker calls it: with `shared`, each request's saves
    written into its file as they reach the host (`wire.SharedFiles`)."""
    files = wire.SharedFiles() if shared else None
    return wire.encode(moved(sent, files.places if files else None), views=views, files=files)


def written_file(size: int = 64) -> str:
    """A file of `size` zero bytes made as a collection makes one, closed for its client."""
    file = shm_files.create(size)
    assert file is not None and file.write_at(memoryview(bytes(size)), 0)
    return file.path


def through_vllm(data: wire.Collected) -> wire.Collected:
    """What the client receives of a `collective_rpc` result (vLLM's encoder and decoder; the
    engine core's output thread encodes into a buffer it reuses)."""
    outputs = EngineCoreOutputs(
        utility_output=UtilityOutput(call_id=1, result=UtilityResult(data)))
    frames = [bytes(frame) for frame in MsgpackEncoder().encode_into(outputs, bytearray())]
    return MsgpackDecoder(EngineCoreOutputs).decode(frames).utility_output.result.result


def through_vllm_typed(data: wire.Collected) -> wire.Collected:
    """The same with `VLLM_ALLOW_INSECURE_SERIALIZATION`, where vLLM converts every leaf of a
    result to the type it was sent as."""
    import vllm.envs

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm.envs, "VLLM_ALLOW_INSECURE_SERIALIZATION", True, raising=False)
        return through_vllm(data)


def through_pickle(data: wire.Collected) -> wire.Collected:
    return pickle.loads(pickle.dumps(data))


@pytest.mark.parametrize(("transport", "views"), [
    (through_vllm, False), (through_vllm_typed, False), (through_pickle, False),
    (through_vllm, True), (through_vllm_typed, True), (lambda data: data, True)])
@pytest.mark.parametrize("landing_threads", [1, 3])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("from_a_device", [False, True], ids=["host", "device"])
def test_saves_cross_unchanged(monkeypatch, transport, views: bool, landing_threads,
                               shared: bool, from_a_device: bool) -> None:
    monkeypatch.setattr(host_copies, "LANDING_THREADS", landing_threads)
    monkeypatch.setattr(host_copies, "PARALLEL_BYTES", 16)  # three threads copy into each
    monkeypatch.setattr(wire, "SHARED_MIN_BYTES", 1)  # every request with saves gets a file
    # From a device, every tensor crosses the staging buffer (into its file from there).
    monkeypatch.setattr(host_copies, "on_a_device", lambda rows: from_a_device)
    sent = collected()
    data = encoded(sent, views=views, shared=shared)
    assert bool(data["a"]["segment"]) == shared and data["b"]["segment"] is None  # none saved
    received = wire.decode(transport(data))
    assert not left_behind()
    assert received.keys() == sent.keys()
    for key, result in sent.items():
        assert received[key]["error"] == result["error"]
        assert received[key]["saved"].keys() == result["saved"].keys()
        for location, tensor in result["saved"].items():
            got = received[key]["saved"][location]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, location
            assert torch.equal(got, tensor), location
            got.add_(1)  # writable, and its own: the sent tensor does not change
            assert not torch.equal(got, tensor) or got.numel() == 0


def test_an_unknown_dtype_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'float7'"):
        wire.decode({"a": {"error": None, "saved": {"x": ["float7", [1], b"\0"]}}})


def test_a_tensor_whose_bytes_do_not_fit_its_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"shape \[2, 3\] came with 4 bytes instead of 24"):
        wire.decode({"a": {"error": None, "saved": {"x": ["float32", [2, 3], b"\0" * 4]}}})


@pytest.mark.parametrize("from_a_device", [False, True], ids=["host", "device"])
def test_where_shared_memory_fills_up_saves_go_in_the_message(monkeypatch,
                                                              from_a_device: bool) -> None:
    def full(descriptor: int, data: memoryview, offset: int) -> int:
        if offset >= 64:  # the first tensor (140 bytes) fits up to here, the rest does not
            raise OSError(errno.ENOSPC, "No space left on device")
        return min(len(data), 8)  # a short write: the rest follows

    monkeypatch.setattr(os, "pwrite", full)
    monkeypatch.setattr(wire, "SHARED_MIN_BYTES", 1)
    monkeypatch.setattr(host_copies, "on_a_device", lambda rows: from_a_device)
    sent = collected()
    data = encoded(sent, shared=True)
    assert data["a"]["segment"] is None and not left_behind()
    received = wire.decode(through_vllm(data))["a"]["saved"]
    for location, tensor in sent["a"]["saved"].items():
        assert torch.equal(received[location], tensor), location


def test_saves_written_before_shared_memory_filled_up_are_read_back(monkeypatch) -> None:
    def full(descriptor: int, data: memoryview, offset: int) -> int:
        if offset >= 192:  # the first tensor fits (140 bytes at 0), the second (at 192) not
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(descriptor, data, offset)

    original = os.pwrite
    monkeypatch.setattr(os, "pwrite", full)
    monkeypatch.setattr(wire, "SHARED_MIN_BYTES", 1)
    sent = collected()
    written = moved(sent, (files := wire.SharedFiles()).places)
    assert written["a"]["saved"]["layers.0.layer_output"].is_meta  # in the file
    assert not written["a"]["saved"]["layers.0.mlp_neurons"].is_meta  # did not fit
    data = wire.encode(written, files=files)
    assert data["a"]["segment"] is None and not left_behind()
    received = wire.decode(through_vllm(data))["a"]["saved"]
    for location, tensor in sent["a"]["saved"].items():
        assert torch.equal(received[location], tensor), location


@pytest.mark.parametrize("fits", [64, 1 << 20], ids=["partly", "wholly"])
def test_a_save_larger_than_the_staging_buffer_goes_into_its_file_window_by_window(
        monkeypatch, fits: int) -> None:
    """A save over the staging buffer's size crosses it window by window, each written into
    the file from there; where shared memory fills up after its first window, that window is
    read back and the save goes inside the message."""
    def full(descriptor: int, data: memoryview, offset: int) -> int:
        if offset >= fits:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(descriptor, data, offset)

    original = os.pwrite
    monkeypatch.setattr(os, "pwrite", full)
    monkeypatch.setattr(wire, "SHARED_MIN_BYTES", 1)
    monkeypatch.setattr(host_copies, "STAGING_BYTES", 64)  # 140 bytes: three windows
    monkeypatch.setattr(host_copies, "on_a_device", lambda rows: True)
    sent = {"a": {"error": None, "saved": {"x": torch.randn(1, 7, 5)}}}
    files = wire.SharedFiles()
    written = moved(sent, files.places)
    assert written["a"]["saved"]["x"].is_meta == (fits > 64)
    data = wire.encode(written, files=files)
    assert bool(data["a"]["segment"]) == (fits > 64)
    assert torch.equal(wire.decode(through_vllm(data))["a"]["saved"]["x"], sent["a"]["saved"]["x"])
    assert not left_behind()


def test_a_client_that_cannot_decode_still_removes_every_file(monkeypatch) -> None:
    monkeypatch.setattr(wire, "SHARED_MIN_BYTES", 1)
    sent = {key: collected()["a"] for key in ("first", "second", "third")}
    data = through_vllm(encoded(sent, shared=True))
    data["second"]["saved"]["strided"][0] = "float7"
    assert len(left_behind()) == 3
    with pytest.raises(ValueError, match="'float7'"):
        wire.decode(data)
    assert not left_behind()


def test_files_no_client_opens_are_removed_once_abandoned(monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(shm_files.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(shm_files, "MADE", PerProcess(shm_files._Made))
    abandoned, opened = written_file(), written_file()
    shm_files.attach(opened, 64)  # a client took this one
    # Another process's file, killed before its exit could remove it.
    killed = os.path.join(shm_files.DIRECTORY, "vllm-interp-999999999-killed")
    with open(killed, "wb") as file:
        file.write(bytes(64))
    long_ago = time.time() - shm_files.ABANDONED_AFTER_S - 1
    for path in (abandoned, killed):
        os.utime(path, (long_ago, long_ago))
    young = written_file()
    assert os.path.exists(abandoned)  # the directory was looked at too recently
    clock[0] += shm_files._PRUNE_EVERY_S
    latest = written_file()
    assert not os.path.exists(abandoned) and not os.path.exists(killed)
    made = shm_files.MADE.current()
    assert made is not None
    assert made.paths == {young, latest}  # the opened one forgotten, the rest kept
    shm_files.remove_left_behind()
    assert not left_behind()


def test_a_process_removes_its_unopened_files_when_it_exits_and_no_one_else_s() -> None:
    parent_file = written_file()
    for method in ("fork", "spawn"):
        context = multiprocessing.get_context(method)
        written = context.Queue()
        child = context.Process(target=_write_a_file_and_exit, args=(written,))
        child.start()
        child_file = written.get(timeout=120)
        child.join(timeout=120)
        assert child.exitcode == 0, method
        assert not os.path.exists(child_file), method  # the child removed its own file
        assert os.path.exists(parent_file), method  # and not the one it inherited the name of
    shm_files.remove_left_behind()
    assert not left_behind()


def _write_a_file_and_exit(written: Any) -> None:
    written.put(written_file())


@pytest.mark.parametrize("from_a_device", [False, True], ids=["host", "device"])
def test_a_collection_stopped_by_an_interruption_leaves_no_file(monkeypatch,
                                                                from_a_device: bool) -> None:
    def interrupted(descriptor: int, data: memoryview, offset: int) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "pwrite", interrupted)
    monkeypatch.setattr(wire, "SHARED_MIN_BYTES", 1)
    monkeypatch.setattr(host_copies, "on_a_device", lambda rows: from_a_device)
    sent = collected()
    worker = worker_with("mp", sent)
    with pytest.raises(KeyboardInterrupt):
        WorkerRPC.interp_collect(worker, [], True, shm_files.identity())  # type: ignore[arg-type]
    assert not left_behind()


@pytest.mark.parametrize("shared", [False, True], ids=["message", "file"])
def test_a_request_whose_saves_cannot_be_sent_fails_alone(monkeypatch, shared: bool) -> None:
    """Encoding one request's saves can fail (the host out of memory for a copy); that request
    comes back with no saves and the cause after its earlier error, its file removed, and the
    other requests as they were (before, every request's output was lost)."""
    monkeypatch.setattr(wire, "SHARED_MIN_BYTES", 1)
    sent = collected()
    sent["c"] = {"error": "an edit was not finite", "saved": {"x": torch.randn(1, 6, 3)}}
    encode_result = wire._encode_result

    def host_full(result, views, file):
        if "x" in result["saved"]:
            raise MemoryError("host memory exhausted")
        return encode_result(result, views, file)

    monkeypatch.setattr(wire, "_encode_result", host_full)
    data = WorkerRPC.interp_collect(  # type: ignore[arg-type]
        worker_with("mp", sent), [], True, shm_files.identity() if shared else None)
    assert data["c"]["saved"] == {} and data["c"]["segment"] is None
    assert data["c"]["error"].startswith("an edit was not finite; then its saves could not be")
    assert "MemoryError: host memory exhausted" in data["c"]["error"]
    assert bool(data["a"]["segment"]) == shared
    received = wire.decode(through_vllm(through_pickle(data)))
    for location, tensor in sent["a"]["saved"].items():
        assert torch.equal(received["a"]["saved"][location], tensor)
    assert received["b"] == {"error": sent["b"]["error"], "saved": {}}
    assert not left_behind()


def test_saves_go_in_the_message_where_a_file_would_leave_shared_memory_short(
        monkeypatch) -> None:
    room = os.statvfs(shm_files.DIRECTORY)
    free = room.f_bavail * room.f_frsize
    keep = max(shm_files.KEEP_FREE_BYTES, room.f_blocks * room.f_frsize // 4)
    assert shm_files.create(free - keep + 1) is None
    assert not left_behind()
    monkeypatch.setattr(shm_files, "KEEP_FREE_BYTES", free)
    monkeypatch.setattr(wire, "SHARED_MIN_BYTES", 1)
    assert encoded(collected(), shared=True)["a"]["segment"] is None


def test_a_file_this_process_cannot_open_is_named_with_the_way_around_it() -> None:
    missing = os.path.join(shm_files.DIRECTORY, "vllm-interp-gone")
    with pytest.raises(RuntimeError, match=f"{missing}.*{SHARED_SAVES_VARIABLE}=0"):
        shm_files.attach(missing, 64)
    assert not os.path.exists(missing)  # not made by looking for it


def test_shared_memory_is_offered_unless_the_setting_says_0(monkeypatch) -> None:
    assert shared_saves_memory() == shm_files.identity() is not None
    monkeypatch.setenv(SHARED_SAVES_VARIABLE, "0")
    assert shared_saves_memory() is None
    monkeypatch.setenv(SHARED_SAVES_VARIABLE, "yes")
    with pytest.raises(ValueError, match=f"{SHARED_SAVES_VARIABLE}='yes' must be 1"):
        shared_saves_memory()


def worker_with(backend: str, sent: wire.Collected, world_size: int = 1) -> SimpleNamespace:
    """What `WorkerRPC.interp_collect` reads of its worker, under an executor `backend`, with
    `sent` its collection."""
    return SimpleNamespace(
        model_runner=SimpleNamespace(interp=SimpleNamespace(
            collect=lambda finished, into=None: moved(sent, into))),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(
            distributed_executor_backend=backend, world_size=world_size)))


def elsewhere(tmp_path: Any) -> str | None:
    """The identity of shared memory in another place (another container's, on this host)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shm_files, "DIRECTORY", str(tmp_path))
        return shm_files.identity()


@pytest.mark.parametrize(("client", "world_size", "through_a_file"), [
    ("same", 1, True), ("another-host", 1, False), ("another-directory", 1, False),
    (None, 1, False), ("same", 2, False)])
def test_a_worker_writes_a_file_only_for_a_client_seeing_its_shared_memory_and_alone(
        monkeypatch, tmp_path, client: str | None, world_size: int,
        through_a_file: bool) -> None:
    monkeypatch.setattr(wire, "SHARED_MIN_BYTES", 1)
    sent = collected()
    worker = worker_with("mp", sent, world_size)
    memory = {"same": shm_files.identity(), "another-directory": elsewhere(tmp_path),
              "another-host": f"another-host:{shm_files.identity()}", None: None}[client]
    assert memory is None or (memory == shm_files.identity()) == (client == "same")
    data = WorkerRPC.interp_collect(worker, [], True, memory)  # type: ignore[arg-type]
    assert bool(data["a"]["segment"]) == through_a_file
    received = wire.decode(through_vllm(through_pickle(data)))
    assert torch.equal(received["a"]["saved"]["layers.0.mlp_neurons"],
                       sent["a"]["saved"]["layers.0.mlp_neurons"])
    assert not left_behind()


@pytest.mark.parametrize("backend", ["mp", "ray", "external_launcher"])
def test_a_worker_whose_results_are_pickled_sends_bytes(backend: str) -> None:
    sent = collected()
    data = WorkerRPC.interp_collect(worker_with(backend, sent), [])  # type: ignore[arg-type]
    assert type(data["a"]["saved"]["layers.0.layer_output"][2]) is bytes
    received = wire.decode(through_vllm(through_pickle(data)))
    assert torch.equal(received["a"]["saved"]["layers.0.mlp_neurons"],
                       sent["a"]["saved"]["layers.0.mlp_neurons"])


def test_a_worker_in_the_engine_core_process_sends_views_that_msgpack_carries() -> None:
    sent = collected()
    data = WorkerRPC.interp_collect(worker_with("uni", sent), [])  # type: ignore[arg-type]
    assert type(data["a"]["saved"]["layers.0.layer_output"][2]) is memoryview
    with pytest.raises(TypeError):
        pickle.dumps(data)  # why only there: pickle refuses them
    received = wire.decode(through_vllm(data))
    assert torch.equal(received["a"]["saved"]["strided"], sent["a"]["saved"]["strided"])
