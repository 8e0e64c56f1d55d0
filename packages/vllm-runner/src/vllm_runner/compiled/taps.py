"""Taps: locations declared when the engine starts, served from inside vLLM's compiled model.

A forward hook does not run in a compiled forward: Dynamo traced the model once, and the graph
it made has no Python left in it. A tap is a hook whose body is one custom op,
`vllm_interp::tap(tensors, key)`, installed before vLLM compiles the model, so Dynamo traces the
op into the graph like any other operator. The op's implementation is Python that runs at every
forward, compiled or not: it hands the value's tensors to the engine's runtime, which serves the
step's requests on the step's layout as a hook would (the layout is read then, never at trace
time: vLLM's compiled wrapper keeps no guards, so a value read while tracing is frozen).

The op declares that it mutates its tensors, as vLLM's own attention op does with its output
buffer: an edit is written into the engine's rows in place, and the compiler orders every later
use of those tensors after it. On a GPU the op is also listed in vLLM's `splitting_ops`, so the
piecewise CUDA graphs are split around it and it runs between their replays, and it ends a
graph segment where a full graph is captured broken at the taps (`compiled.breaks`).

The op's key is `locations|structure` (every tapped location at one module side, `;`-joined:
one op per module side, see `install_taps`): `structure` describes the hook's raw value (a tensor, a
tuple of tensors, a module call's arguments), so the op's flat list of tensors can be put back
into the shape the value's site reads. The runtime that serves it is the one whose forward runs
now (`serve_taps`), so one process may hold several engines.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from vllm_envoys import HookArgs, Value

from vllm_runner.compiled.breaks import break_at_tap

#: The op's qualified name, as vLLM's `splitting_ops` lists operators.
TAP_OP = "vllm_interp::tap"

_library = torch.library.Library("vllm_interp", "FRAGMENT")
_library.define("tap(Tensor(a!)[] tensors, str key) -> ()")


class Steer(Protocol):
    """In-graph work a tap's hook runs before its op (`in_graph.InGraphRows`: ablation,
    steering and the copy for saves)."""

    def apply(self, module: nn.Module, raw: Any) -> None: ...


class TapServer(Protocol):
    """What serves a tap's visit: the engine's runtime (`Runtime.wants_tap`, `serve_tap`)."""

    def wants_tap(self, location: str) -> bool: ...

    def serve_tap(self, location: str, raw: Any) -> None: ...


_serving: list[TapServer] = []  # the runtime whose forward runs now, if any


def serve_taps(server: TapServer | None) -> None:
    """Make `server` the one that serves every tap until the next call (`None`: nobody).

    The runtime calls it when a step's forward begins and ends. A process runs one forward at
    a time, so the runtime of the forward running now is the one to serve, whichever engine of
    the process it belongs to; the op's key names no engine, so a graph compiled (or taken
    from vLLM's compile cache) in another process or for another engine finds the right one.
    Outside a forward (vLLM's warm-up and profiling runs) taps serve nobody."""
    _serving[:] = [] if server is None else [server]


def _run_tap(tensors: list[torch.Tensor], key: str) -> None:
    if not break_at_tap(_serve_tap, tensors, key):  # a full graph broken here runs it later
        _serve_tap(tensors, key)


def _serve_tap(tensors: list[torch.Tensor], key: str) -> None:
    locations, structure = parse_key(key)
    if not _serving:
        return
    server = _serving[0]
    raw = None  # most visits find nobody waiting (every step without programs): not rebuilt
    for location in locations:
        if server.wants_tap(location):
            if raw is None:
                raw = rebuild(structure, tensors)
            server.serve_tap(location, raw)


_library.impl("tap", _run_tap, "CompositeExplicitAutograd")


@torch.library.register_fake(TAP_OP, lib=_library)
def _tap_while_tracing(tensors: list[torch.Tensor], key: str) -> None:
    """Nothing while the compiler traces: the op only mutates its inputs."""


@cache
def parse_key(key: str) -> tuple[tuple[str, ...], str]:
    """The locations a tap op's `key` serves and the structure of its raw value."""
    locations, structure = key.split("|", 1)
    return tuple(locations.split(";")), structure


# ------------------------------------------------------------------ raw values as flat tensors
# Dynamo traces `flatten` (plain Python over the hook's arguments): the structure string is a
# constant of the graph, and the tensors are the op's arguments.


def flatten(raw: Any) -> tuple[list[torch.Tensor], str]:
    """A hook's raw value as its tensors and a description of where they sit.

    Tensors are `T`, `None` is `N`, anything else (an int, a config object) is `O` and comes
    back as `None` (no standard value is read from one); tuples `(...)`, lists `[...]`, a module
    call's arguments `A(args){name=...,}`."""
    tensors: list[torch.Tensor] = []
    return tensors, _describe(raw, tensors)


def _describe(raw: Any, tensors: list[torch.Tensor]) -> str:
    if isinstance(raw, torch.Tensor):
        tensors.append(raw)
        return "T"
    if raw is None:
        return "N"
    if isinstance(raw, HookArgs):  # arguments first: `rebuild` takes the tensors in order
        arguments = _describe(tuple(raw.args), tensors)
        keywords = "".join(f"{name}={_describe(item, tensors)}," for name, item in
                           raw.kwargs.items())
        return f"A{arguments}{{{keywords}}}"
    if isinstance(raw, tuple):
        return "(" + "".join(_describe(item, tensors) + "," for item in raw) + ")"
    if isinstance(raw, list):
        return "[" + "".join(_describe(item, tensors) + "," for item in raw) + "]"
    return "O"


def rebuild(structure: str, tensors: list[torch.Tensor]) -> Any:
    """The raw value `flatten` described, with `tensors` in their places."""
    found, end = _rebuild(structure, 0, iter(tensors))
    if end != len(structure):
        raise ValueError(f"tap structure {structure!r} has text left at {end}")
    return found


def _rebuild(structure: str, at: int, tensors: Any) -> tuple[Any, int]:
    mark = structure[at]
    if mark == "T":
        return next(tensors), at + 1
    if mark in "NO":
        return None, at + 1
    if mark == "A":
        args, at = _rebuild(structure, at + 1, tensors)
        kwargs: dict[str, Any] = {}
        at += 1  # "{"
        while structure[at] != "}":
            name, _, _ = structure[at:].partition("=")
            kwargs[name], at = _rebuild(structure, at + len(name) + 1, tensors)
            at += 1  # ","
        return HookArgs(args, kwargs), at + 1
    closing = {"(": ")", "[": "]"}[mark]
    items: list[Any] = []
    at += 1
    while structure[at] != closing:
        item, at = _rebuild(structure, at, tensors)
        items.append(item)
        at += 1  # ","
    return (tuple(items) if mark == "(" else items), at + 1


# ------------------------------------------------------------------ installing


def install_taps(values: list[Value], steers: Mapping[str, Steer] | None = None
                 ) -> list[RemovableHandle]:
    """Hook each module side the `values` sit at with the tap op (before vLLM compiles the
    model: a hook added after Dynamo's one trace is never seen), one op for all the values at
    one module side, served in the order given.

    One op per module side, never one per value: two ops that declare they mutate the same tensors,
    one after the other, make the compiler regenerate a strided view (the attention's value rows, a
    slice of the fused projection) from a copy of its base, and torch 2.13 got that wrong — taps at
    a layer's keys and values gave NaN logits to every request. The hooks run in eager forwards too,
    so a tapped location is served by its tap alone, never by a second, ordinary hook.

    `steers` (by location) add their rows' vectors in the graph before the op runs
    (`tap_edits`)."""
    groups: dict[tuple[int, str], list[Value]] = {}
    for value in values:
        groups.setdefault((id(value.module), value.side), []).append(value)
    return [_install(members, [steer for value in members
                               if (steer := (steers or {}).get(value.location)) is not None])
            for members in groups.values()]


def _install(values: list[Value], steers: list[Steer]) -> RemovableHandle:
    key_start = ";".join(value.location for value in values) + "|"
    tap: Callable[..., None] = torch.ops.vllm_interp.tap
    module = values[0].module
    if values[0].side == "input":
        def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            raw = HookArgs(args, kwargs)
            for steer in steers:
                steer.apply(module, raw)
            tensors, structure = flatten(raw)
            tap(tensors, key_start + structure)
        return module.register_forward_pre_hook(pre_hook, with_kwargs=True)

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        for steer in steers:
            steer.apply(module, output)
        tensors, structure = flatten(output)
        tap(tensors, key_start + structure)
    return module.register_forward_hook(hook)
