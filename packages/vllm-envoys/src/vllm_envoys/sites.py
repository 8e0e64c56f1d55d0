"""Sites: where a value's tensors sit in what a hook sees, and how to put new ones there.

A forward pre-hook sees a module call's arguments (`HookArgs`); a forward hook sees its output. A
site picks the value's tensors out of that raw structure and puts replacements back, returning a
new raw structure (never mutating the engine's tuples). Raw structures are plain tuples, dicts
and tensors, so `tokenspan` can narrow them to one request's rows before a site looks at them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from typing import Any, NamedTuple

from torch import nn


class HookArgs(NamedTuple):
    """A module call's positional and keyword arguments, as a forward pre-hook sees them."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@cache
def _parameter_index(forward: Callable[..., Any], name: str) -> int | None:
    """The positional index of `name` in a module class's `forward` (self excluded), if any."""
    try:
        parameters = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return None
    if parameters and parameters[0] == "self":
        parameters = parameters[1:]
    return parameters.index(name) if name in parameters else None


class Site:
    """Base class: `side` is `"input"` or `"output"`; `get` picks, `put` replaces."""

    side: str

    def get(self, raw: Any, module: nn.Module) -> Any:
        raise NotImplementedError

    def put(self, raw: Any, module: nn.Module, piece: Any) -> Any:
        raise NotImplementedError


class Arguments(Site):
    """One or more arguments of a module call, each found by keyword or by position.

    `Arguments(("hidden_states", 1))` finds `hidden_states` whether the caller passed it by
    keyword or as the second positional argument (vLLM passes both ways, model by model). With
    several names, `get` returns a tuple; an argument that was not passed reads as `None`.
    """

    side = "input"

    def __init__(self, *arguments: tuple[str, int]) -> None:
        self.arguments = arguments

    def _locate(self, call: HookArgs, module: nn.Module, name: str, index: int) -> tuple[str, Any]:
        if name in call.kwargs:
            return "kwargs", name
        found = _parameter_index(type(module).forward, name)
        position = index if found is None else found
        if position < len(call.args):
            return "args", position
        return "missing", name

    def _get_one(self, call: HookArgs, module: nn.Module, name: str, index: int) -> Any:
        where, key = self._locate(call, module, name, index)
        if where == "kwargs":
            return call.kwargs[key]
        return call.args[key] if where == "args" else None

    def get(self, raw: HookArgs, module: nn.Module) -> Any:
        pieces = tuple(self._get_one(raw, module, name, index) for name, index in self.arguments)
        return pieces[0] if len(pieces) == 1 else pieces

    def put(self, raw: HookArgs, module: nn.Module, piece: Any) -> HookArgs:
        pieces = (piece,) if len(self.arguments) == 1 else piece
        args, kwargs = list(raw.args), dict(raw.kwargs)
        for (name, index), new in zip(self.arguments, pieces, strict=True):
            where, key = self._locate(raw, module, name, index)
            if where == "kwargs":
                kwargs[key] = new
            elif where == "args":
                args[key] = new
            elif new is not None:
                kwargs[name] = new
        return HookArgs(tuple(args), kwargs)


class Output(Site):
    """A module's output: all of it, or the items at `indices` of a tuple output."""

    side = "output"

    def __init__(self, *indices: int) -> None:
        self.indices = indices

    def get(self, raw: Any, module: nn.Module) -> Any:
        if not self.indices:
            return raw
        pieces = tuple(raw[i] for i in self.indices)
        return pieces[0] if len(pieces) == 1 else pieces

    def put(self, raw: Any, module: nn.Module, piece: Any) -> Any:
        if not self.indices:
            return piece
        pieces = (piece,) if len(self.indices) == 1 else piece
        items = list(raw)
        for index, new in zip(self.indices, pieces, strict=True):
            items[index] = new
        return type(raw)(items) if not hasattr(raw, "_fields") else type(raw)(*items)


class FirstOutput(Site):
    """The first tensor of a module's output, whether it returns a tensor or a tuple.

    transformers' layers and attention modules return a tuple in some versions and a tensor in
    others; the value is the first tensor either way, and a write keeps the rest.
    """

    side = "output"

    def get(self, raw: Any, module: nn.Module) -> Any:
        return raw[0] if isinstance(raw, tuple) else raw

    def put(self, raw: Any, module: nn.Module, piece: Any) -> Any:
        return (piece, *raw[1:]) if isinstance(raw, tuple) else piece
