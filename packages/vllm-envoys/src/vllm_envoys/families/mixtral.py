"""Mixtral family: vLLM's `MixtralForCausalLM` (models/mixtral.py, checked against vLLM 0.32).
Llama layout with a mixture-of-experts MLP named `block_sparse_moe` (softmax router, top-k
renormalised)."""

from vllm_envoys.family import Family
from vllm_envoys.hosts import FusedLayer


class MixtralLayer(FusedLayer):
    """The MLP is `block_sparse_moe`: `gate` then fused `experts`."""

    mlp_name = "block_sparse_moe"


class Mixtral(Family):
    """Fused `(hidden, residual)` blocks with routed experts."""

    mixture_of_experts = True
    model_types = ("mixtral",)
    Layer = MixtralLayer
