"""Expert routing of a mixture-of-experts MLP, recomputed from its router logits.

vLLM's fused MoE kernel chooses experts inside the kernel, so the chosen experts and their
weights are never a module's input or output. They are recomputed from the gate's logits with
the layer's own router settings (scoring function, top-k, renormalisation), read-only: to change
the routing, edit `router_logits`, which the kernel does consume.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_envoys.codecs import Codec
from vllm_envoys.node import Node

UNSUPPORTED_ROUTER = (
    "this MoE layer routes with grouped top-k, a score-correction bias, a custom routing function "
    "or a routing scale, which the recomputation does not reproduce; read router_logits"
)


def router_of(experts: nn.Module) -> Any:
    """The routing settings object of vLLM's MoE runner (vLLM 0.32: `MoERunner.router`)."""
    return experts.router


def unsupported(router: Any) -> bool:
    """Whether the router does something `Routing` does not recompute."""
    return bool(
        getattr(router, "use_grouped_topk", False)
        or getattr(router, "custom_routing_function", None) is not None
        or getattr(router, "e_score_correction_bias", None) is not None
        or getattr(router, "routed_scaling_factor", 1.0) != 1.0
        or getattr(router, "scoring_func", "softmax") not in ("softmax", "sigmoid")
    )


def route(logits: torch.Tensor, router: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights, indices)`, each `[tokens, top_k]`, as the router would choose them."""
    scores = logits.float()
    scores = scores.softmax(-1) if router.scoring_func == "softmax" else scores.sigmoid()
    weights, indices = scores.topk(router.top_k, dim=-1)
    if router.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), indices


class Routing(Codec):
    """Read-only codec over the gate's logits giving expert weights or expert indices."""

    writable = False

    def __init__(self, experts_path: str, weights: bool) -> None:
        self.experts_path = experts_path
        self.weights = weights

    def _router(self, host: Node | None) -> Any:
        if host is None:
            raise TypeError("expert routing is read with the router settings of its host's "
                            "experts: pass the host")
        return router_of(host.submodule(self.experts_path))

    def decode(self, piece: torch.Tensor, module: nn.Module, host: Node | None = None
               ) -> torch.Tensor:
        weights, indices = route(piece, self._router(host))
        return (weights if self.weights else indices).unsqueeze(0)

    def shape(self, piece: torch.Tensor, module: nn.Module, host: Node | None = None
              ) -> tuple[int, ...]:
        return (1, piece.shape[0], self._router(host).top_k)
