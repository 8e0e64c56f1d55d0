"""Forward hooks on exactly the modules this step's programs name; unwanted places cost nothing.

A value on a module's input side is served by a forward pre-hook (it sees `HookArgs`), one on
its output side by a forward hook. Every sampled-row value is served by one hook on the logits
processor (`SAMPLER_HOOK`), so reads of the logits always follow their edits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from vllm_envoys import HookArgs, Value

from vllm_runner.ops.locations import PER_SAMPLED_ROW

SAMPLER_HOOK = "logits"
#: The value whose module's input is the step's token ids (`TokenIdsHook`), and how a step that
#: needs them is named where locations are listed.
EMBEDDINGS = "token_embeddings"
TOKEN_IDS = "the step's token ids (ops with tokens=)"

#: `(location, value, raw)`: called at every visit of a hooked value.
OnVisit = Callable[[str, Value, Any], None]


def hooked_at(location: str) -> str:
    """The location whose hook serves `location`."""
    return SAMPLER_HOOK if location in PER_SAMPLED_ROW else location


class HookCaptured(RuntimeError):
    """A hook ran while a compiler traced the model or a CUDA graph was captured: what it did
    would be frozen into every later forward (a trace) or never run again (a replay)."""


def refuse_capture(location: str) -> None:
    """Fail loudly where a hook is being traced or captured instead of run (taps, not hooks,
    are what runs inside a compiled model: `vllm_runner.compiled.taps`)."""
    if torch.compiler.is_compiling() or (torch.cuda.is_available()
                                         and torch.cuda.is_current_stream_capturing()):
        raise HookCaptured(f"the hook at {location} ran while the model was being compiled or "
                           "its CUDA graph captured; this is a bug of vllm-runner: please report "
                           "it with the engine's settings")


class Hooks:
    """The hooks installed now, one per hooked location, calling `on_visit` when they fire."""

    def __init__(self, values: dict[str, Value], on_visit: OnVisit,
                 tapped: frozenset[str] = frozenset()) -> None:
        self._values = values
        self._on_visit = on_visit
        #: Locations a tap serves (`vllm_runner.compiled.taps`): they get no hook of their own.
        self.tapped = tapped
        self._installed: dict[str, RemovableHandle] = {}

    def sync(self, wanted: Iterable[str]) -> None:
        """Install hooks for the `wanted` locations (served at `hooked_at`), remove the rest."""
        # An ordered dict, never a set: hooks on one module fire in installation order, and
        # under tensor parallelism every rank must run its gathers in the same order (a set's
        # order follows string hashes, which differ between processes).
        hooked = dict.fromkeys(hooked_at(location) for location in wanted
                               if location not in self.tapped)
        for location in [location for location in self._installed if location not in hooked]:
            self._installed.pop(location).remove()
        for location in hooked:
            if location not in self._installed:
                self._installed[location] = self._install(self._values[location])

    def _install(self, value: Value) -> RemovableHandle:
        location, on_visit = value.location, self._on_visit
        if value.side == "input":
            def pre_hook(module: nn.Module, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> None:
                refuse_capture(location)
                on_visit(location, value, HookArgs(args, kwargs))
            return value.module.register_forward_pre_hook(pre_hook, with_kwargs=True)

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            refuse_capture(location)
            on_visit(location, value, output)
        return value.module.register_forward_hook(hook)

    def __len__(self) -> int:
        return len(self._installed)


class TokenIdsHook:
    """A pre-hook on the model's embedding, installed only while a step's programs filter by
    token (`RowOp.tokens`): it hands the step's token ids (one per row of the slab, on the
    device) to the ops that step (`Services.token_ids`)."""

    def __init__(self, embedding: nn.Module, services: Any) -> None:
        self._embedding = embedding
        self._services = services
        self._handle: RemovableHandle | None = None

    def sync(self, wanted: bool) -> None:
        """Install the hook for a step that needs the ids, remove it after one that does not."""
        if wanted and self._handle is None:
            self._handle = self._embedding.register_forward_pre_hook(self._seen,
                                                                     with_kwargs=True)
        elif not wanted and self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _seen(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        refuse_capture(EMBEDDINGS)
        ids = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(ids, torch.Tensor):
            self._services.token_ids = ids.reshape(-1)
