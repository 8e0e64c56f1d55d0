"""Hosts: the standard nodes (model, layer, attention, MLP) over vLLM's modules, and the values
each one carries. Families subclass these and override only what differs."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from vllm_envoys import layouts
from vllm_envoys.codecs import Heads, Probabilities, Rows, Stream
from vllm_envoys.eproperty import EProperty, Step, Value, unavailable
from vllm_envoys.node import Node, module_from, module_int
from vllm_envoys.pattern import Pattern
from vllm_envoys.routing import UNSUPPORTED_ROUTER, Routing, router_of, unsupported
from vllm_envoys.sites import Arguments, FirstOutput, Output

EARLIER_KEYS = (
    "the pattern is recomputed from the step's queries and the keys of every earlier position, "
    "and only this step's keys were given: it is available on steps that start at position 0 "
    "(vllm-runner keeps each request's keys, and serves it on every step)"
)
ROUTED = (
    "this MLP is a mixture of experts run in one fused kernel: there is no single neuron or "
    "activation tensor; read router_logits, expert_weights and expert_indices"
)
GATED = (
    "this MLP is gated (act(gate) * up): there is no single activation tensor; read "
    "mlp_neurons, the input of the down projection"
)


def _keys_from_position_zero(host: Node, step: Step | None) -> str | None:
    if step is None or step.first_position == 0 or step.earlier_keys:
        return None
    return EARLIER_KEYS


def _head_size(attention: nn.Module) -> int:
    return module_int(attention, "head_size")


def _value_head_size(attention: nn.Module) -> int:
    return module_int(attention, "head_size_v", _head_size(attention))


class Host:
    """A standard node over one vLLM module: its values, children and location.

    `location` is the node's standard name (`""` for the model, `layers.3`,
    `layers.3.self_attn`); `module` the vLLM module it stands for; `parent` the host above
    (a layer, for its attention and MLP), so a value can sit in a sibling module (`../name`).
    """

    def __init__(self, module: nn.Module, location: str, parent: Host | None = None) -> None:
        self.module = module
        self.location = location
        self.parent = parent

    @classmethod
    def eproperties(cls) -> dict[str, EProperty]:
        """Every value this kind of host declares, by name, base classes first."""
        found: dict[str, EProperty] = {}
        for klass in reversed(cls.__mro__):
            for name, attribute in vars(klass).items():
                if isinstance(attribute, EProperty):
                    found[name] = attribute
        return found

    def values(self) -> dict[str, Value]:
        """Every value of this host, bound to it."""
        return {name: Value(self, eprop) for name, eprop in self.eproperties().items()}

    def submodule(self, path: str) -> nn.Module:
        """The module at `path` below this host's module (`""` is the module itself).

        A path starting with `../` starts at the parent host's module instead: sandwich-norm
        families keep attention's contribution in the layer's post-attention norm.
        """
        if path.startswith("../"):
            if self.parent is None:
                raise ValueError(f"{self.location or 'model'} has no parent for {path!r}")
            return self.parent.submodule(path[3:])
        return self.module.get_submodule(path) if path else self.module

    def children(self) -> Iterator[Host]:
        """Standard child hosts (attention and MLP of a layer); none by default."""
        return iter(())

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.location or 'model'})"]
        lines += [f"  {eprop!r}" for eprop in self.eproperties().values()]
        return "\n".join(lines)


class Attention(Host):
    """Self-attention in vLLM's shape: `qkv_proj` → rotary → `attn(q, k, v)` → `o_proj`.

    Queries, keys and values are the `attn` layer's inputs (after projection, q/k norm and
    rotary); head outputs are its output (the input of `o_proj`), split by its own head size.
    """

    attention_input = EProperty(
        Arguments(("hidden_states", 1)), Rows(), layouts.RESIDUAL,
        "the normed stream entering attention")
    attention_queries = EProperty(
        Arguments(("query", 0)), Heads(_head_size, heads_first=True), layouts.QUERIES,
        "queries after projection, q norm and rotary embedding", module="attn")
    attention_keys = EProperty(
        Arguments(("key", 1)), Heads(_head_size, heads_first=True), layouts.KEYS,
        "keys after projection, k norm and rotary embedding (kv heads)", module="attn")
    attention_values = EProperty(
        Arguments(("value", 2)), Heads(_value_head_size, heads_first=True), layouts.VALUES,
        "values after projection (kv heads)", module="attn")
    attention_head_outputs = EProperty(
        Output(), Heads(_value_head_size, heads_first=False), layouts.HEAD_OUTPUTS,
        "each head's output, before the output projection", module="attn")
    attention_scores = EProperty(
        Arguments(("query", 0), ("key", 1)), Pattern(probabilities=False), layouts.PATTERN,
        "pre-softmax scores recomputed from queries and keys", module="attn",
        unavailable=_keys_from_position_zero, when="read-only")
    attention_probabilities = EProperty(
        Arguments(("query", 0), ("key", 1)), Pattern(probabilities=True), layouts.PATTERN,
        "the attention pattern recomputed from queries and keys", module="attn",
        unavailable=_keys_from_position_zero, when="read-only")
    attention_output = EProperty(
        Output(), Rows(), layouts.RESIDUAL, "attention's contribution to the stream")


class GatedMlp(Host):
    """A gated MLP: `gate_up_proj` → `act(gate) * up` → `down_proj`."""

    down_name = "down_proj"

    mlp_input = EProperty(Arguments(("x", 0)), Rows(), layouts.RESIDUAL,
                          "the normed stream entering the MLP")
    mlp_neurons = EProperty(Arguments(("input_", 0)), Rows(), layouts.NEURONS,
                            "the input of the down projection: act(gate) * up",
                            module=module_from("down_name"))
    mlp_activation = unavailable(GATED, layouts.NEURONS, "the activation of a plain MLP")
    mlp_output = EProperty(Output(), Rows(), layouts.RESIDUAL, "the MLP's contribution")


def _routing_support(host: Node, step: Step | None) -> str | None:
    if not isinstance(host, Moe):
        raise TypeError(f"expert routing is a value of MoE hosts, not of {type(host).__name__}")
    return UNSUPPORTED_ROUTER if unsupported(router_of(host.submodule(host.experts_name))) else None


class Moe(Host):
    """A mixture-of-experts MLP in vLLM's shape: `gate` (router logits) → fused `experts`.

    The gate returns `(logits, bias)` in most families and the logits alone in some (GPT-OSS);
    the router values are its first tensor either way.

    `mlp_output` is the whole block's output (routed experts, plus any shared expert). The
    expert choice is recomputed from the router logits (see `vllm_envoys.routing`).
    """

    gate_name = "gate"
    experts_name = "experts"

    mlp_input = EProperty(Arguments(("hidden_states", 0)), Rows(), layouts.RESIDUAL,
                          "the normed stream entering the MLP")
    mlp_neurons = unavailable(ROUTED, layouts.NEURONS)
    mlp_activation = unavailable(ROUTED, layouts.NEURONS)
    mlp_output = EProperty(Output(), Rows(), layouts.RESIDUAL, "the MLP's contribution")
    router_logits = EProperty(FirstOutput(), Rows(), layouts.ROUTER_LOGITS,
                              "the router's logits over experts (editable: changes the routing)",
                              module=module_from("gate_name"))
    expert_weights = EProperty(
        FirstOutput(), Routing("experts", weights=True), layouts.EXPERT_WEIGHTS,
        "each token's chosen experts' weights, recomputed from router_logits (read-only)",
        module=module_from("gate_name"), unavailable=_routing_support, when="top-k router")
    expert_indices = EProperty(
        FirstOutput(), Routing("experts", weights=False), layouts.EXPERT_INDICES,
        "each token's chosen experts, recomputed from router_logits (read-only)",
        module=module_from("gate_name"), unavailable=_routing_support, when="top-k router")


class PlainMlp(GatedMlp):
    """A plain MLP: `up` → `act` → `down`; its activation is the down projection's input.

    The activation is read at the down projection, not at the activation module: vLLM may share
    one activation module between all layers (`get_act_fn`), so a hook there fires for every
    layer.
    """

    mlp_activation = EProperty(Arguments(("input_", 0)), Rows(), layouts.NEURONS,
                               "the activation's output (the down projection's input)",
                               module=module_from("down_name"))


class Layer(Host):
    """A decoder block with an attention and an MLP child; subclasses declare the stream values."""

    Attention: type[Attention] = Attention
    Mlp: type[Host] = GatedMlp
    Moe: type[Moe] = Moe  # used for MLP modules that have experts (MoE layers may alternate)
    attention_name = "self_attn"
    mlp_name = "mlp"
    mid_norm_name = "post_attention_layernorm"

    def __init__(self, module: nn.Module, location: str, parent: Host | None = None) -> None:
        super().__init__(module, location, parent)
        self.self_attn = self.Attention(module.get_submodule(self.attention_name),
                                        f"{location}.self_attn", parent=self)
        mlp = module.get_submodule(self.mlp_name)
        kind = self.Moe if hasattr(mlp, self.Moe.experts_name) else self.Mlp
        self.mlp = kind(mlp, f"{location}.mlp", parent=self)

    def children(self) -> Iterator[Host]:
        yield self.self_attn
        yield self.mlp


class FusedLayer(Layer):
    """A decoder block that passes the stream on as `(hidden, residual)` halves (most of vLLM).

    `forward(positions, hidden_states, residual) -> (hidden_states, residual)`; the stream is
    their sum. `layer_mid` is the input of the post-attention fused add-norm, which carries the
    residual path too, so editing it edits the stream.
    """

    layer_input = EProperty(
        Arguments(("hidden_states", 1), ("residual", 2)), Stream(), layouts.RESIDUAL,
        "the residual stream entering the block")
    layer_mid = EProperty(
        Arguments(("x", 0), ("residual", 1)), Stream(), layouts.RESIDUAL,
        "the residual stream after the attention add", module=module_from("mid_norm_name"))
    layer_output = EProperty(
        Output(0, 1), Stream(), layouts.RESIDUAL, "the residual stream leaving the block")


class StreamLayer(Layer):
    """A block that takes and returns the whole stream (GPT-2): `forward(hidden_states)`.

    `layer_mid` is read at the second norm's input; it is read-only because such blocks keep the
    stream after the attention add in a local variable, so an edit at the norm would reach the
    MLP but not the residual path. Edit `attention_output` instead.
    """

    layer_input = EProperty(Arguments(("hidden_states", 0)), Rows(), layouts.RESIDUAL,
                            "the residual stream entering the block")
    layer_mid = EProperty(
        Arguments(("input", 0)), Rows(writable=False), layouts.RESIDUAL,
        "the residual stream after the attention add (read-only here: edit attention_output)",
        module=module_from("mid_norm_name"))
    layer_output = EProperty(Output(), Rows(), layouts.RESIDUAL,
                             "the residual stream leaving the block")


class Model(Host):
    """The whole model: token embeddings (before any family's embedding scale)."""

    token_embeddings = EProperty(
        Output(), Rows(), layouts.RESIDUAL, "token embeddings, before any embedding scale",
        module=module_from("embed_path"))

    # One row per sampled position (a request's last row each step, not every token): the
    # runner narrows these with a layout of sampled rows, not the step's token layout.
    logits = EProperty(Output(), Rows(), layouts.LOGITS,
                       "the logits of the sampled rows (soft-capped and scaled as sampled)",
                       module="logits_processor")
    next_token_probs = EProperty(Output(), Probabilities(), layouts.LOGITS,
                                 "softmax of the logits (read-only; edit logits)",
                                 module="logits_processor")

    def __init__(self, module: nn.Module, embed_path: str, layers: list[Layer]) -> None:
        super().__init__(module, "")
        self.embed_path = embed_path
        self.layers = layers

    def children(self) -> Iterator[Host]:
        yield from self.layers
