"""OLMo 2 family: served by vLLM 0.32 through its Transformers backend (no vLLM model code).

Norms come after each sublayer (no pre-norms): attention's and the MLP's contributions are the
outputs of `post_attention_layernorm` and `post_feedforward_layernorm`, and the stream after the
attention add goes straight into the MLP, so `layer_mid` is read at the MLP's input."""

from vllm_envoys import layouts
from vllm_envoys.eproperty import EProperty
from vllm_envoys.sites import FirstOutput
from vllm_envoys.transformers_backend import (
    BATCHED,
    BackendAttention,
    BackendLayer,
    BackendMlp,
    TransformersBackend,
)


class Olmo2Attention(BackendAttention):
    """The contribution is the post-attention norm's output."""

    attention_output = EProperty(FirstOutput(), BATCHED, layouts.RESIDUAL,
                                 "attention's contribution, after its norm",
                                 module="../post_attention_layernorm")


class Olmo2Mlp(BackendMlp):
    """The contribution is the post-feedforward norm's output."""

    mlp_output = EProperty(FirstOutput(), BATCHED, layouts.RESIDUAL,
                           "the MLP's contribution, after its norm",
                           module="../post_feedforward_layernorm")


class Olmo2Layer(BackendLayer):
    """Post-norm block; the mid stream is the MLP's input."""

    Attention = Olmo2Attention
    Mlp = Olmo2Mlp
    mid_norm_name = "mlp"


class Olmo2(TransformersBackend):
    """OLMo 2 on vLLM's Transformers backend."""

    model_types = ("olmo2",)
    Layer = Olmo2Layer
