"""Phi-3 family: vLLM's `Phi3ForCausalLM`, which is `LlamaForCausalLM` with Phi-3's weight names
(models/phi3.py, checked against vLLM 0.32); so its layout is Llama's."""

from vllm_envoys.family import Family


class Phi3(Family):
    """Llama layout (fused QKV and gate-up, which Phi-3's checkpoints already fuse)."""

    model_types = ("phi3",)
