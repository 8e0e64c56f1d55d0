"""Values that are pieces under tensor parallelism, made whole around one hook visit.

Under tensor parallelism a rank holds only its heads of the queries, keys, values and head
outputs, and its slice of the MLP neurons. A request asked for the layer's value, not a piece,
so a visit to such a value gathers the whole once (one collective, however many requests read
it, via `tpfragments`), lets every request read and edit the whole, and hands each rank back its
own piece of the edited whole — or, when nothing was edited, the engine's own tensor untouched.

Which values are pieces is decided by `tpfragments.vllm.fragments_for`, keyed by
`"<module path>.<side>"`; this module maps a standard value (module and site) to those keys.
Every rank visits the same values in the same order with the same requests (the scheduler's
output is broadcast), so the collectives line up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from tpfragments import Fragments
from vllm_envoys import Value
from vllm_envoys.sites import Arguments, FirstOutput, Output


class ShardedValues:
    """Which components of each value's raw piece are shards, and the gather around a visit."""

    def __init__(self, model: nn.Module, fragments: Fragments) -> None:
        self.fragments = fragments
        self._paths = {id(module): path for path, module in model.named_modules()}

    def keys(self, value: Value) -> tuple[str | None, ...] | None:
        """The fragment key of each tensor the value's site picks (`None`: whole on every
        rank), or `None` when no component is a piece and the visit needs no collective."""
        if not len(self.fragments):
            return None
        path = self._paths.get(id(value.module))
        if path is None:
            return None
        site = value.eproperty.site
        if isinstance(site, Arguments):
            keys = tuple(self._argument_key(path, name, index)
                         for name, index in site.arguments)
        elif isinstance(site, (Output, FirstOutput)):
            if f"{path}.output" in self.fragments and isinstance(site, Output) and site.indices:
                raise NotImplementedError(
                    f"{value.location}: picking items of a sharded tuple output is not supported")
            keys = (f"{path}.output" if f"{path}.output" in self.fragments else None,)
        else:
            return None
        return keys if any(key is not None for key in keys) else None

    def _argument_key(self, path: str, name: str, index: int) -> str | None:
        # Attention layers name their sides after their arguments; linear layers call their
        # first argument "input".
        for key in (f"{path}.{name}", f"{path}.input" if index == 0 else None):
            if key is not None and key in self.fragments:
                return key
        return None

    def visit(self, value: Value, keys: tuple[str | None, ...], raw: Any,
              readers: Callable[[Any], None]) -> None:
        """Run `readers` on a raw structure holding whole values, then put each rank's piece of
        any edited whole back into the engine's tensor in place."""
        module = value.module
        site = value.eproperty.site
        if site is None:  # `keys` found shards, so the value has a site
            raise ValueError(f"{value.location} has no site to gather")
        picked = site.get(raw, module)
        pieces = picked if len(keys) > 1 else (picked,)
        wholes: list[Any] = []
        backs: list[Any] = []
        for key, piece in zip(keys, pieces, strict=True):
            if key is None or piece is None:
                wholes.append(piece)
                backs.append(None)
                continue
            whole, back = self.fragments.whole(key, piece)
            wholes.append(whole)
            backs.append(back)
        readers(site.put(raw, module, tuple(wholes) if len(keys) > 1 else wholes[0]))
        for piece, back in zip(pieces, backs, strict=True):
            if back is not None and back.changed():
                piece.copy_(back())
