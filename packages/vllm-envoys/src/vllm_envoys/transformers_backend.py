"""Hosts for models vLLM serves through its Transformers backend (`model_impl="transformers"`,
or architectures vLLM has no code for), checked against vLLM 0.32.

There vLLM runs transformers' own modules with a batch axis of 1 (`[1, tokens, ...]`) and the
residual stream is whole (no `(hidden, residual)` halves), but swaps in its attention: each
transformers attention module gets a vLLM `Attention` layer as its `attn` child, and the
attention function the backend registers with transformers calls that layer's `forward`
directly. `route_attention_through_hooks` makes that call go through the layer's `__call__`, so
the layer's hooks fire and queries, keys, values, head outputs and the pattern are served as on
vLLM's own model code (the layer sees the same flat `[tokens, heads * head_size]` tensors).
"""

from __future__ import annotations

from vllm_envoys import layouts
from vllm_envoys.backend_attention import VLLM_ATTENTION_LAYER, is_latent
from vllm_envoys.codecs import Rows
from vllm_envoys.eproperty import EProperty, Step, unavailable
from vllm_envoys.family import Family
from vllm_envoys.hosts import Attention, GatedMlp, Layer, Model, Moe
from vllm_envoys.node import Node, module_from
from vllm_envoys.sites import Arguments, FirstOutput

LATENT_ON_BACKEND = (
    "this layer runs multi-head latent attention (MLA) on vLLM's Transformers backend: its vLLM "
    "layer sees compressed keys and values and queries in latent form, not the standard ones"
)
UNKNOWN_ACTIVATION = (
    "on vLLM's Transformers backend the MLP's activation is not identified; read mlp_neurons, "
    "the input of the down projection"
)
BATCHED = Rows(batched=True)


def _latent(host: Node, step: Step | None) -> str | None:
    return LATENT_ON_BACKEND if is_latent(host.submodule(VLLM_ATTENTION_LAYER)) else None


def _standard(eprop: EProperty) -> EProperty:
    return eprop.unless(_latent, when="not MLA")


class BackendAttention(Attention):
    """transformers' attention module with vLLM's `attn` layer inside, called through its hooks
    (`route_attention_through_hooks`): inputs and contribution at transformers' module, the
    interior at vLLM's layer, as on vLLM's own model code."""

    attention_input = EProperty(Arguments(("hidden_states", 0)), BATCHED, layouts.RESIDUAL,
                                "the (normed) stream entering attention")
    attention_queries = _standard(Attention.attention_queries)
    attention_keys = _standard(Attention.attention_keys)
    attention_values = _standard(Attention.attention_values)
    attention_head_outputs = _standard(Attention.attention_head_outputs)
    attention_scores = _standard(Attention.attention_scores)
    attention_probabilities = _standard(Attention.attention_probabilities)
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


class BackendMoe(Moe):
    """transformers' mixture-of-experts block whose gate and experts vLLM fused (vLLM 0.34 runs
    OLMoE this way): the block keeps the backend's batch axis, while the gate, called by vLLM's
    MoE runner on the flattened stream, gives `[tokens, experts]` router logits as on vLLM's own
    model code."""

    mlp_input = EProperty(Arguments(("hidden_states", 0)), BATCHED, layouts.RESIDUAL,
                          "the normed stream entering the MLP")
    mlp_output = EProperty(FirstOutput(), BATCHED, layouts.RESIDUAL, "the MLP's contribution")


class BackendLayer(Layer):
    """transformers' decoder layer: takes and returns the whole stream, `[1, tokens, hidden]`.

    `layer_mid` is read at the input of the module after the attention add (the post-attention
    norm by default) and is read-only, since transformers keeps that stream in a local variable;
    edit `attention_output` instead.
    """

    Attention = BackendAttention
    Mlp = BackendMlp
    Moe = BackendMoe

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
