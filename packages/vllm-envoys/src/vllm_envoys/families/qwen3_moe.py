"""Qwen3-MoE family: vLLM's `Qwen3MoeForCausalLM` (models/qwen3_moe.py, checked against vLLM
0.32). Qwen3's attention (per-head q/k norm) with a mixture-of-experts MLP (`gate`, fused
`experts`; the MoE runner calls the gate itself), dense on `mlp_only_layers`. Routing is softmax
top-k, renormalised when `norm_topk_prob` is set."""

from vllm_envoys.family import Family


class Qwen3Moe(Family):
    """Fused `(hidden, residual)` blocks, routed experts."""

    mixture_of_experts = True
    model_types = ("qwen3_moe",)
