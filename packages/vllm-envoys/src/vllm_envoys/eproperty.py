"""`EProperty`: one standard value declared on a host — where it is, its layout, how to read and
write it, and when it is unavailable and why."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, overload

import torch
from torch import nn

from vllm_envoys.codecs import Codec
from vllm_envoys.errors import ReadOnly, Unavailable, ValueShapeError
from vllm_envoys.layouts import Layout
from vllm_envoys.node import Node
from vllm_envoys.sites import Site


class Step(NamedTuple):
    """What a value needs to know about one request's rows in one engine step (a tuple: an
    engine makes one per request at every step).

    `first_position` is the absolute position of the request's first row this step, `tokens`
    its row count, `prompt_length` the length of its prompt. `earlier_keys` says that the
    caller hands the attention pattern the request's keys of every earlier position with this
    step's (vllm-runner keeps them); without them the pattern is computable only on a step
    that starts at position 0.
    """

    first_position: int
    tokens: int
    prompt_length: int
    earlier_keys: bool = False


Reason = str | Callable[[Node, Step | None], str | None] | None


class EProperty:
    """A standard value of a host (a layer, its attention, its MLP, the model).

    - `module`: the submodule holding the value, relative to the host (`""` is the host itself,
      e.g. `"attn"` or `"down_proj"`); the runner hooks that module.
    - `site`: where in the module's call or output the tensors are (`Arguments`, `Output`).
    - `codec`: how raw rows become the standard value (a private copy in `layout`) and back.
    - `unavailable`: a fixed reason, or `f(host, step)` returning a reason or `None`. With
      `step=None` only reasons that hold for every step are reported (as `support()` does);
      `when` names the condition of such a value for the docs' table (e.g. "prefill").

    A value declared with `site=None` or `codec=None` is never available, and must say why with
    a fixed reason (`unavailable("reason")` declares one).
    """

    def __init__(
        self,
        site: Site | None,
        codec: Codec | None,
        layout: Layout,
        description: str,
        module: str | Callable[[Node], str] = "",
        unavailable: Reason = None,
        when: str = "",
    ) -> None:
        if (site is None or codec is None) and not isinstance(unavailable, str):
            raise TypeError(
                f"a value without a site or a codec ({description!r}) is never available: give "
                "the reason as unavailable='...' (or declare it with vllm_envoys.unavailable)"
            )
        self.site = site
        self.codec = codec
        self.layout = layout
        self.description = description
        self.module = module
        self.unavailable = unavailable
        self.when = when
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, host: None, owner: type) -> EProperty: ...

    @overload
    def __get__(self, host: Node, owner: type) -> Value: ...

    def __get__(self, host: Node | None, owner: type) -> EProperty | Value:
        if host is None:
            return self
        return Value(host, self)

    @property
    def writable(self) -> bool:
        """Whether writes are accepted (derived values such as patterns are read-only)."""
        return self.codec is not None and self.codec.writable

    def reason(self, host: Node, step: Step | None = None) -> str | None:
        """Why this value cannot be served on `host` (at `step`), or `None` if it can."""
        if callable(self.unavailable):
            return self.unavailable(host, step)
        return self.unavailable

    def unless(self, reason: Callable[[Node, Step | None], str | None], when: str) -> EProperty:
        """This value, unavailable too wherever `reason` gives a reason (checked first).

        For a family whose hosts serve a standard value except on some layers (e.g. latent
        attention); `when` names where it is served, for the docs' table.
        """
        own = self.unavailable

        def either(host: Node, step: Step | None) -> str | None:
            found = reason(host, step)
            if found is not None:
                return found
            return own(host, step) if callable(own) else own

        either.__qualname__ = f"{getattr(reason, '__qualname__', 'reason')} or {self.name}'s own"
        return EProperty(self.site, self.codec, self.layout, self.description, self.module,
                         unavailable=either, when=", ".join(filter(None, (self.when, when))))

    def __repr__(self) -> str:
        return f"({self.name}) -> [{' '.join(self.layout)}]: {self.description}"


def unavailable(reason: str, layout: Layout = (), description: str = "") -> EProperty:
    """Declare a standard value this host never has, with the reason users will read."""
    return EProperty(None, None, layout, description or reason, unavailable=reason)


class Value:
    """An `EProperty` bound to one host: what a runner hooks, reads and writes."""

    __slots__ = ("eproperty", "host")

    def __init__(self, host: Node, eproperty: EProperty) -> None:
        self.host = host
        self.eproperty = eproperty

    @property
    def location(self) -> str:
        """The canonical standard name, e.g. `layers.3.self_attn.attention_queries`."""
        prefix = self.host.location
        return f"{prefix}.{self.eproperty.name}" if prefix else self.eproperty.name

    @property
    def module(self) -> nn.Module:
        """The vLLM module whose call (input side) or output carries the value."""
        path = self.eproperty.module
        return self.host.submodule(path(self.host) if callable(path) else path)

    @property
    def side(self) -> str:
        """`"input"` (hook before the call) or `"output"` (hook after it)."""
        site, _ = self._served()
        return site.side

    def reason(self, step: Step | None = None) -> str | None:
        """Why the value is unavailable (at `step`), or `None`."""
        return self.eproperty.reason(self.host, step)

    def _served(self, step: Step | None = None) -> tuple[Site, Codec]:
        """The value's site and codec; `Unavailable` with the reason if it cannot be served."""
        reason = self.reason(step)
        site, codec = self.eproperty.site, self.eproperty.codec
        if reason is not None:
            raise Unavailable(self.location, reason)
        if site is None or codec is None:  # refused by EProperty unless a reason is fixed
            raise Unavailable(self.location, "it is declared without a site or a codec")
        return site, codec

    def read(self, raw: Any, step: Step | None = None) -> torch.Tensor:
        """The standard value from one request's raw rows (a private copy)."""
        site, codec = self._served(step)
        module = self.module
        return codec.decode(site.get(raw, module), module, self.host)

    def view(self, raw: Any, step: Step | None = None) -> torch.Tensor | None:
        """The value as a view of one request's raw rows, or `None` if it can only be a copy.

        In-place edits of a view reach the engine at once; a view may be overwritten by the
        engine's later in-place kernels, so code that keeps it should `read` instead."""
        site, codec = self._served(step)
        module = self.module
        return codec.view(site.get(raw, module), module, self.host)

    def write(self, raw: Any, value: torch.Tensor, step: Step | None = None) -> Any:
        """New raw rows carrying `value`; refused, before anything changes, if it does not fit."""
        site, codec = self._served(step)
        if not codec.writable:
            raise ReadOnly(f"{self.location} is derived and read-only; edit the values it is "
                           "computed from instead")
        module = self.module
        piece = site.get(raw, module)
        expected = codec.shape(piece, module, self.host)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueShapeError(
                f"{self.location}: expected a tensor of shape {expected} (as read), got {got}; "
                "write into the rows you mean instead"
            )
        return site.put(raw, module, codec.encode(piece, module, value, self.host))

    def __repr__(self) -> str:
        return f"Value({self.location} [{' '.join(self.eproperty.layout)}])"
