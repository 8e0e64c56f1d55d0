"""EXAONE 4 family: vLLM's `Exaone4ForCausalLM` (models/exaone4.py, checked against vLLM 0.32).

Norms come after each sublayer (no pre-norms): attention's and the MLP's contributions are the
outputs of `post_attention_layernorm` and `post_feedforward_layernorm`, and the stream after
the attention add goes straight into the MLP, so `layer_mid` is read at the MLP's input
(read-only: the block keeps that stream in a local variable; edit `attention_output`). Blocks
take the whole stream as `hidden_states` and return `(stream, stream after the attention add)`;
the second item is not added to the first. q and k are RMS-normed per head before the rotary
embedding; layers may alternate sliding-window and global attention."""

from vllm_envoys import layouts
from vllm_envoys.codecs import Rows
from vllm_envoys.eproperty import EProperty
from vllm_envoys.family import Family
from vllm_envoys.hosts import Attention, GatedMlp, StreamLayer
from vllm_envoys.sites import Output


class Exaone4Attention(Attention):
    """The contribution is the post-attention norm's output."""

    attention_output = EProperty(Output(), Rows(), layouts.RESIDUAL,
                                 "attention's contribution, after its norm",
                                 module="../post_attention_layernorm")


class Exaone4Mlp(GatedMlp):
    """The contribution is the post-feedforward norm's output."""

    mlp_output = EProperty(Output(), Rows(), layouts.RESIDUAL,
                           "the MLP's contribution, after its norm",
                           module="../post_feedforward_layernorm")


class Exaone4Layer(StreamLayer):
    """Post-norm block over the whole stream; it returns `(stream, mid stream)`."""

    Attention = Exaone4Attention
    Mlp = Exaone4Mlp
    mid_norm_name = "mlp"

    layer_output = EProperty(Output(0), Rows(), layouts.RESIDUAL,
                             "the residual stream leaving the block")


class Exaone4(Family):
    """Post-norm blocks over the whole stream."""

    model_types = ("exaone4",)
    Layer = Exaone4Layer
