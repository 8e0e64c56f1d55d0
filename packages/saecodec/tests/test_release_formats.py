"""The other release formats (Gemma Scope, Gemma Scope 2, Llama Scope, sparsify) loaded from
disk, without SAELens: each loads to the weights and site its files hold (with the folds and
transposes written out here by hand), `load` picks the format from the files present, and every
way a format's files can be wrong or say something not modelled is refused by file and key.
(`test_release_formats_against_saelens.py` checks the same loads against SAELens itself.)"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import (
    D_IN,
    D_SAE,
    random_weights,
    write_gemma_scope,
    write_gemma_scope_2,
    write_llama_scope,
    write_saelens,
    write_sparsify,
)
from saecodec import SAE, SAEFormatError, Site, site_location
from saecodec.formats.npz import read_npz
from safetensors.torch import save_file


def _rewrite(path: Path, **changes: object) -> None:
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _refused(path: Path, file: Path, key: str | None, message: str,
             site: Site | None = None) -> None:
    """`SAE.load(path)` is refused naming `file` and `key`, with `message` in its words."""
    with pytest.raises(SAEFormatError, match=message) as raised:
        SAE.load(path, site)
    assert raised.value.path == file
    assert raised.value.key == key
    assert str(file) in str(raised.value)


# ---- Gemma Scope (params.npz) ---------------------------------------------------------------

def test_a_gemma_scope_npz_loads_from_its_folder_or_its_file(tmp_path: Path) -> None:
    weights = write_gemma_scope(tmp_path / "layer_3" / "width_16k" / "average_l0_40", seed=1)
    for path in (tmp_path / "layer_3/width_16k/average_l0_40",
                 tmp_path / "layer_3/width_16k/average_l0_40/params.npz"):
        sae = SAE.load(path)
        assert (sae.architecture, sae.d_in, sae.d_sae) == ("jumprelu", D_IN, D_SAE)
        assert sae.dtype == torch.float32 and not sae.apply_b_dec_to_input
        for name, tensor in weights.items():
            assert torch.equal(getattr(sae, name), tensor), name
        assert sae.site == Site()  # the npz names no site


def test_a_gemma_scope_site_is_given_to_load(tmp_path: Path) -> None:
    write_gemma_scope(tmp_path)
    sae = SAE.load(tmp_path, site=Site(hook_name="blocks.3.hook_resid_post"))
    assert sae.site == Site("blocks.3.hook_resid_post", None)
    assert site_location(sae.site) == "layers.3.layer_output"


def test_gemma_scope_reads_lower_case_names_and_compressed_files_and_unit_scales(
        tmp_path: Path) -> None:
    weights = write_gemma_scope(tmp_path, seed=2, names={"W_enc": "w_enc", "W_dec": "w_dec"},
                                compressed=True,
                                extra={"scaling_factor": np.ones(D_SAE, np.float32)})
    sae = SAE.load(tmp_path)
    assert torch.equal(sae.W_enc, weights["W_enc"]) and torch.equal(sae.W_dec, weights["W_dec"])


def test_a_gemma_scope_embedding_sae_is_rescaled_by_the_root_of_its_width(tmp_path: Path
                                                                          ) -> None:
    folder = tmp_path / "embedding" / "width_4k" / "average_l0_6"
    weights = write_gemma_scope(folder, seed=3)
    sae = SAE.load(folder)
    torch.testing.assert_close(sae.W_enc, weights["W_enc"] / math.sqrt(D_IN))
    torch.testing.assert_close(sae.W_dec, weights["W_dec"] * math.sqrt(D_IN))
    assert torch.equal(sae.b_dec, weights["b_dec"])
    # as the HF cache holds it: the snapshot's params.npz a link to a blob named by its hash
    snapshot = tmp_path / "snapshots" / "abc123" / "embedding" / "width_4k" / "average_l0_6"
    snapshot.mkdir(parents=True)
    (tmp_path / "blobs").mkdir()
    (folder / "params.npz").rename(tmp_path / "blobs" / "e3b0c442")
    (snapshot / "params.npz").symlink_to(tmp_path / "blobs" / "e3b0c442")
    torch.testing.assert_close(SAE.load(snapshot).W_enc, weights["W_enc"] / math.sqrt(D_IN))


@pytest.mark.parametrize(("extra", "names", "key", "message"), [
    ({}, {"threshold": "thresholds"}, "threshold", "has no tensor 'threshold'"),
    ({"W_skip": np.zeros((D_IN, D_IN), np.float32)}, {}, "W_skip", "holds tensor 'W_skip'"),
    ({"scaling_factor": np.full(D_SAE, 2.0, np.float32)}, {}, "scaling_factor",
     "other than ones"),
])
def test_a_broken_gemma_scope_npz_is_refused_by_key(tmp_path: Path, extra: dict[str, Any],
                                                    names: dict[str, str], key: str,
                                                    message: str) -> None:
    write_gemma_scope(tmp_path, names=names, extra=extra)
    _refused(tmp_path, tmp_path / "params.npz", key, message)


def test_a_gemma_scope_npz_of_the_wrong_shape_or_kind_is_refused(tmp_path: Path) -> None:
    weights = {name: tensor.numpy() for name, tensor in random_weights("jumprelu").items()}
    np.savez(tmp_path / "params.npz", **(weights | {"b_enc": np.zeros(D_SAE + 1, np.float32)}))
    _refused(tmp_path, tmp_path / "params.npz", "b_enc", r"b_enc has shape \[41\]")
    np.savez(tmp_path / "params.npz", **(weights | {"b_dec": np.array(["a", "b"])}))
    _refused(tmp_path, tmp_path / "params.npz", "b_dec", "has dtype '<U1'")
    np.savez(tmp_path / "params.npz", **(weights | {"b_dec": np.array([{}], dtype=object)}))
    _refused(tmp_path, tmp_path / "params.npz", "b_dec", "never unpickled")
    (tmp_path / "params.npz").write_bytes(b"PK\x03\x04 not really")
    _refused(tmp_path, tmp_path / "params.npz", None, "not a readable .npz")


# ---- the npz reader, against numpy -----------------------------------------------------------

@pytest.mark.parametrize("compressed", [False, True])
def test_the_npz_reader_reads_what_numpy_writes(tmp_path: Path, compressed: bool) -> None:
    generator = np.random.default_rng(0)
    arrays = {
        "f32": generator.standard_normal((3, 5)).astype(np.float32),
        "f64": generator.standard_normal(7),
        "f16": generator.standard_normal((2, 2, 2)).astype(np.float16),
        "i64": np.arange(-4, 8).reshape(3, 4),
        "u8": np.arange(9, dtype=np.uint8),
        "flags": np.array([True, False, True]),
        "fortran": np.asfortranarray(generator.standard_normal((4, 3, 2)).astype(np.float32)),
        "big": generator.standard_normal((3, 4)).astype(">f4"),
        "scalar": np.float32(2.5),
        "empty": np.zeros((0, 4), np.float32),
    }
    (np.savez_compressed if compressed else np.savez)(tmp_path / "a.npz", **arrays)
    read = read_npz(tmp_path / "a.npz")
    assert set(read) == set(arrays)
    for name, array in arrays.items():
        native = np.dtype(array.dtype).newbyteorder("=")
        expected = torch.from_numpy(np.array(array, dtype=native, order="C"))
        assert read[name].dtype == expected.dtype, name
        assert read[name].shape == expected.shape, name
        assert torch.equal(read[name], expected), name


# ---- Gemma Scope 2 (config.json + params.safetensors) --------------------------------------

def test_a_gemma_scope_2_sae_loads_with_its_hf_site(tmp_path: Path) -> None:
    weights = write_gemma_scope_2(tmp_path, seed=4, layer=13)
    sae = SAE.load(tmp_path)
    assert (sae.architecture, sae.d_in, sae.d_sae) == ("jumprelu", D_IN, D_SAE)
    for name, tensor in weights.items():
        assert torch.equal(getattr(sae, name), tensor), name
    assert sae.site == Site(None, "model.layers.13.output")
    assert site_location(sae.site) == "layers.13.layer_output"


@pytest.mark.parametrize(("config", "extra", "file", "key", "message"), [
    ({"architecture": "topk"}, {}, "config.json", "architecture", "JumpReLU"),
    ({"type": "transcoder"}, {}, "config.json", "type", "transcoders"),
    ({"affine_connection": True}, {}, "config.json", "affine_connection", "skip connection"),
    ({"hf_hook_point_in": "model.layers.3.pre_feedforward_layernorm.output",
      "hf_hook_point_out": "model.layers.3.post_feedforward_layernorm.output"}, {},
     "config.json", "hf_hook_point_out", "a transcoder"),
    ({"width": D_SAE * 2}, {}, "config.json", "width", "has 40 features"),
    ({}, {"affine_skip_connection": torch.zeros(D_IN, D_IN)}, "params.safetensors",
     "affine_skip_connection", "skip connection"),
    ({}, {"w_dec": torch.zeros(D_SAE, 2, D_IN)}, "params.safetensors", "w_dec",
     "cross-layer transcoder"),
    ({}, {"b_dec": torch.zeros(D_IN + 1)}, "params.safetensors", "b_dec",
     r"b_dec has shape \[13\]"),
    ({}, {"extra_bias": torch.zeros(3)}, "params.safetensors", "extra_bias",
     "holds tensor 'extra_bias'"),
])
def test_a_gemma_scope_2_sae_we_do_not_model_is_refused_by_key(
        tmp_path: Path, config: dict[str, Any], extra: dict[str, torch.Tensor], file: str,
        key: str, message: str) -> None:
    write_gemma_scope_2(tmp_path, config=config, extra=extra)
    _refused(tmp_path, tmp_path / file, key, message)


def test_gemma_scope_2_without_its_threshold_or_its_config_is_refused(tmp_path: Path) -> None:
    weights = write_gemma_scope_2(tmp_path)
    save_file({name.lower(): tensor for name, tensor in weights.items() if name != "threshold"},
              str(tmp_path / "params.safetensors"))
    _refused(tmp_path, tmp_path / "params.safetensors", "threshold", "has no tensor")
    (tmp_path / "config.json").unlink()
    _refused(tmp_path, tmp_path / "config.json", None, "is missing")


# ---- Llama Scope (hyperparams.json + checkpoints/final.safetensors) --------------------------

def test_a_llama_scope_sae_loads_with_the_dataset_norm_folded_in(tmp_path: Path) -> None:
    norm, threshold = 1.75, 0.25
    raw = write_llama_scope(tmp_path, seed=5, layer=8, norm=norm, threshold=threshold)
    sae = SAE.load(tmp_path)
    s = math.sqrt(D_IN) / norm  # what lm-saes scaled each input by in training
    torch.testing.assert_close(sae.W_enc, raw["encoder.weight"].T * s)
    torch.testing.assert_close(sae.b_enc, raw["encoder.bias"])
    torch.testing.assert_close(sae.W_dec, raw["decoder.weight"].T / s)
    torch.testing.assert_close(sae.b_dec, raw["decoder.bias"] / s)
    torch.testing.assert_close(sae.threshold, torch.full((D_SAE,), threshold * s))
    assert sae.site == Site("blocks.8.hook_resid_post", None)
    assert not sae.apply_b_dec_to_input and sae.dtype == torch.float32
    # raw activations in, the SAE's normalised-space features out: the fold is the rescale
    x = torch.randn(5, D_IN, generator=torch.Generator().manual_seed(1)) * 2
    pre = (x * s) @ raw["encoder.weight"].T + raw["encoder.bias"]
    features = pre.relu() * (pre > threshold * s)
    torch.testing.assert_close(sae.encode(x), features)
    torch.testing.assert_close(sae.decode(features),
                               (features @ raw["decoder.weight"].T + raw["decoder.bias"]) / s)


def test_a_bfloat16_llama_scope_checkpoint_loads_in_float32(tmp_path: Path) -> None:
    raw = write_llama_scope(tmp_path, dtype=torch.bfloat16)
    sae = SAE.load(tmp_path)
    assert sae.dtype == torch.float32
    torch.testing.assert_close(sae.b_enc, raw["encoder.bias"].float())


@pytest.mark.parametrize(("config", "key", "message"), [
    ({"hook_point_out": "blocks.3.hook_mlp_out"}, "hook_point_out", "a transcoder"),
    ({"dataset_average_activation_norm": {"in": 64.0, "out": 3.39}},
     "dataset_average_activation_norm.out", "its own factor"),
    ({"dataset_average_activation_norm": {"in": 0}}, "dataset_average_activation_norm.in",
     "must be positive"),
    ({"dataset_average_activation_norm": None}, "dataset_average_activation_norm",
     "'in' norm"),
    ({"act_fn": "topk"}, "act_fn", "JumpReLU"),
    ({"norm_activation": "token-wise"}, "norm_activation", "dataset-wise"),
    ({"apply_decoder_bias_to_pre_encoder": True}, "apply_decoder_bias_to_pre_encoder",
     "not modelled"),
    ({"jump_relu_threshold": "0.2"}, "jump_relu_threshold", "not a number"),
    ({"d_model": D_IN * 2}, "d_model", "reads 12"),
])
def test_a_llama_scope_config_we_do_not_model_is_refused_by_key(
        tmp_path: Path, config: dict[str, Any], key: str, message: str) -> None:
    write_llama_scope(tmp_path, config=config)
    _refused(tmp_path, tmp_path / "hyperparams.json", key, message)


def test_a_broken_llama_scope_checkpoint_is_refused_by_key(tmp_path: Path) -> None:
    raw = write_llama_scope(tmp_path)
    weights = tmp_path / "checkpoints" / "final.safetensors"
    save_file({name: tensor for name, tensor in raw.items() if name != "decoder.bias"},
              str(weights))
    _refused(tmp_path, weights, "decoder.bias", "has no tensor 'decoder.bias'")
    save_file(raw | {"decoder.weight": raw["decoder.weight"].T.contiguous()}, str(weights))
    _refused(tmp_path, weights, "decoder.weight", r"must be \[12, 40\]")
    save_file(raw | {"encoder_glu.weight": torch.zeros(D_SAE, D_IN)}, str(weights))
    _refused(tmp_path, weights, "encoder_glu.weight", "holds tensor 'encoder_glu.weight'")
    weights.unlink()
    _refused(tmp_path, weights, None, "is missing")


# ---- EleutherAI sparsify (cfg.json + sae.safetensors) ----------------------------------------

def sparsify_by_hand(raw: dict[str, torch.Tensor], k: int, x: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """sparsify's `SparseCoder.encode` and `decode` (sparse_coder.py, fused_encoder.py), dense:
    `relu((x - b_dec) @ encoder.weight.T + encoder.bias)`, top k kept; `acts @ W_dec + b_dec`."""
    weights = {name: tensor.float() for name, tensor in raw.items()}
    pre = torch.nn.functional.linear(x - weights["b_dec"], weights["encoder.weight"],
                                     weights["encoder.bias"]).relu()
    top = pre.topk(k, dim=-1)
    features = torch.zeros_like(pre).scatter(-1, top.indices, top.values)
    return features, features @ weights["W_dec"] + weights["b_dec"]


def test_a_sparsify_hookpoint_loads_as_sparsify_computes_it(tmp_path: Path) -> None:
    raw = write_sparsify(tmp_path / "run" / "layers.6", seed=6, k=5)
    sae = SAE.load(tmp_path / "run" / "layers.6")
    assert (sae.architecture, sae.k, sae.d_in, sae.d_sae) == ("topk", 5, D_IN, 4 * D_IN)
    assert sae.dtype == torch.float32 and sae.apply_b_dec_to_input
    assert torch.equal(sae.W_enc, raw["encoder.weight"].float().T)
    assert torch.equal(sae.W_dec, raw["W_dec"].float())
    assert sae.site == Site(None, "layers.6")
    assert site_location(sae.site) == "layers.6.layer_output"
    x = torch.randn(3, 4, D_IN, generator=torch.Generator().manual_seed(2))
    features, rebuilt = sparsify_by_hand(raw, 5, x)
    assert int((features != 0).sum()) > 0
    torch.testing.assert_close(sae.encode(x), features)
    torch.testing.assert_close(sae.decode(features), rebuilt)


@pytest.mark.parametrize(("hookpoint", "location"), [
    ("layers.2.mlp", "layers.2.mlp_output"), ("layers.2.self_attn", "layers.2.attention_output"),
    ("h.2", "layers.2.layer_output"), ("embed_tokens", None), ("my-favourite-sae", None)])
def test_a_sparsify_site_is_its_folder_name(tmp_path: Path, hookpoint: str,
                                            location: str | None) -> None:
    write_sparsify(tmp_path / hookpoint)
    site = SAE.load(tmp_path / hookpoint).site
    assert site.hf_hook_name == (None if hookpoint == "my-favourite-sae" else hookpoint)
    assert site_location(site) == location


def test_a_sparsify_size_may_come_from_its_expansion_factor(tmp_path: Path) -> None:
    write_sparsify(tmp_path / "layers.0", config={"num_latents": 0, "expansion_factor": 4})
    assert SAE.load(tmp_path / "layers.0").d_sae == 4 * D_IN
    _rewrite(tmp_path / "layers.0" / "cfg.json", expansion_factor=3)
    _refused(tmp_path / "layers.0", tmp_path / "layers.0" / "cfg.json", "expansion_factor",
             "has 48 latents")


@pytest.mark.parametrize(("config", "extra", "file", "key", "message"), [
    ({"activation": "groupmax"}, {}, "cfg.json", "activation", "TopK"),
    ({"transcode": True}, {}, "cfg.json", "transcode", "a transcoder"),
    ({"skip_connection": True}, {}, "cfg.json", "skip_connection", "skip connection"),
    ({"embed_skip": True}, {}, "cfg.json", "embed_skip", "from the embeddings"),
    ({"k": 49}, {}, "cfg.json", "k", r"in 1\.\.48"),
    ({"k": None}, {}, "cfg.json", "k", "has no value"),
    ({"num_latents": 40}, {}, "cfg.json", "num_latents", "has 48"),
    ({"d_in": 16}, {}, "cfg.json", "d_in", "reads 12"),
    ({}, {"W_skip": torch.zeros(D_IN, D_IN)}, "sae.safetensors", "W_skip", "skip connection"),
    ({}, {"W_dec": torch.zeros(D_IN, 4 * D_IN)}, "sae.safetensors", "W_dec",
     r"must be \[48, 12\]"),
])
def test_a_sparsify_coder_we_do_not_model_is_refused_by_key(
        tmp_path: Path, config: dict[str, Any], extra: dict[str, torch.Tensor], file: str,
        key: str, message: str) -> None:
    folder = tmp_path / "layers.1"
    write_sparsify(folder, config=config, extra=extra)
    _refused(folder, folder / file, key, message)


def test_a_sparsify_folder_without_its_weights_or_a_bias_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "layers.1"
    raw = write_sparsify(folder)
    save_file({name: tensor for name, tensor in raw.items() if name != "b_dec"},
              str(folder / "sae.safetensors"))
    _refused(folder, folder / "sae.safetensors", "b_dec", "has no tensor 'b_dec'")
    (folder / "sae.safetensors").unlink()
    _refused(folder, folder / "sae.safetensors", None, "is missing")  # its cfg.json says sparsify


def test_a_sparsify_run_names_its_hookpoint_folders(tmp_path: Path) -> None:
    for hookpoint in ("layers.0", "layers.1", "layers.2.mlp"):
        write_sparsify(tmp_path / hookpoint)
    with pytest.raises(SAEFormatError, match=r"one SAE per subfolder \(layers\.0, layers\.1, "
                                             r"layers\.2\.mlp\): load one of them"):
        SAE.load(tmp_path)


# ---- choosing the format, and the site ------------------------------------------------------

@pytest.mark.parametrize(("write", "architecture"), [
    (lambda f: write_saelens(f, "topk"), "topk"),
    (lambda f: write_gemma_scope(f) and f, "jumprelu"),
    (lambda f: write_gemma_scope_2(f) and f, "jumprelu"),
    (lambda f: write_llama_scope(f) and f, "jumprelu"),
    (lambda f: write_sparsify(f / "layers.0") and f / "layers.0", "topk"),
])
def test_load_picks_the_format_by_the_files_present(
        tmp_path: Path, write: Callable[[Path], Path], architecture: str) -> None:
    assert SAE.load(write(tmp_path / "sae")).architecture == architecture


def test_a_folder_in_no_known_format_is_refused_listing_the_formats(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("nothing here")
    with pytest.raises(SAEFormatError, match="holds no SAE") as raised:
        SAE.load(tmp_path)
    for files in ("cfg.json + sae_weights.safetensors", "params.npz", "hyperparams.json",
                  "config.json + params.safetensors", "cfg.json + sae.safetensors"):
        assert files in str(raised.value)
    with pytest.raises(SAEFormatError, match="is a file"):
        SAE.load(tmp_path / "notes.txt")


def test_a_site_given_fills_what_the_files_lack_and_must_agree_with_what_they_name(
        tmp_path: Path) -> None:
    folder = write_saelens(tmp_path / "sae", "standard", {"metadata": {
        "hook_name": "blocks.3.hook_resid_post"}})
    both = SAE.load(folder, site=Site(hf_hook_name="model.layers.3.output")).site
    assert both == Site("blocks.3.hook_resid_post", "model.layers.3.output")
    assert SAE.load(folder, site=Site("blocks.3.hook_resid_post")).site == \
        Site("blocks.3.hook_resid_post", None)
    _refused(folder, folder / "cfg.json", "hook_name", "blocks.4.hook_resid_post",
             site=Site("blocks.4.hook_resid_post"))
    write_gemma_scope_2(tmp_path / "gs2", layer=3)
    _refused(tmp_path / "gs2", tmp_path / "gs2" / "config.json", "hf_hook_name",
             "model.layers.5.output", site=Site(hf_hook_name="model.layers.5.output"))
