"""SAELens's native format loaded from disk, and every way its files can be wrong, named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import D_IN, D_SAE, random_weights, write_saelens
from saecodec import SAE, SAEFormatError, Site
from safetensors.torch import save_file


@pytest.mark.parametrize("architecture", ["standard", "jumprelu", "topk"])
def test_a_saelens_folder_loads_as_written(tmp_path: Path, architecture: str) -> None:
    weights = random_weights(architecture, seed=3)
    sae = SAE.load(write_saelens(tmp_path / "sae", architecture, weights=weights))
    assert (sae.architecture, sae.d_in, sae.d_sae) == (architecture, D_IN, D_SAE)
    for name, tensor in weights.items():
        assert torch.equal(getattr(sae, name), tensor), name
    assert sae.apply_b_dec_to_input
    assert sae.site == Site("blocks.3.hook_resid_post", "model.layers.3.output")
    assert sae.k == (5 if architecture == "topk" else None)


def test_the_site_may_sit_at_the_top_of_the_config_and_the_dtype_is_applied(tmp_path: Path
                                                                            ) -> None:
    folder = write_saelens(tmp_path / "sae", "standard", {
        "metadata": None, "hook_name": "blocks.0.hook_resid_pre", "dtype": "torch.float64"})
    sae = SAE.load(folder)
    assert sae.site == Site("blocks.0.hook_resid_pre", None)
    assert sae.dtype == torch.float64


def _rewrite(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "cfg.json").read_text())
    config.update(changes)
    (folder / "cfg.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("breaks", "file", "key", "message"), [
    (lambda f: (f / "cfg.json").unlink(), "cfg.json", None, "is missing"),
    (lambda f: (f / "cfg.json").write_text("{not json"), "cfg.json", None, "readable JSON"),
    (lambda f: (f / "sae_weights.safetensors").unlink(), "sae_weights.safetensors", None,
     "is missing"),
    (lambda f: (f / "sae_weights.safetensors").write_bytes(b"\x00" * 16),
     "sae_weights.safetensors", None, "readable safetensors"),
    (lambda f: save_file({k: v for k, v in random_weights("jumprelu").items()
                          if k != "threshold"}, str(f / "sae_weights.safetensors")),
     "sae_weights.safetensors", "threshold", "has no tensor 'threshold'"),
    (lambda f: _rewrite(f, architecture="matching_pursuit"), "cfg.json", "architecture",
     "'matching_pursuit'"),
    (lambda f: _rewrite(f, normalize_activations="layer_norm"), "cfg.json",
     "normalize_activations", "'layer_norm' is not supported"),
    (lambda f: _rewrite(f, d_in=D_IN + 1), "cfg.json", "d_in", "W_enc"),
    (lambda f: _rewrite(f, dtype="float99"), "cfg.json", "dtype", "not a torch dtype"),
])
def test_a_broken_folder_is_refused_naming_the_file_and_the_key(
        tmp_path: Path, breaks: object, file: str, key: str | None, message: str) -> None:
    folder = write_saelens(tmp_path / "sae", "jumprelu")
    breaks(folder)  # type: ignore[operator]
    with pytest.raises(SAEFormatError, match=message) as raised:
        SAE.load(folder)
    assert raised.value.path == folder / file
    assert raised.value.key == key
    assert str(folder / file) in str(raised.value)


def test_a_path_that_is_not_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SAEFormatError, match="is not a folder"):
        SAE.load(tmp_path / "nowhere")


def test_a_topk_config_without_k_is_refused(tmp_path: Path) -> None:
    folder = write_saelens(tmp_path / "sae", "topk")
    _rewrite(folder, k=None)
    with pytest.raises(SAEFormatError, match="has no value") as raised:
        SAE.load(folder)
    assert raised.value.key == "k"
