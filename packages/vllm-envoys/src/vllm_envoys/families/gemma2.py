"""Gemma 2 family: vLLM's `Gemma2ForCausalLM` (models/gemma2.py, checked against vLLM 0.32).

Sandwich norms: attention's and the MLP's contributions are the outputs of the norms after them
(`post_attention_layernorm`, `post_feedforward_layernorm`), and the stream after the attention
add enters `pre_feedforward_layernorm`. Attention logits are soft-capped and alternate layers use
a sliding window (both taken from the layer by the pattern). `token_embeddings` is the embedding
before Gemma's `sqrt(hidden)` scale, which vLLM applies after `embed_tokens`."""

from vllm_envoys import layouts
from vllm_envoys.codecs import Rows
from vllm_envoys.eproperty import EProperty
from vllm_envoys.family import Family
from vllm_envoys.hosts import Attention, FusedLayer, GatedMlp
from vllm_envoys.sites import Output


class Gemma2Attention(Attention):
    """The contribution is the post-attention norm's output."""

    attention_output = EProperty(
        Output(), Rows(), layouts.RESIDUAL,
        "attention's contribution to the stream, after its sandwich norm",
        module="../post_attention_layernorm")


class Gemma2Mlp(GatedMlp):
    """The contribution is the post-feedforward norm's output."""

    mlp_output = EProperty(
        Output(), Rows(), layouts.RESIDUAL, "the MLP's contribution, after its sandwich norm",
        module="../post_feedforward_layernorm")


class Gemma2Layer(FusedLayer):
    """Four norms; the fused add happens in `pre_feedforward_layernorm`."""

    Attention = Gemma2Attention
    Mlp = Gemma2Mlp
    mid_norm_name = "pre_feedforward_layernorm"


class Gemma2(Family):
    """Sandwich norms, soft-capped attention, alternating sliding windows."""

    model_types = ("gemma2",)
    Layer = Gemma2Layer
