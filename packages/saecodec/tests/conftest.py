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
