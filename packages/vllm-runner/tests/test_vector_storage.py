"""The named-vector routes when the server's vectors folder cannot be written (full, read-only,
not a folder): a 507 that says so and that nothing changed, never a 500, nothing half-written,
and the server goes on serving its other vectors."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from vllm_runner.server import routes
from vllm_runner.server.vector_registry import VectorRegistry


@pytest.fixture
def served(tmp_path: Path) -> tuple[TestClient, VectorRegistry]:
    app = FastAPI()
    app.include_router(routes.router)
    registry = VectorRegistry(tmp_path / "vectors")
    app.state.interp = SimpleNamespace(vectors=registry)
    return TestClient(app), registry


@pytest.mark.parametrize("failure", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_folder_is_a_507_and_changes_nothing(served, monkeypatch,
                                                                 failure: int) -> None:
    client, registry = served
    assert client.put("/v1/interp/vectors/kept", json=[1.0, 2.0]).status_code == 200

    def cannot_write(*args, **kwargs):
        raise OSError(failure, "the disk says no")

    with monkeypatch.context() as full:
        full.setattr("vllm_runner.server.vector_registry.save_file", cannot_write)
        refused = client.put("/v1/interp/vectors/new", json=[3.0])
    assert refused.status_code == 507, refused.text
    error = refused.json()["error"]
    assert error["param"] == "name" and "'new' was not registered" in error["message"]
    assert "the disk says no" in error["message"]
    with monkeypatch.context() as full:
        full.setattr(Path, "unlink", cannot_write)
        refused = client.delete("/v1/interp/vectors/kept")
    assert refused.status_code == 507 and "'kept' is still registered" in refused.text
    assert [path.name for path in registry.folder.iterdir()] == ["kept.safetensors"]
    assert client.get("/v1/interp/vectors").json() == {"vectors": ["kept"]}
    assert client.get("/v1/interp/vectors/kept").status_code == 200


def test_a_folder_that_cannot_exist_is_a_507(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    app = FastAPI()
    app.include_router(routes.router)
    app.state.interp = SimpleNamespace(vectors=VectorRegistry(blocker / "vectors"))
    refused = TestClient(app).put("/v1/interp/vectors/new", json=[3.0])
    assert refused.status_code == 507 and "Not a directory" in refused.json()["error"]["message"]
