"""`standardize(model, hf_config)`: the standard tree of hosts over a vLLM model."""

from __future__ import annotations

from typing import Any

from torch import nn

from vllm_envoys.backend_attention import route_attention_through_hooks
from vllm_envoys.eproperty import Step, Value
from vllm_envoys.errors import UnknownValue
from vllm_envoys.families import lookup
from vllm_envoys.family import Family
from vllm_envoys.hosts import Host


class Standardized:
    """A vLLM model seen through nnterp's names: `model.layers[3].self_attn`, values, support.

    Built by `standardize`; it holds no state of a run, only which module carries which value.
    """

    def __init__(self, model: nn.Module, family: type[Family]) -> None:
        self.family = family
        self.module = model
        layer_modules = model.get_submodule(family.layers)
        if not isinstance(layer_modules, nn.ModuleList | nn.Sequential):
            raise TypeError(f"{family.__name__}: {family.layers} is a "
                            f"{type(layer_modules).__name__}, not a list of decoder blocks")
        self.layers = [family.Layer(block, f"layers.{i}") for i, block in enumerate(layer_modules)]
        self.model = family.Model(model, family.embed_tokens, self.layers)

    def hosts(self) -> list[Host]:
        """Every host: the model, then each layer followed by its children."""
        found: list[Host] = [self.model]
        pending = list(self.model.children())
        while pending:
            host = pending.pop(0)
            found.append(host)
            pending[:0] = list(host.children())
        return found

    def values(self) -> dict[str, Value]:
        """Every value of the model by canonical location (`layers.3.mlp.mlp_neurons`)."""
        return {value.location: value for host in self.hosts()
                for value in host.values().values()}

    def value(self, location: str) -> Value:
        """The value at a canonical location; `UnknownValue` names the closest valid ones."""
        values = self.values()
        try:
            return values[location]
        except KeyError:
            import difflib

            close = difflib.get_close_matches(location, list(values), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UnknownValue(f"{location!r} is not a value of this model{hint}") from None

    def support(self, step: Step | None = None) -> dict[str, str | None]:
        """Every value → `None` if available, else the reason. Runs nothing."""
        return {location: value.reason(step) for location, value in self.values().items()}

    def __repr__(self) -> str:
        return (f"Standardized({self.family.__name__}, {len(self.layers)} layers, "
                f"{len(self.values())} values)")


# Where vLLM 0.32 keeps its Transformers backend; models from there run transformers' modules.
TRANSFORMERS_BACKEND_MODULE = "vllm.model_executor.models.transformers"


def backend_of(model: nn.Module) -> str:
    """`"transformers"` for a model on vLLM's Transformers backend, else `"vllm"`."""
    return "transformers" if type(model).__module__.startswith(TRANSFORMERS_BACKEND_MODULE) else (
        "vllm")


def standardize(model: nn.Module, hf_config: Any) -> Standardized:
    """The standard tree over `model` (a vLLM model), chosen by `hf_config.model_type` and by
    whether vLLM runs its own model code or its Transformers backend.

    For a model on the Transformers backend this routes the backend's attention through its
    vLLM layers' hooks, once per process (`route_attention_through_hooks`), so its attention
    values can be served."""
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else (
        hf_config)
    backend = backend_of(model)
    if backend == "transformers":
        route_attention_through_hooks()
    return Standardized(model, lookup(text_config.model_type, backend))
