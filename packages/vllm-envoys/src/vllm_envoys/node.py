"""`Node`: what values and codecs need of the host they belong to.

Values (`EProperty`, `Value`) and codecs are declared on hosts, but they only use a host's
location and its submodules. Naming those two here, rather than the `Host` class, keeps
`eproperty` and `codecs` below `hosts` in the import order: `hosts` imports them, never the
other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import nn


class Node(Protocol):
    """A standard node over a vLLM module (every `vllm_envoys.Host` is one)."""

    @property
    def location(self) -> str:
        """The node's standard name (`""` for the model, `layers.3.self_attn`, ...)."""
        ...

    def submodule(self, path: str) -> nn.Module:
        """The module at `path` below the node's module (`../name` starts at its parent's)."""
        ...


def module_int(module: nn.Module, name: str, default: int | None = None) -> int:
    """An integer setting a module keeps as a plain attribute (`head_size`, `num_kv_heads`).

    `nn.Module`'s attribute lookup is typed for parameters and submodules only; plain settings
    read through it are checked here. `default` is returned when the module has no such
    attribute; a value that is not an integer raises `TypeError`.
    """
    value = getattr(module, name, default)
    if not isinstance(value, int):
        raise TypeError(f"{type(module).__name__}.{name} is {value!r}, not an integer")
    return value


def module_from(attribute: str) -> Callable[[Node], str]:
    """A value's module path read from its host's `attribute` (e.g. `"down_name"`), so a
    family's host subclass renames the module by setting that attribute."""

    def path(host: Node) -> str:
        value = getattr(host, attribute)
        if not isinstance(value, str):
            raise TypeError(f"{type(host).__name__}.{attribute} is {value!r}, not a module path")
        return value

    path.__qualname__ = f"module_from({attribute!r})"
    return path
