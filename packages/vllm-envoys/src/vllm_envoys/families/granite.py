"""Granite family: vLLM's `GraniteForCausalLM` (models/granite.py, checked against vLLM 0.32).

Blocks take and return the whole stream and scale each sublayer's output by the config's
`residual_multiplier` before adding it, so attention's and the MLP's contributions are their
outputs times that factor (read scaled, written back divided by it). `token_embeddings` is the
embedding before the `embedding_multiplier`; logits are divided by `logits_scaling`, as
sampled. Attention's scale is the config's `attention_multiplier`, which the pattern takes from
the layer."""

from vllm_envoys import layouts
from vllm_envoys.codecs import Scaled
from vllm_envoys.eproperty import EProperty
from vllm_envoys.family import Family
from vllm_envoys.hosts import Attention, GatedMlp, StreamLayer
from vllm_envoys.node import Node
from vllm_envoys.sites import Output


def residual_multiplier(host: Node) -> float:
    """The factor the block (the host's parent) applies to its sublayers' outputs."""
    factor = host.submodule("../").residual_multiplier
    if not isinstance(factor, (int, float)):  # nn.Module types attributes as tensors or modules
        raise TypeError(f"{host.location}: the block's residual_multiplier is {factor!r}")
    return float(factor)


class GraniteAttention(Attention):
    """The contribution is the attention's output times the residual multiplier."""

    attention_output = EProperty(Output(), Scaled(residual_multiplier), layouts.RESIDUAL,
                                 "attention's contribution, times the residual multiplier")


class GraniteMlp(GatedMlp):
    """The contribution is the MLP's output times the residual multiplier."""

    mlp_output = EProperty(Output(), Scaled(residual_multiplier), layouts.RESIDUAL,
                           "the MLP's contribution, times the residual multiplier")


class GraniteLayer(StreamLayer):
    """`input_layernorm` → attention → scaled add → `post_attention_layernorm` → MLP → scaled
    add."""

    Attention = GraniteAttention
    Mlp = GraniteMlp


class Granite(Family):
    """Stream-in/stream-out blocks with scaled residual adds."""

    model_types = ("granite",)
    Layer = GraniteLayer
