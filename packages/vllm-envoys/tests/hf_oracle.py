"""The oracle: HF transformers (eager attention) on the same weights, read with forward hooks.

For each standard value of a Llama-shaped model (Llama, Qwen2, Qwen3), where transformers keeps
it — the definition the vLLM side must match. Queries, keys, values, head outputs and the
pattern are taken inside transformers' own eager attention function, which this module wraps in
place (the model runs with attn_implementation="eager", so transformers still builds the eager
causal mask).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

Edit = Callable[[torch.Tensor], torch.Tensor]

# Set while a run is in progress: what the capture attention records and edits.
_RUN: dict[str, Any] = {}


def _capture_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    layer = f"layers.{module.layer_idx}.self_attn"  # standard names, whatever the family
    edits = _RUN.get("edits", {})
    for name, tensor in (("attention_queries", query), ("attention_keys", key),
                         ("attention_values", value)):
        location = f"{layer}.{name}"
        if location in edits:
            tensor = edits[location](tensor)
        _RUN["values"][location] = tensor.detach().clone()
        if name == "attention_queries":
            query = tensor
        elif name == "attention_keys":
            key = tensor
        else:
            value = tensor
    eager = _EAGER[type(module).__module__]
    output, weights = eager(module, query, key, value, attention_mask, scaling=scaling,
                            dropout=dropout, **kw)
    location = f"{layer}.attention_head_outputs"
    if location in edits:
        output = edits[location](output)
    _RUN["values"][location] = output.detach().clone()
    _RUN["values"][f"{layer}.attention_probabilities"] = weights.detach().clone()
    return output, weights


# The original eager attention of each modeling module this oracle has wrapped.
_EAGER: dict[str, Callable] = {}


def _wrap_eager_attention(model: torch.nn.Module) -> None:
    """Route the model's eager attention through `_capture_attention` (once per module)."""
    attention_module = type(model).__module__
    modeling = sys.modules[attention_module]
    if attention_module not in _EAGER:
        _EAGER[attention_module] = modeling.eager_attention_forward
        modeling.eager_attention_forward = _capture_attention


def _first(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, tuple) else value


def _edit_router_logits(router: torch.nn.Module, edit: Edit) -> list:
    """Edit a transformers router's logits where it computes them, so its own routing follows.

    transformers' routers compute `F.linear(hidden, weight)` and choose experts in the same
    forward; the logits cannot be edited from outside it. For the duration of the router's
    forward only, `F.linear` is wrapped to apply the edit to the router's logits.
    """
    functional = torch.nn.functional
    original = functional.linear

    def edited_linear(input, weight, bias=None):
        logits = original(input, weight, bias)
        return edit(logits.unsqueeze(0))[0] if weight is router.weight else logits

    def patch(module, args):
        functional.linear = edited_linear

    def restore(module, args, output):
        functional.linear = original

    return [router.register_forward_pre_hook(patch), router.register_forward_hook(restore)]


class HFOracle:
    """Runs a transformers Llama-shaped model and returns every standard value of a sequence."""

    def __init__(self, model: torch.nn.Module, names: Any) -> None:
        self.model = model.eval()
        self.names = names
        self.model.set_attn_implementation("eager")
        _wrap_eager_attention(self.model)

    def _hook_points(self) -> list[tuple[str, torch.nn.Module, str]]:
        """`(location, module, kind)` for every value read by a module hook."""
        names = self.names
        points = [("token_embeddings", self.model.get_submodule(names.embed), "output")]
        for i, layer in enumerate(self.model.get_submodule(names.layers)):
            prefix = f"layers.{i}"
            attention = layer.get_submodule(names.attention)
            mlp = layer.get_submodule(names.mlp)
            points += [
                (f"{prefix}.layer_input", layer, "input:hidden_states"),
                (f"{prefix}.layer_output", layer, "output"),
                (f"{prefix}.self_attn.attention_input", attention, "input:hidden_states"),
                (f"{prefix}.self_attn.attention_output",
                 layer.get_submodule(names.attention_out or names.attention), "output"),
                (f"{prefix}.mlp.mlp_input", mlp, "input:0"),
                (f"{prefix}.mlp.mlp_output", layer.get_submodule(names.mlp_out or names.mlp),
                 "output"),
            ]
            if names.mid_norm is not None:  # parallel blocks have no stream between sublayers
                points.append((f"{prefix}.layer_mid", layer.get_submodule(names.mid_norm),
                               "input:0"))
            if hasattr(mlp, names.down):
                points.append((f"{prefix}.mlp.mlp_neurons", mlp.get_submodule(names.down),
                               "input:0"))
            if hasattr(mlp, "experts"):  # transformers' routers return (logits, weights, indices)
                router = mlp.get_submodule(names.router)
                points += [(f"{prefix}.mlp.{name}", router, f"output:{i}") for i, name in
                           enumerate(("router_logits", "expert_weights", "expert_indices"))]
            if names.act is not None:
                points.append((f"{prefix}.mlp.mlp_activation", mlp.get_submodule(names.act),
                               "output"))
        return points

    def _read_scale(self, location: str, module: torch.nn.Module) -> Any:
        """The factor between a module's output and the standard value read there, or `None`.

        The standard token_embeddings come before any embedding scale; transformers applies
        Gemma's inside its embedding module, so it is undone. A contribution is what reaches the
        stream: Granite scales sublayer outputs by `residual_multiplier` in the block.
        """
        if location == "token_embeddings":
            scale = getattr(module, "embed_scale", None)
            return None if scale is None else 1 / scale
        if self.names.factor and location.endswith(("attention_output", "mlp_output")):
            layer = int(location.split(".")[1])
            block = self.model.get_submodule(self.names.layers)[layer]
            return float(getattr(block, self.names.factor))
        return None

    @staticmethod
    def _through_attention_output(edits: dict[str, Edit]) -> dict[str, Edit]:
        """Edits of `layer_mid` done where transformers can: on the attention's output.

        transformers keeps the stream after the attention add in a local variable and feeds the
        post-attention norm a copy, so editing the norm's input would leave the residual path
        unedited. Since `layer_mid = layer_input + attention_output`, an edit f of layer_mid is
        the edit `a -> f(layer_input + a) - layer_input` of the attention output.
        """
        rewritten = dict(edits)
        for location in [loc for loc in edits if loc.endswith(".layer_mid")]:
            prefix = location.removesuffix(".layer_mid")
            edit = rewritten.pop(location)

            def through(attention, prefix=prefix, edit=edit):
                stream_in = _RUN["values"][f"{prefix}.layer_input"]
                return edit(stream_in + attention) - stream_in
            rewritten[f"{prefix}.self_attn.attention_output"] = through
        return rewritten

    @contextmanager
    def _hooks(self, edits: dict[str, Edit]):
        edits = self._through_attention_output(edits)
        handles = []
        for location, module, kind in self._hook_points():
            if kind.startswith("output:"):  # one item of a tuple, rows without a batch axis
                index = int(kind.split(":")[1])

                def item_hook(module, args, output, location=location, index=index):
                    _RUN["values"][location] = output[index].detach().clone().unsqueeze(0)
                handles.append(module.register_forward_hook(item_hook))
                if location in edits and location.endswith(".router_logits"):
                    handles += _edit_router_logits(module, edits[location])
            elif kind == "output":
                scale = self._read_scale(location, module)

                def hook(module, args, output, location=location, scale=scale):
                    tensor = _first(output)
                    if scale is not None:
                        tensor = tensor * scale
                    if location in edits:
                        tensor = edits[location](tensor)
                        edited = tensor if scale is None else tensor / scale
                        output = (edited, *output[1:]) if isinstance(output, tuple) else edited
                    _RUN["values"][location] = tensor.detach().clone()
                    return output
                handles.append(module.register_forward_hook(hook))
            else:
                name = kind.split(":", 1)[1]

                def pre_hook(module, args, kwargs, location=location, name=name):
                    if name.isdigit():
                        tensor = args[int(name)]
                    else:
                        tensor = kwargs[name] if name in kwargs else args[0]
                    if location in edits:
                        tensor = edits[location](tensor)
                        if name.isdigit():
                            args = (*args[: int(name)], tensor, *args[int(name) + 1:])
                        elif name in kwargs:
                            kwargs = {**kwargs, name: tensor}
                        else:
                            args = (tensor, *args[1:])
                    _RUN["values"][location] = tensor.detach().clone()
                    return args, kwargs
                handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def run(self, token_ids: list[int], edits: dict[str, Edit] | None = None
            ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Every standard value for `token_ids` in one forward, and the logits `[tokens, vocab]`."""
        edits = edits or {}
        _RUN.clear()
        _RUN.update(values={}, edits=edits)
        try:
            with self._hooks(edits):
                logits = self.model(torch.tensor([token_ids], device=self.model.device)).logits[0]
            values = dict(_RUN["values"])
            values["logits"] = logits.unsqueeze(0)
            return values, logits
        finally:
            _RUN.clear()


def add_noise(value: torch.Tensor) -> torch.Tensor:
    """The edit both engines apply: seeded noise of the value's own shape.

    Random per element, not one vector for all rows: adding the same vector to every key shifts
    each query's scores by a constant, which the softmax cancels exactly.
    """
    generator = torch.Generator().manual_seed(1234)
    return value + torch.randn(value.shape, generator=generator).to(value.device, value.dtype)


@dataclass
class OracleRecord:
    """What transformers says, computed before any engine starts in the process.

    vLLM's Transformers backend patches transformers' model classes in place when it loads a
    model, so transformers is run first and its answers are kept.
    """

    generated: list[int]
    values: dict[str, torch.Tensor]
    edited_logits: dict[str, torch.Tensor]


def record(oracle: HFOracle, prompt: list[int], generated: int, layer: int) -> OracleRecord:
    """Greedy generation, every value over prompt + generated[:-1], and the last-position logits
    of the prompt under `add_noise` at each value of `layer` (and the token embeddings)."""
    sequence = list(prompt)
    for _ in range(generated):
        _, logits = oracle.run(sequence)
        sequence.append(int(logits[-1].argmax()))
    new_tokens = sequence[len(prompt):]
    values, _ = oracle.run(prompt + new_tokens[:-1])
    # Derived values are not edited (the runner refuses writes to them too).
    derived = ("attention_probabilities", "expert_weights", "expert_indices", "logits")
    editable = ["token_embeddings"] + [
        location for location in values if location.startswith(f"layers.{layer}.")
        and location.rsplit(".", 1)[-1] not in derived
    ]
    edited = {location: oracle.run(prompt, edits={location: add_noise})[1][-1]
              for location in editable}
    return OracleRecord(new_tokens, values, edited)
