"""GPT-OSS family: vLLM's `GptOssForCausalLM` (models/gpt_oss.py, checked against vLLM 0.32).

Fused `(hidden, residual)` blocks named `attn` and `mlp` (the block takes `hidden_states`
first); attention has per-head sinks, which the recomputed pattern includes (probabilities do not
sum to one: the sink takes the rest), and sliding windows on even layers. Every MLP is a mixture
of experts whose router is `router` and returns logits alone; the experts' clamped SwiGLU runs
in the fused kernel. Top-k then softmax over the chosen logits equals softmax, top-k and
renormalising, which is how the routing is recomputed."""

from vllm_envoys.family import Family
from vllm_envoys.hosts import FusedLayer, Moe


class GptOssMoe(Moe):
    """`router` (a linear with a bias, logits only) → fused `experts`."""

    gate_name = "router"


class GptOssLayer(FusedLayer):
    """`input_layernorm` → `attn` → fused add-norm → `mlp` (experts)."""

    Moe = GptOssMoe
    attention_name = "attn"


class GptOss(Family):
    """Sinks in attention, routed experts everywhere."""

    mixture_of_experts = True
    model_types = ("gpt_oss",)
    embed_tokens = "model.embedding"
    Layer = GptOssLayer
