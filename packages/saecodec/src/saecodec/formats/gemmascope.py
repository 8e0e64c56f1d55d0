"""Google DeepMind's Gemma Scope releases: JumpReLU SAEs, loaded as SAELens 6.54's `gemma_2`
and `gemma_3` loaders load them.

Gemma Scope (Gemma 2): one `params.npz` per SAE (`W_enc [d_in, d_sae]`, `b_enc`,
`W_dec [d_sae, d_in]`, `b_dec`, `threshold`, float32), in the hub's folders
`layer_{L}/width_{W}/average_l0_{N}/`. The file names no site: the repository does (`-res`,
`-mlp`, `-att`), so the caller gives it (`SAE.load(path, site=Site(...))`); without one the SAE
loads with an empty `Site()`. Embedding SAEs (a folder named `embedding`, as the hub lays them
out) are rescaled as SAELens rescales them: `W_enc / sqrt(d_in)` and `W_dec * sqrt(d_in)`, for
embeddings read before Gemma multiplies them by `sqrt(d_model)`.

Gemma Scope 2 (Gemma 3): `params.safetensors` (`w_enc`, `b_enc`, `w_dec`, `b_dec`,
`threshold`) with `config.json` (`architecture: "jump_relu"`, `type`, `hf_hook_point_in`,
`hf_hook_point_out`, `affine_connection`, `width`, `l0`, `model_name`). The site is
`hf_hook_point_in`, an HF module path (`model.layers.{L}.output`). Transcoders (`type` other
than `sae`, or a different `hf_hook_point_out`), affine skip connections and cross-layer
transcoders (a 3-D `w_dec`) are refused by name: they compute what an `SAE` does not.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from saecodec.errors import SAEFormatError
from saecodec.formats._files import (
    FOREIGN_DTYPE,
    build,
    expect_matrix,
    expect_shape,
    integer,
    read_json,
    read_safetensors,
    read_site,
    refuse_unless,
    settle_site,
    take,
)
from saecodec.formats.npz import read_npz
from saecodec.sae import SAE, Site

PARAMS_NPZ = "params.npz"
PARAMS = "params.safetensors"
CONFIG = "config.json"
_NAMES = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")


def load_npz(path: Path, site: Site | None = None) -> SAE:
    """The Gemma Scope SAE in `path` (its folder, or its `.npz` file), at `site` if given."""
    file = path if path.is_file() else path / PARAMS_NPZ
    arrays = read_npz(file)
    # SAELens reads lower-case `w_` names as `W_` (Gemma Scope itself writes `W_enc`, `W_dec`)
    tensors = {"W_" + name[2:] if name.startswith("w_") else name: array.to(FOREIGN_DTYPE)
               for name, array in arrays.items()}
    scale = tensors.pop("scaling_factor", None)
    if scale is not None and not torch.equal(scale, torch.ones_like(scale)):
        # SAELens drops an all-ones scaling factor and refuses any other for these SAEs
        raise SAEFormatError(file, "holds a finetuning scaling_factor other than ones, which "
                             "this package does not model", "scaling_factor")
    tensors = take(tensors, file, _NAMES)
    d_in, d_sae = expect_matrix(file, "W_enc", tensors["W_enc"], "[d_in, d_sae]")
    _shapes(file, tensors, d_in, d_sae, {name: name for name in _NAMES})
    # the path as given, made absolute without following links: in the HF cache the file is a
    # link into blobs/, and only the snapshot's folders say `embedding`
    if "embedding" in Path(os.path.abspath(file)).parent.parts:
        # SAELens's gemma_2 loader does this for the hub's embedding/ folders: the SAEs were
        # trained on embeddings after Gemma's sqrt(d_model) scaling, which hook_embed precedes
        tensors["W_enc"] = tensors["W_enc"] / math.sqrt(d_in)
        tensors["W_dec"] = tensors["W_dec"] * math.sqrt(d_in)
    return build(file, "jumprelu", tensors, site=settle_site(Site(), site, file))


def load_gemma_scope_2(folder: Path, site: Site | None = None) -> SAE:
    """The Gemma Scope 2 SAE in `folder` (`config.json` + `params.safetensors`)."""
    config_path, params = folder / CONFIG, folder / PARAMS
    config = read_json(config_path)
    refuse_unless(config, "architecture", config_path, ["jump_relu"],
                  "only Gemma Scope 2's JumpReLU SAEs are loaded here")
    refuse_unless(config, "type", config_path, [None, "sae"],
                  "transcoders and cross-layer transcoders are not SAEs this package models")
    refuse_unless(config, "affine_connection", config_path, [None, False],
                  "an affine skip connection (a transcoder's) is not modelled here")
    hook_in = read_site(config, config_path, "hf_hook_point_in", "hf_hook_point_out",
                        "a module path")
    raw = take(read_safetensors(params), params, ["w_enc", "b_enc", "w_dec", "b_dec",
                                                  "threshold"],
               refused={"affine_skip_connection": "an affine skip connection (a transcoder's), "
                                                  "which this package does not model"})
    d_in, d_sae = expect_matrix(params, "w_enc", raw["w_enc"], "[d_in, d_sae]")
    if raw["w_dec"].dim() != 2:
        raise SAEFormatError(params, f"w_dec has shape {list(raw['w_dec'].shape)}: a "
                             "cross-layer transcoder's decoder, which this package does not "
                             "model", "w_dec")
    tensors = {name: raw[name.lower()].to(FOREIGN_DTYPE) for name in _NAMES}
    _shapes(params, tensors, d_in, d_sae, {name: name.lower() for name in _NAMES})
    if "width" in config and integer(config, "width", config_path) != d_sae:
        raise SAEFormatError(config_path, f"says width={config['width']}, but w_enc in {PARAMS} "
                             f"has {d_sae} features", "width")
    return build(params, "jumprelu", tensors,
                 site=settle_site(Site(hf_hook_name=hook_in), site, config_path))


def _shapes(path: Path, tensors: dict[str, torch.Tensor], d_in: int, d_sae: int,
            keys: dict[str, str]) -> None:
    """Check each tensor's shape, naming it as the file does (`keys`: our name → theirs)."""
    for name, shape in (("b_enc", (d_sae,)), ("W_dec", (d_sae, d_in)), ("b_dec", (d_in,)),
                        ("threshold", (d_sae,))):
        expect_shape(path, keys[name], tensors[name], shape,
                     f"d_in={d_in}, d_sae={d_sae} from the encoder")
