"""OLMoE family: vLLM's `OlmoeForCausalLM` (models/olmoe.py, checked against vLLM 0.32). Llama
layout with q and k RMS-normed over the whole projection before the rotary embedding, and a
mixture-of-experts MLP (`gate`, fused `experts`); softmax top-k routing, not renormalised."""

from vllm_envoys.family import Family


class Olmoe(Family):
    """Fused `(hidden, residual)` blocks, routed experts."""

    mixture_of_experts = True
    model_types = ("olmoe",)
