"""Qwen2 family: vLLM's `Qwen2ForCausalLM` (models/qwen2.py, checked against vLLM 0.32). Same
module layout as Llama; its QKV projection has a bias, which the values do not depend on."""

from vllm_envoys.family import Family


class Qwen2(Family):
    """Fused `(hidden, residual)` blocks, fused QKV with bias, gated SiLU MLP."""

    model_types = ("qwen2",)
