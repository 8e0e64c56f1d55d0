"""Hookable attention on vLLM's Transformers backend (checked against vLLM 0.32).

The backend registers an attention function with transformers (`"vllm"` in
`ALL_ATTENTION_FUNCTIONS`) that reshapes transformers' queries, keys and values to vLLM's flat
`[tokens, heads * head_size]` and calls `module.attn.forward(q, k, v)`, where `attn` is the vLLM
`Attention` layer mounted on each transformers attention module. Calling `forward` directly
skips the layer's hooks, so a runner could not see queries, keys, values or head outputs there.

`route_attention_through_hooks` wraps the registered function, once per process, so the call
goes through the layer's `__call__` instead. Nothing else changes: the wrapper hands vLLM's own
function a stand-in for the transformers module whose `attn` is called through its hooks, so
vLLM's reshaping, value padding and sink checks stay vLLM's. A layer without hooks costs one
Python call more per layer and step.

Latent attention (`"vllm_mla"`, DeepSeek's MLA on the backend) is left alone: its layer sees
compressed keys and values, not the standard ones (see `vllm_envoys.transformers_backend`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

# The name vLLM's backend registers its attention function under, and the attribute that holds
# the vLLM layer on each transformers attention module (`VLLM_ATTN_IMPL`, `VLLM_ATTN_ATTR`).
VLLM_ATTENTION_FUNCTION = "vllm"
VLLM_ATTENTION_LAYER = "attn"


# The stand-ins keep their one attribute in the instance dict, not in `__slots__`: Dynamo
# (vLLM compiling the model) resolves a slot through `__getattr__`, which then recursed
# without end (seen on vLLM 0.32's CPU build with `enforce_eager=False`).


class _CalledThroughHooks:
    """A vLLM attention layer whose `forward` is its `__call__` (hooks included)."""

    def __init__(self, layer: nn.Module) -> None:
        self._layer = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._layer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


class _AttentionModule:
    """A transformers attention module as vLLM's function sees it, `attn` called through hooks."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._module, name)
        return _CalledThroughHooks(found) if name == VLLM_ATTENTION_LAYER else found


def _through_hooks(original: Callable[..., Any]) -> Callable[..., Any]:
    def attention(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return original(_AttentionModule(module), *args, **kwargs)

    attention.__wrapped__ = original  # type: ignore[attr-defined]
    attention.__doc__ = f"{original.__qualname__}, with the vLLM layer called through its hooks."
    return attention


def route_attention_through_hooks() -> None:
    """Make vLLM's Transformers-backend attention call its vLLM layer through `__call__`.

    Idempotent; a no-op where the backend's function is not registered (transformers without
    vLLM). It exists so that the standard attention values can be hooked on the backend as on
    vLLM's own model code; `standardize` calls it for every model on the backend.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS.get(VLLM_ATTENTION_FUNCTION)
    if original is None or hasattr(original, "__wrapped__"):
        return
    ALL_ATTENTION_FUNCTIONS.register(VLLM_ATTENTION_FUNCTION, _through_hooks(original))


def is_latent(layer: nn.Module) -> bool:
    """Whether a vLLM attention layer is multi-head latent attention (keys and values cached in
    compressed form), judged by class name so that no vLLM import is needed."""
    return any(klass.__name__ == "MLAAttention" for klass in type(layer).__mro__)
