"""The logit lens the `Lens` op runs: residual rows through the model's own final norm and
`compute_logits` (which applies its unembedding, scale and soft-cap)."""

from __future__ import annotations

from typing import Any

import torch
from vllm_envoys import Standardized


class ModelLens:
    """`(rows, top_k) -> (probabilities, tokens)` on the served model. `active` is true while
    it runs, so the sampler's hook on the same `compute_logits` can tell it apart."""

    def __init__(self, standard: Standardized) -> None:
        self._standard = standard
        self.active = False

    def __call__(self, rows: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k next-token probabilities and tokens of `rows` (`[1, tokens, hidden]`), each
        `[tokens, top_k]`."""
        model: Any = self._standard.module  # a vLLM model: `compute_logits` is its own
        norm = model.get_submodule(self._standard.family.norm)
        self.active = True
        try:
            logits = model.compute_logits(norm(rows[0]))
        finally:
            self.active = False
        probabilities, tokens = logits.float().softmax(-1).topk(top_k, dim=-1)
        return probabilities, tokens
