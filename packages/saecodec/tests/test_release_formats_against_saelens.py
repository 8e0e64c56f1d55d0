"""SAELens 6.54.12 as the oracle for the release formats: each format is written to disk as its
releases lay it out (random weights), loaded here and by SAELens's own loader for it, and the
two SAEs must hold the same tensors and encode, decode and reconstruct alike (1e-5, float32).

SAELens's hub loaders call `hf_hub_download` (and Gemma Scope 2's also reads the tensors'
shapes over HTTP); the tests point those at the local files, so nothing is downloaded, and
they go through `SAE.from_pretrained` with real release names, so SAELens's release table
(its `norm_scaling_factor` for Llama Scope) and its construction of the SAE are the oracle
too. Where SAELens's loader differs from the format's own library, the test says so.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sae_lens
import torch
from conftest import (
    D_IN,
    D_SAE,
    write_gemma_scope,
    write_gemma_scope_2,
    write_llama_scope,
    write_sparsify,
)
from sae_lens.loading import pretrained_sae_loaders as loaders
from saecodec import SAE
from safetensors import safe_open

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def serve_locally(monkeypatch: pytest.MonkeyPatch, files: dict[str, Path]) -> list[str]:
    """Point SAELens's `hf_hub_download` at local files: a request for a path ending in one of
    `files`' keys gets that file. Returns the requests made, for the test to check."""
    asked: list[str] = []

    def download(repo_id: str, filename: str | None = None, *args: Any, subfolder: str | None
                 = None, **kwargs: Any) -> str:
        name = "/".join(part for part in (subfolder, filename) if part)
        asked.append(f"{repo_id}:{name}")
        for ending, path in files.items():
            if name.endswith(ending):
                return str(path)
        raise AssertionError(f"SAELens asked for {repo_id}:{name}, which the test has not")

    def shapes(repo_id: str, filename: str) -> dict[str, list[int]]:
        (path,) = (path for ending, path in files.items() if filename.endswith(ending))
        with safe_open(str(path), framework="pt") as handle:
            return {key: list(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118

    monkeypatch.setattr(loaders, "hf_hub_download", download)
    monkeypatch.setattr(loaders, "get_safetensors_tensor_shapes", shapes)
    return asked


def from_pretrained(release: str, sae_id: str, converter: Any = None) -> Any:
    """SAELens's `SAE.from_pretrained` (float32, CPU), quiet about its deprecations."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sae_lens.SAE.from_pretrained(release, sae_id, converter=converter)


def assert_alike(ours: SAE, theirs: Any, x: torch.Tensor, names: tuple[str, ...] = (
        "W_enc", "b_enc", "W_dec", "b_dec", "threshold")) -> None:
    """The same tensors, and the same features, reconstruction and error on `x`; features
    must fire on some entries and not all, so the threshold or the top-k is really tested."""
    for name in names:
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), **TOLERANCE,
                                   msg=name)
    assert ours.apply_b_dec_to_input == theirs.cfg.apply_b_dec_to_input
    with torch.no_grad():
        features = theirs.encode(x)
        firing = int((features != 0).sum())
        assert 0 < firing < features.numel()
        torch.testing.assert_close(ours.encode(x), features, **TOLERANCE)
        torch.testing.assert_close(ours.decode(features), theirs.decode(features), **TOLERANCE)
        torch.testing.assert_close(ours.error(x), x - theirs(x), **TOLERANCE)


def inputs(seed: int, scale: float = 1.0, d_in: int = D_IN) -> torch.Tensor:
    return torch.randn(4, 7, d_in, generator=torch.Generator().manual_seed(seed)) * scale


# ---- Gemma Scope ------------------------------------------------------------------------------

def with_our_sizes(loader: Callable[..., Any], d_in: int, d_sae: int) -> Callable[..., Any]:
    """SAELens's Gemma Scope loader sets `d_in` from the model (2304 for Gemma 2 2B) and
    `d_sae` from the folder name (16k): our small SAEs say their own sizes, as the real ones
    match those."""
    def load(**kwargs: Any) -> Any:
        overrides = {**(kwargs.pop("cfg_overrides") or {}), "d_in": d_in, "d_sae": d_sae}
        return loader(**kwargs, cfg_overrides=overrides)

    return load


@pytest.mark.parametrize(("sae_id", "hook_name"), [
    ("layer_3/width_16k/average_l0_142", "blocks.3.hook_resid_post"),
    ("embedding/width_4k/average_l0_6", "hook_embed"),  # rescaled by sqrt(d_in), both sides
])
def test_gemma_scope_loads_as_saelens_loads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               sae_id: str, hook_name: str) -> None:
    folder = tmp_path / sae_id  # the hub's layout, which the embedding rescale goes by
    write_gemma_scope(folder, seed=7)
    asked = serve_locally(monkeypatch, {"params.npz": folder / "params.npz"})
    theirs = from_pretrained("gemma-scope-2b-pt-res", sae_id,
                             with_our_sizes(loaders.gemma_2_sae_huggingface_loader, D_IN, D_SAE))
    assert asked == [f"google/gemma-scope-2b-pt-res:{sae_id}/params.npz"]
    ours = SAE.load(folder / "params.npz")
    assert theirs.cfg.metadata.hook_name == hook_name  # SAELens's, from the release's name
    assert ours.site.hook_name is None  # ours: the npz names none, so none unless given
    assert_alike(ours, theirs, inputs(1))


# ---- Gemma Scope 2 ----------------------------------------------------------------------------

def test_gemma_scope_2_loads_as_saelens_loads_it(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "resid_post" / "layer_13_width_16k_l0_big"
    write_gemma_scope_2(folder, seed=8, layer=13)
    serve_locally(monkeypatch, {"config.json": folder / "config.json",
                                "params.safetensors": folder / "params.safetensors"})
    theirs = from_pretrained("gemma-scope-2-1b-pt-res", "layer_13_width_16k_l0_big")
    ours = SAE.load(folder)
    assert ours.site.hf_hook_name == theirs.cfg.metadata.hf_hook_name == "model.layers.13.output"
    # SAELens also names a TransformerLens hook, from the folder's name; ours only the file's
    assert theirs.cfg.metadata.hook_name == "blocks.13.hook_resid_post"
    assert_alike(ours, theirs, inputs(2))


# ---- Llama Scope ------------------------------------------------------------------------------

def test_llama_scope_loads_as_saelens_loads_it(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """SAELens folds the norm with the factor its release table lists for `l3r_8x`
    (20.177...); the hyperparams here give the same factor, sqrt(d_model) / norm["in"], as the
    published ones do (58.935... for l0r_8x is sqrt(4096) / 1.0859375)."""
    scale = 20.177339901477833
    folder = tmp_path / "Llama3_1-8B-Base-L3R-8x"
    write_llama_scope(folder, seed=9, layer=3, norm=math.sqrt(D_IN) / scale, threshold=0.02)
    asked = serve_locally(monkeypatch, {
        "hyperparams.json": folder / "hyperparams.json",
        "checkpoints/final.safetensors": folder / "checkpoints" / "final.safetensors"})
    theirs = from_pretrained("llama_scope_lxr_8x", "l3r_8x")
    assert len(asked) == 2
    ours = SAE.load(folder)
    assert ours.site.hook_name == theirs.cfg.metadata.hook_name == "blocks.3.hook_resid_post"
    # inputs at the dataset's norm, as the SAE sees them: features in and out of threshold
    assert_alike(ours, theirs, inputs(3, scale=1 / scale))


# ---- sparsify ---------------------------------------------------------------------------------

def sparsify_fixed(path: str | Path, device: str = "cpu",
                   cfg_overrides: dict[str, Any] | None = None) -> Any:
    """SAELens's `sparsify_disk_loader`, with its `W_dec` transposed back: SAELens 6.54.12
    transposes sparsify's `W_dec [num_latents, d_in]` (which is already SAELens's layout) to
    `[d_in, num_latents]`, so its own `SAE.load_from_disk(converter=sparsify_disk_loader)`
    fails on the shape (`test_saelens_cannot_load_sparsify_unfixed` pins that)."""
    cfg, state = loaders.sparsify_disk_loader(path, device, cfg_overrides)
    return cfg, state | {"W_dec": state["W_dec"].T.contiguous()}


def test_saelens_cannot_load_sparsify_unfixed(tmp_path: Path) -> None:
    write_sparsify(tmp_path / "layers.6")
    with pytest.raises(RuntimeError, match="size mismatch for W_dec"):
        sae_lens.SAE.load_from_disk(tmp_path / "layers.6", dtype="float32",
                                    converter=loaders.sparsify_disk_loader)


@pytest.mark.parametrize("normalize_decoder", [False, True])
def test_sparsify_loads_as_saelens_loads_it(tmp_path: Path, normalize_decoder: bool) -> None:
    folder = tmp_path / "layers.6"
    write_sparsify(folder, seed=10, k=6, config={"normalize_decoder": normalize_decoder})
    # SAELens forces bfloat16 (its config says so whatever the file holds); float32 here, as
    # we load, so the comparison is of the math and not of two roundings
    cfg, state = sparsify_fixed(folder, cfg_overrides={"dtype": "float32"})
    ours = SAE.load(folder)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        torch.testing.assert_close(getattr(ours, name), state[name], **TOLERANCE, msg=name)
    assert cfg["activation_fn_kwargs"]["k"] == ours.k
    # SAELens sets apply_b_dec_to_input = not normalize_decoder; sparsify's own encode
    # subtracts b_dec from every SAE's input (`if not self.cfg.transcode: x = x - self.b_dec`)
    # whatever normalize_decoder (a training option: unit-norm decoder rows) says. Ours follows
    # sparsify (test_release_formats checks it against sparsify's math): where the two agree
    # (normalize_decoder false) SAELens's SAE must match ours outright; where they do not, it
    # must once its apply_b_dec_to_input is set to sparsify's.
    assert cfg["apply_b_dec_to_input"] is (not normalize_decoder)
    assert ours.apply_b_dec_to_input
    overrides = {"dtype": "float32"} | ({"apply_b_dec_to_input": True} if normalize_decoder
                                       else {})
    theirs = sae_lens.SAE.load_from_disk(
        folder, converter=lambda path, device, cfg_overrides: sparsify_fixed(
            path, device, {**(cfg_overrides or {}), **overrides}))
    assert isinstance(theirs, sae_lens.TopKSAE) and theirs.cfg.k == 6
    assert_alike(ours, theirs, inputs(4), names=("W_enc", "b_enc", "W_dec", "b_dec"))
