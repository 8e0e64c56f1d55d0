"""OpenMOSS's Llama Scope releases (`fnlp/Llama3_1-8B-Base-LX{R,A,M}-{8,32}x`): JumpReLU SAEs
trained on activations rescaled to norm `sqrt(d_model)`, loaded as SAELens 6.54's
`llama_scope` loader and `from_pretrained` load them.

A folder (`Llama3_1-8B-Base-L{L}{R,A,M}-{8,32}x/`) with `hyperparams.json` (`d_model`, `d_sae`,
`hook_point_in`, `hook_point_out`, `act_fn`, `jump_relu_threshold`, one scalar for every
feature, `norm_activation: "dataset-wise"`, `dataset_average_activation_norm: {in, out}`,
`apply_decoder_bias_to_pre_encoder`) and `checkpoints/final.safetensors` (`encoder.weight
[d_sae, d_in]`, `encoder.bias`, `decoder.weight [d_in, d_sae]`, `decoder.bias`). The site is
`hook_point_in`, a TransformerLens name (`blocks.{L}.hook_resid_post`).

The dataset norm is folded in, so the SAE reads raw activations, exactly as SAELens does it:
with `s = sqrt(d_model) / dataset_average_activation_norm["in"]`, `W_enc = encoder.weight.T * s`,
`b_enc = encoder.bias`, `W_dec = decoder.weight.T / s`, `b_dec = decoder.bias / s`, and every
threshold `jump_relu_threshold * s` (SAELens scales the threshold with `W_enc`; it leaves
`b_enc` as it is). Transcoders (`hook_point_out` not `hook_point_in`), a decoder bias taken from
the input, GLU encoders and activations other than JumpReLU are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from saecodec.errors import SAEFormatError
from saecodec.formats._files import (
    FOREIGN_DTYPE,
    build,
    expect_matrix,
    expect_shape,
    integer,
    number,
    read_json,
    read_safetensors,
    read_site,
    refuse_unless,
    settle_site,
    take,
)
from saecodec.sae import SAE, Site

CONFIG = "hyperparams.json"
WEIGHTS = "checkpoints/final.safetensors"


def load(folder: Path, site: Site | None = None) -> SAE:
    """The Llama Scope SAE in `folder` (`hyperparams.json` + `checkpoints/final.safetensors`)."""
    config_path, weights = folder / CONFIG, folder / WEIGHTS
    config = read_json(config_path)
    refuse_unless(config, "act_fn", config_path, [None, "jumprelu"],
                  "only Llama Scope's JumpReLU SAEs are loaded here")
    refuse_unless(config, "norm_activation", config_path, [None, "dataset-wise"],
                  "only the dataset-wise norm the releases use is folded in here")
    for key in ("apply_decoder_bias_to_pre_encoder", "use_glu_encoder"):
        refuse_unless(config, key, config_path, [None, False],
                      "not modelled here (SAELens's loader ignores it too)")
    hook_in = read_site(config, config_path, "hook_point_in", "hook_point_out", "a hook name")
    d_model = integer(config, "d_model", config_path)
    threshold = number(config, "jump_relu_threshold", config_path)
    norm = _norm_in(config, config_path)
    raw = take(read_safetensors(weights), weights,
               ["encoder.weight", "encoder.bias", "decoder.weight", "decoder.bias"],
               ignored=["dataset_average_activation_norm."])  # the hyperparams' norms again
    raw = {name: tensor.to(FOREIGN_DTYPE) for name, tensor in raw.items()}
    d_sae, d_in = expect_matrix(weights, "encoder.weight", raw["encoder.weight"],
                                "[d_sae, d_in]")
    if d_in != d_model:
        raise SAEFormatError(config_path, f"says d_model={d_model}, but encoder.weight in "
                             f"{WEIGHTS} reads {d_in}", "d_model")
    if "d_sae" in config and integer(config, "d_sae", config_path) != d_sae:
        raise SAEFormatError(config_path, f"says d_sae={config['d_sae']}, but encoder.weight "
                             f"in {WEIGHTS} has {d_sae} features", "d_sae")
    meaning = f"d_in={d_in}, d_sae={d_sae} from encoder.weight"
    for key, shape in (("encoder.bias", (d_sae,)), ("decoder.weight", (d_in, d_sae)),
                       ("decoder.bias", (d_in,))):
        expect_shape(weights, key, raw[key], shape, meaning)
    # SAELens's order, so the float32 results are the same bits: transpose, then fold
    scale = d_model ** 0.5 / norm
    tensors = {"W_enc": raw["encoder.weight"].T.contiguous() * scale,
               "b_enc": raw["encoder.bias"],
               "W_dec": raw["decoder.weight"].T.contiguous() / scale,
               "b_dec": raw["decoder.bias"] / scale,
               "threshold": torch.ones(d_sae, dtype=FOREIGN_DTYPE) * (threshold * scale)}
    return build(weights, "jumprelu", tensors,
                 site=settle_site(Site(hook_name=hook_in), site, config_path))


def _norm_in(config: dict[str, Any], path: Path) -> float:
    """The dataset's average input norm, `dataset_average_activation_norm["in"]`; an `out`
    that differs from it (a transcoder's, whose decoder needs its own factor) is refused."""
    key = "dataset_average_activation_norm"
    norms = config.get(key)
    if not isinstance(norms, dict):
        raise SAEFormatError(path, f"{key}={norms!r} is not an object with an 'in' norm", key)
    norm = number(norms, "in", path, positive=True, name=f"{key}.in")
    if "out" in norms and norms["out"] is not None and \
            number(norms, "out", path, positive=True, name=f"{key}.out") != norm:
        raise SAEFormatError(path, f"{key} has out={norms['out']} unlike in={norm}: the "
                             "decoder would need its own factor (a transcoder's)", f"{key}.out")
    return norm
