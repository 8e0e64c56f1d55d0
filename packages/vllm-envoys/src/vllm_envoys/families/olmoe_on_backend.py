"""OLMoE on vLLM's Transformers backend, where vLLM 0.34 serves it (its registry maps
`OlmoeForCausalLM` to `TransformersMoEForCausalLM`; 0.32 and 0.33 ran vLLM's own `olmoe.py`,
the `Olmoe` family). A pre-norm block with q and k RMS-normed before the rotary embedding; the
backend fuses the gate and experts into vLLM's MoE runner (softmax top-k, not renormalised)."""

from vllm_envoys.transformers_backend import TransformersBackend


class OlmoeOnBackend(TransformersBackend):
    """transformers' OLMoE modules, the MoE block's gate and experts fused by vLLM."""

    mixture_of_experts = True
    model_types = ("olmoe",)
