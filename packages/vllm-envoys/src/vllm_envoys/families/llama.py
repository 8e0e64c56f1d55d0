"""Llama family: Llama 2 and 3, SmolLM2, Mistral — vLLM's `LlamaForCausalLM` (models/llama.py,
checked against vLLM 0.32). Its layout is vLLM's common one, so nothing is overridden."""

from vllm_envoys.family import Family


class Llama(Family):
    """Fused `(hidden, residual)` blocks, fused QKV, gated SiLU MLP."""

    model_types = ("llama", "mistral")
