"""EleutherAI's sparsify (`SparseCoder.save_to_disk`): TopK SAEs, one folder per hookpoint.

A run saves `{run}/{hookpoint}/` for each hookpoint it trained on (`layers.6`, `layers.6.mlp`,
`embed_tokens`; module paths under the HF model's base model, so `layers.6` is
`model.layers.6` in a Llama), each with `cfg.json` (`SparseCoderConfig`: `activation`, `k`,
`num_latents`, `expansion_factor`, `normalize_decoder`, `transcode`, `skip_connection`, ...,
plus `d_in`) and `sae.safetensors` (`encoder.weight [d_sae, d_in]`, `encoder.bias`,
`W_dec [d_sae, d_in]`, `b_dec`; bfloat16 in the released SAEs). Load one hookpoint's folder;
its name is the site's `hf_hook_name` (`SITE_NAMES` maps sparsify's names).

sparsify's math: `relu((x - b_dec) @ encoder.weight.T + encoder.bias)`, the `k` largest kept,
decoded by `W_dec` plus `b_dec`. So `W_enc = encoder.weight.T` and `apply_b_dec_to_input` is
true (sparsify subtracts `b_dec` before encoding for every SAE; only transcoders skip it).
GroupMax activations, transcoders, skip connections and the other extras are refused by name.
"""

from __future__ import annotations

from pathlib import Path

from saecodec.errors import SAEFormatError
from saecodec.formats._files import (
    FOREIGN_DTYPE,
    MODULE_PATH,
    build,
    expect_matrix,
    expect_shape,
    integer,
    read_json,
    read_safetensors,
    refuse_unless,
    settle_site,
    take,
)
from saecodec.sae import SAE, Site

CONFIG = "cfg.json"
WEIGHTS = "sae.safetensors"
#: `SparseCoderConfig` fields by which a sparse coder computes what an `SAE` does not.
_UNMODELLED = {
    "transcode": "a transcoder (it predicts a module's output from its input)",
    "skip_connection": "a linear skip connection",
    "embed_skip": "an affine skip connection from the embeddings",
    "gram_lookup": "an n-gram mean subtracted from its input",
    "signed": "signed activations",
}


def load(folder: Path, site: Site | None = None) -> SAE:
    """The sparsify SAE in hookpoint folder `folder` (`cfg.json` + `sae.safetensors`)."""
    config_path, weights = folder / CONFIG, folder / WEIGHTS
    config = read_json(config_path)
    refuse_unless(config, "activation", config_path, [None, "topk"],
                  "only TopK sparse coders are loaded here")
    for key, what in _UNMODELLED.items():
        refuse_unless(config, key, config_path, [None, False],
                      f"{what}, which this package does not model")
    k = integer(config, "k", config_path)
    d_in_said = integer(config, "d_in", config_path)
    raw = take(read_safetensors(weights), weights,
               ["encoder.weight", "encoder.bias", "W_dec", "b_dec"],
               refused={"W_skip": "a linear skip connection, which this package does not "
                                  "model"})
    raw = {name: tensor.to(FOREIGN_DTYPE) for name, tensor in raw.items()}
    d_sae, d_in = expect_matrix(weights, "encoder.weight", raw["encoder.weight"],
                                "[num_latents, d_in]")
    if d_in != d_in_said:
        raise SAEFormatError(config_path, f"says d_in={d_in_said}, but encoder.weight in "
                             f"{WEIGHTS} reads {d_in}", "d_in")
    latents = integer(config, "num_latents", config_path, default=0)
    if latents:
        if latents != d_sae:
            raise SAEFormatError(config_path, f"says num_latents={latents}, but "
                                 f"encoder.weight in {WEIGHTS} has {d_sae}", "num_latents")
    elif "expansion_factor" in config and \
            integer(config, "expansion_factor", config_path) * d_in != d_sae:
        raise SAEFormatError(config_path, f"says expansion_factor={config['expansion_factor']}"
                             f" (num_latents 0), but encoder.weight in {WEIGHTS} has {d_sae} "
                             f"latents for d_in={d_in}", "expansion_factor")
    if not 0 < k <= d_sae:
        raise SAEFormatError(config_path, f"k={k} must be in 1..{d_sae}", "k")
    meaning = f"d_in={d_in}, num_latents={d_sae} from encoder.weight"
    for key, shape in (("encoder.bias", (d_sae,)), ("W_dec", (d_sae, d_in)),
                       ("b_dec", (d_in,))):
        expect_shape(weights, key, raw[key], shape, meaning)
    tensors = {"W_enc": raw["encoder.weight"].T.contiguous(), "b_enc": raw["encoder.bias"],
               "W_dec": raw["W_dec"], "b_dec": raw["b_dec"]}
    named = Site(hf_hook_name=_hookpoint(folder, config.get("hookpoint")))
    return build(weights, "topk", tensors, k=k, apply_b_dec_to_input=True,
                 site=settle_site(named, site, config_path))


def _hookpoint(folder: Path, named: object) -> str | None:
    """The hookpoint: `cfg.json`'s `hookpoint` where it has one, else the folder's name, which
    sparsify gives it; `None` where that is no module path (a folder the user renamed), rather
    than a site nothing maps."""
    name = named if isinstance(named, str) else folder.resolve().name
    return name if MODULE_PATH.match(name) else None
