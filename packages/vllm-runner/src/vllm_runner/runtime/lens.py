"""The logit lens the `Lens` op runs: residual rows through the model's own final norm and
`compute_logits` (which applies its unembedding, scale and soft-cap)."""

from __future__ import annotations

from typing import Any

import torch
from vllm_envoys import Standardized

#: Rows projected at once: their logits are `rows x vocabulary` (in float32 for the softmax:
#: 256 MB for 256 rows of a 256k vocabulary), however many rows a step's prompts hold.
LENS_ROWS = 256


class ModelLens:
    """`(rows, top_k) -> (probabilities, tokens)` on the served model. `active` is true while
    it runs, so the sampler's hook on the same `compute_logits` can tell it apart."""

    def __init__(self, standard: Standardized) -> None:
        self._standard = standard
        self.active = False

    def __call__(self, rows: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k next-token probabilities and tokens of `rows` (`[1, tokens, hidden]`), each
        `[tokens, top_k]`, `LENS_ROWS` rows at a time (every rank cuts alike: under tensor
        parallelism each piece's logits are gathered)."""
        model: Any = self._standard.module  # a vLLM model: `compute_logits` is its own
        norm = model.get_submodule(self._standard.family.norm)
        found = [self._top_k(model, norm, piece, top_k) for piece in rows[0].split(LENS_ROWS)]
        if len(found) == 1:
            return found[0]
        return (torch.cat([probabilities for probabilities, _ in found]),
                torch.cat([tokens for _, tokens in found]))

    def _top_k(self, model: Any, norm: Any, rows: torch.Tensor, top_k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.active = True
        try:
            logits = model.compute_logits(norm(rows))
        finally:
            self.active = False
        probabilities, tokens = logits.float().softmax(-1).topk(top_k, dim=-1)
        return probabilities, tokens
