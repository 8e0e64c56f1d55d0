"""SAEs written to disk as SAELens writes them: random weights, no downloads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

D_IN, D_SAE = 12, 40


def random_weights(architecture: str, seed: int = 0, d_in: int = D_IN, d_sae: int = D_SAE
                   ) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weights = {"W_enc": torch.randn(d_in, d_sae, generator=generator) / d_in ** 0.5,
               "b_enc": torch.randn(d_sae, generator=generator) * 0.1,
               "W_dec": torch.randn(d_sae, d_in, generator=generator) / d_sae ** 0.5,
               "b_dec": torch.randn(d_in, generator=generator) * 0.1}
    if architecture == "jumprelu":
        weights["threshold"] = torch.rand(d_sae, generator=generator) * 0.3
    if architecture == "gated":  # the gate's bias is `b_enc` here (SAELens's `b_gate`)
        weights["b_mag"] = torch.randn(d_sae, generator=generator) * 0.1
        weights["r_mag"] = torch.randn(d_sae, generator=generator) * 0.3
    return weights


def write_saelens(folder: Path, architecture: str, config: dict[str, Any] | None = None,
                  weights: dict[str, torch.Tensor] | None = None) -> Path:
    """A folder in SAELens's native format (`cfg.json` as SAELens 6 writes it)."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = random_weights(architecture) if weights is None else weights
    d_in, d_sae = weights["W_enc"].shape
    written: dict[str, Any] = {
        "architecture": architecture, "d_in": d_in, "d_sae": d_sae, "dtype": "float32",
        "device": "cpu", "apply_b_dec_to_input": True, "normalize_activations": "none",
        "metadata": {"hook_name": "blocks.3.hook_resid_post",
                     "hf_hook_name": "model.layers.3.output", "model_name": "tiny"}}
    if architecture == "topk":
        written["k"] = 5
    written.update(config or {})
    (folder / "cfg.json").write_text(json.dumps(written))
    save_file(weights, str(folder / "sae_weights.safetensors"))
    return folder


# The other release formats, each written as its releases lay it out on disk (file names, key
# names, dtypes and config fields as in the published files), from random weights.

def _randn(generator: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=generator) * scale


def write_gemma_scope(folder: Path, seed: int = 0, d_in: int = D_IN, d_sae: int = D_SAE,
                      names: dict[str, str] | None = None, compressed: bool = False,
                      extra: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Gemma Scope's `params.npz` (numpy's savez, float32: `W_enc [d_in, d_sae]`, `W_dec`,
    `b_enc`, `b_dec`, `threshold`) in `folder`; `names` renames keys (`{"W_enc": "w_enc"}`).
    Returns the weights by our names."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    weights = random_weights("jumprelu", seed, d_in, d_sae)
    arrays: dict[str, Any] = {(names or {}).get(name, name): tensor.numpy()
                              for name, tensor in weights.items()}
    arrays.update(extra or {})
    (np.savez_compressed if compressed else np.savez)(folder / "params.npz", **arrays)
    return weights


def write_gemma_scope_2(folder: Path, seed: int = 0, layer: int = 3, d_in: int = D_IN,
                        d_sae: int = D_SAE, config: dict[str, Any] | None = None,
                        extra: dict[str, torch.Tensor] | None = None
                        ) -> dict[str, torch.Tensor]:
    """Gemma Scope 2's `config.json` + `params.safetensors` (lower-case `w_enc`, `w_dec`)
    for a residual SAE at `layer`. Returns the weights by our names."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = random_weights("jumprelu", seed, d_in, d_sae)
    written = {"width": d_sae, "model_name": "google/gemma-3-1b-pt", "architecture": "jump_relu",
               "l0": 60, "affine_connection": False,
               "hf_hook_point_in": f"model.layers.{layer}.output",
               "hf_hook_point_out": f"model.layers.{layer}.output", "type": "sae"}
    written.update(config or {})
    (folder / "config.json").write_text(json.dumps(written))
    save_file({name.lower(): tensor for name, tensor in weights.items()} | (extra or {}),
              str(folder / "params.safetensors"))
    return weights


def write_llama_scope(folder: Path, seed: int = 0, layer: int = 3, d_in: int = D_IN,
                      d_sae: int = D_SAE, norm: float = 6.3125, threshold: float = 0.2021484375,
                      config: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32
                      ) -> dict[str, torch.Tensor]:
    """Llama Scope's `hyperparams.json` + `checkpoints/final.safetensors` (lm-saes's names:
    `encoder.weight [d_sae, d_in]`, `decoder.weight [d_in, d_sae]`, their biases). Returns the
    file's tensors by its names."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {"encoder.weight": _randn(generator, d_sae, d_in, scale=d_in ** -0.5),
               "encoder.bias": _randn(generator, d_sae, scale=0.1),
               "decoder.weight": _randn(generator, d_in, d_sae, scale=d_sae ** -0.5),
               "decoder.bias": _randn(generator, d_in, scale=0.1)}
    tensors = {name: tensor.to(dtype) for name, tensor in tensors.items()}
    hook = f"blocks.{layer}.hook_resid_post"
    written = {"d_model": d_in, "d_sae": d_sae, "expansion_factor": d_sae // d_in,
               "hook_point_in": hook, "hook_point_out": hook, "act_fn": "jumprelu",
               "jump_relu_threshold": threshold, "top_k": 50,
               "apply_decoder_bias_to_pre_encoder": False, "norm_activation": "dataset-wise",
               "dataset_average_activation_norm": {"in": norm, "out": norm}}
    written.update(config or {})
    (folder / "checkpoints").mkdir(parents=True, exist_ok=True)
    (folder / "hyperparams.json").write_text(json.dumps(written))
    save_file(tensors, str(folder / "checkpoints" / "final.safetensors"))
    return tensors


def write_sparsify(folder: Path, seed: int = 0, d_in: int = D_IN, d_sae: int = 4 * D_IN,
                   k: int = 6, config: dict[str, Any] | None = None,
                   dtype: torch.dtype = torch.bfloat16,
                   extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One hookpoint's folder as sparsify's `SparseCoder.save_to_disk` writes it: `cfg.json`
    (`SparseCoderConfig.to_dict()` plus `d_in`) and `sae.safetensors` (`encoder.weight
    [num_latents, d_in]`, `encoder.bias`, `W_dec [num_latents, d_in]`, `b_dec`; bfloat16 as
    released). The run's `config.json` goes beside it, as sparsify's trainer writes it. Returns
    the file's tensors by its names (in `dtype`)."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {"encoder.weight": _randn(generator, d_sae, d_in, scale=d_in ** -0.5),
               "encoder.bias": _randn(generator, d_sae, scale=0.1),
               "W_dec": _randn(generator, d_sae, d_in, scale=d_sae ** -0.5),
               "b_dec": _randn(generator, d_in, scale=0.3)}
    tensors = {name: tensor.to(dtype) for name, tensor in tensors.items()} | (extra or {})
    written = {"activation": "topk", "expansion_factor": d_sae // d_in,
               "normalize_decoder": True, "num_latents": d_sae, "k": k, "multi_topk": False,
               "skip_connection": False, "transcode": False, "d_in": d_in}
    written.update(config or {})
    (folder / "cfg.json").write_text(json.dumps(written))
    save_file(tensors, str(folder / "sae.safetensors"))
    (folder.parent / "config.json").write_text(json.dumps({
        "sae": {key: value for key, value in written.items() if key != "d_in"},
        "model": "EleutherAI/pythia-70m", "hookpoints": [folder.name], "batch_size": 8}))
    return tensors
