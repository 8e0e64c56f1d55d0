"""Hosts for models vLLM serves through its Transformers backend (`model_impl="transformers"`,
or architectures vLLM has no code for), checked against vLLM 0.32.

There vLLM runs transformers' own modules with a batch axis of 1 (`[1, tokens, ...]`) and the
residual stream is whole (no `(hidden, residual)` halves), but swaps in its attention: the
backend's attention function calls the vLLM `Attention` layer's `forward` directly, so no hook
can see queries, keys, values or head outputs there. The generic family serves the residual
stream, attention's and the MLP's inputs and contributions, and the MLP neurons.
"""

from __future__ import annotations

from vllm_envoys import layouts
from vllm_envoys.codecs import Rows
from vllm_envoys.eproperty import EProperty, unavailable
from vllm_envoys.family import Family
from vllm_envoys.hosts import Attention, GatedMlp, Layer, Model
from vllm_envoys.node import module_from
from vllm_envoys.sites import Arguments, FirstOutput

BACKEND_ATTENTION = (
    "vLLM's Transformers backend calls its attention layer's forward directly from transformers' "
    "attention function, so no hook sees the queries, keys, values or head outputs; serve the "
    "model with vLLM's own model code (a family module) to read them"
)
UNKNOWN_ACTIVATION = (
    "on vLLM's Transformers backend the MLP's activation is not identified; read mlp_neurons, "
    "the input of the down projection"
)
BATCHED = Rows(batched=True)


class BackendAttention(Attention):
    """transformers' attention module: inputs and contribution only."""

    attention_input = EProperty(Arguments(("hidden_states", 0)), BATCHED, layouts.RESIDUAL,
                                "the (normed) stream entering attention")
    attention_queries = unavailable(BACKEND_ATTENTION, layouts.QUERIES)
    attention_keys = unavailable(BACKEND_ATTENTION, layouts.KEYS)
    attention_values = unavailable(BACKEND_ATTENTION, layouts.VALUES)
    attention_head_outputs = unavailable(BACKEND_ATTENTION, layouts.HEAD_OUTPUTS)
    attention_scores = unavailable(BACKEND_ATTENTION, layouts.PATTERN)
    attention_probabilities = unavailable(BACKEND_ATTENTION, layouts.PATTERN)
    attention_output = EProperty(FirstOutput(), BATCHED, layouts.RESIDUAL,
                                 "attention's contribution to the stream")


class BackendMlp(GatedMlp):
    """transformers' MLP module; neurons are the down projection's input."""

    mlp_input = EProperty(Arguments(("x", 0)), BATCHED, layouts.RESIDUAL,
                          "the (normed) stream entering the MLP")
    mlp_neurons = EProperty(Arguments(("input_", 0)), BATCHED, layouts.NEURONS,
                            "the input of the down projection", module=module_from("down_name"))
    mlp_activation = unavailable(UNKNOWN_ACTIVATION, layouts.NEURONS)
    mlp_output = EProperty(FirstOutput(), BATCHED, layouts.RESIDUAL, "the MLP's contribution")


class BackendLayer(Layer):
    """transformers' decoder layer: takes and returns the whole stream, `[1, tokens, hidden]`.

    `layer_mid` is read at the input of the module after the attention add (the post-attention
    norm by default) and is read-only, since transformers keeps that stream in a local variable;
    edit `attention_output` instead.
    """

    Attention = BackendAttention
    Mlp = BackendMlp

    layer_input = EProperty(Arguments(("hidden_states", 0)), BATCHED, layouts.RESIDUAL,
                            "the residual stream entering the block")
    layer_mid = EProperty(
        Arguments(("hidden_states", 0)), Rows(writable=False, batched=True), layouts.RESIDUAL,
        "the residual stream after the attention add (read-only here: edit attention_output)",
        module=module_from("mid_norm_name"))
    layer_output = EProperty(FirstOutput(), BATCHED, layouts.RESIDUAL,
                             "the residual stream leaving the block")


class BackendModel(Model):
    """The model: token embeddings arrive with the backend's batch axis."""

    token_embeddings = EProperty(
        FirstOutput(), BATCHED, layouts.RESIDUAL, "token embeddings, before any embedding scale",
        module=module_from("embed_path"))


class TransformersBackend(Family):
    """The generic family for any model on vLLM's Transformers backend (transformers' names)."""

    backend = "transformers"
    Layer = BackendLayer
    Model = BackendModel
