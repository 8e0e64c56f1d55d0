"""Qwen2-MoE family: vLLM's `Qwen2MoeForCausalLM` (models/qwen2_moe.py, checked against vLLM
0.32). Llama layout; MoE layers (`gate`, fused `experts` that include the sigmoid-gated shared
expert) may alternate with dense ones, and each layer gets the host that fits its MLP. Routing is
softmax top-k, renormalised only when `norm_topk_prob` is set."""

from vllm_envoys.family import Family


class Qwen2Moe(Family):
    """Fused `(hidden, residual)` blocks, routed experts plus a shared expert."""

    mixture_of_experts = True
    model_types = ("qwen2_moe",)
