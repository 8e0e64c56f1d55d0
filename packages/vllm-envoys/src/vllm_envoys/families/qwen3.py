"""Qwen3 family: vLLM's `Qwen3ForCausalLM` (models/qwen3.py, checked against vLLM 0.32). Llama
layout; q and k are RMS-normed per head before the rotary embedding, inside the attention
forward, so `attention_queries`/`attention_keys` (the `attn` inputs) already include the norm."""

from vllm_envoys.family import Family


class Qwen3(Family):
    """Fused `(hidden, residual)` blocks, fused QKV, per-head q/k norm, gated SiLU MLP."""

    model_types = ("qwen3",)
