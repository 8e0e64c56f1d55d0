"""SAELens's native format, read and written.

A folder with `cfg.json` (its `architecture`, `d_in`, `d_sae`, `dtype`,
`apply_b_dec_to_input`, `normalize_activations`, `k` for TopK, and the site as `hook_name` /
`hf_hook_name`, top-level or under `metadata` as SAELens 6 writes them) and
`sae_weights.safetensors` (`W_enc [d_in, d_sae]`, `b_enc`, `W_dec [d_sae, d_in]`, `b_dec`,
`threshold` for JumpReLU; a gated SAE has `b_gate`, `b_mag` and `r_mag` instead of `b_enc`).
Loaded in the config's `dtype`. Every failure names the file and the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from saecodec.errors import SAEFormatError
from saecodec.formats._files import build, field, read_json, read_safetensors, settle_site
from saecodec.sae import ARCHITECTURES, SAE, Site

CONFIG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
#: The weights besides `W_enc`, `W_dec` and `b_dec` of each architecture that has others than
#: `b_enc`.
ARCHITECTURE_WEIGHTS = {"jumprelu": ["b_enc", "threshold"], "gated": ["b_gate", "b_mag", "r_mag"]}
#: Activation normalisations that leave the input as it is (others are refused by name).
PLAIN_NORMALISATIONS = (None, "none")


def load(path: str | Path, site: Site | None = None) -> SAE:
    """The SAE in folder `path` (SAELens native: `cfg.json` + `sae_weights.safetensors`);
    `site` completes the site `cfg.json` names (see `saecodec.formats.load`)."""
    folder = Path(path)
    if not folder.is_dir():
        raise SAEFormatError(folder, "is not a folder holding an SAE (cfg.json and "
                                     "sae_weights.safetensors)")
    config = read_json(folder / CONFIG)
    architecture = field(config, "architecture", folder / CONFIG, default="standard")
    if architecture not in ARCHITECTURES:
        raise SAEFormatError(folder / CONFIG, f"architecture {architecture!r} is not loaded "
                             f"here (known: {', '.join(ARCHITECTURES)})", "architecture")
    normalisation = config.get("normalize_activations")
    if normalisation not in PLAIN_NORMALISATIONS:
        raise SAEFormatError(folder / CONFIG, f"normalize_activations {normalisation!r} is not "
                             "supported yet: only SAEs trained on raw activations ('none')",
                             "normalize_activations")
    for key, plain in (("reshape_activations", (None, "none")),
                       ("rescale_acts_by_decoder_norm", (None, False))):
        if config.get(key) not in plain:
            raise SAEFormatError(folder / CONFIG, f"{key}={config.get(key)!r} is not "
                                 "supported yet", key)
    names = ["W_enc", "W_dec", "b_dec", *ARCHITECTURE_WEIGHTS.get(architecture, ["b_enc"])]
    tensors = read_safetensors(folder / WEIGHTS, names)
    if architecture == "gated":
        tensors["b_enc"] = tensors.pop("b_gate")
    dtype = _dtype(config.get("dtype"), folder / CONFIG)
    if dtype is not None:
        tensors = {name: tensor.to(dtype) for name, tensor in tensors.items()}
    d_in, d_sae = (int(size) for size in tensors["W_enc"].shape)
    for key, size in (("d_in", d_in), ("d_sae", d_sae)):
        if key in config and int(config[key]) != size:
            raise SAEFormatError(folder / CONFIG, f"says {key}={config[key]}, but W_enc in "
                                 f"{WEIGHTS} is [{d_in}, {d_sae}]", key)
    found = config.get("metadata")
    metadata: dict[str, Any] = found if isinstance(found, dict) else {}
    named = Site(hook_name=config.get("hook_name") or metadata.get("hook_name"),
                 hf_hook_name=config.get("hf_hook_name") or metadata.get("hf_hook_name"))
    k = field(config, "k", folder / CONFIG) if architecture == "topk" else None
    return build(folder, architecture, tensors, k=None if k is None else int(k),
                 apply_b_dec_to_input=bool(config.get("apply_b_dec_to_input", False)),
                 site=settle_site(named, site, folder / CONFIG))


def save(sae: SAE, path: str | Path) -> None:
    """`sae` as a folder in SAELens's native format, in the layout SAELens 6 writes."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "architecture": sae.architecture, "d_in": sae.d_in, "d_sae": sae.d_sae,
        "dtype": str(sae.dtype).removeprefix("torch."), "device": "cpu",
        "apply_b_dec_to_input": sae.apply_b_dec_to_input, "normalize_activations": "none",
        "reshape_activations": "none",
        "metadata": {key: value for key, value in (("hook_name", sae.site.hook_name),
                                                   ("hf_hook_name", sae.site.hf_hook_name))
                     if value is not None}}
    if sae.k is not None:
        config["k"] = sae.k
        config["rescale_acts_by_decoder_norm"] = False
    tensors = {"W_enc": sae.W_enc, "b_gate" if sae.architecture == "gated" else "b_enc":
               sae.b_enc, "W_dec": sae.W_dec, "b_dec": sae.b_dec}
    for name in ("threshold", "b_mag", "r_mag"):
        if (tensor := getattr(sae, name)) is not None:
            tensors[name] = tensor
    save_file({name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()},
              str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(config, indent=2))


def _dtype(name: Any, path: Path) -> torch.dtype | None:
    """`"float32"` or `"torch.float32"` as a torch dtype; `None` (keep the file's) if unset."""
    if name is None:
        return None
    found = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise SAEFormatError(path, f"dtype {name!r} is not a torch dtype", "dtype")
    return found
