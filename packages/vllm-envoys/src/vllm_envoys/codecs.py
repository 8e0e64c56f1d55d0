"""Codecs: turn the raw rows a site picked into a standard value, and a written value back.

Every read is a private copy in nnterp's layout (leading batch axis of 1), so nothing a user
keeps is overwritten by vLLM's in-place kernels. `encode` returns raw rows shaped exactly as
they were read, so `tokenspan.widen` can put them back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vllm_envoys.node import Node


class Codec:
    """Base class: `decode(piece, module, host)` reads, `encode(piece, module, value, host)` writes
    back.

    `module` is the hooked module; `host` the standard node the value belongs to, for codecs
    that need a sibling module (expert routing reads the router settings of the experts).
    """

    writable = True
    #: Decoding a slab of rows equals decoding each run of its rows and concatenating the
    #: results along the value's tokens axis, and likewise for encoding. A runner may then read
    #: (and write) a value once for many requests and hand each its rows; codecs that mix rows
    #: (a pattern) leave this False.
    rowwise = False

    def decode(self, piece: Any, module: nn.Module, host: Node | None = None) -> torch.Tensor:
        raise NotImplementedError

    def encode(self, piece: Any, module: nn.Module, value: torch.Tensor,
               host: Node | None = None) -> Any:
        raise NotImplementedError

    def shape(self, piece: Any, module: nn.Module, host: Node | None = None) -> tuple[int, ...]:
        """The shape `decode` gives, without copying anything."""
        raise NotImplementedError

    def view(self, piece: Any, module: nn.Module, host: Node | None = None) -> torch.Tensor | None:
        """The value as a view of the raw rows (in-place edits land in the engine at once), or
        `None` when it is computed from them and cannot be one (a sum, a softmax, a pattern).

        For the `view` read mode: it saves a copy, at the price of values that later in-place
        kernels may overwrite."""
        return None


class Rows(Codec):
    """A `[tokens, width]` tensor served as `[1, tokens, width]`.

    `batched=True` is for modules that already see `[1, tokens, width]` (vLLM's Transformers
    backend runs transformers' modules with a batch axis of 1). `writable=False` serves a value
    that can be read where it sits but not edited there (see `StreamLayer.layer_mid`).
    """

    rowwise = True

    def __init__(self, writable: bool = True, batched: bool = False) -> None:
        self.writable = writable
        self.batched = batched

    def decode(self, piece: torch.Tensor, module: nn.Module, host: Node | None = None
              ) -> torch.Tensor:
        return piece.clone() if self.batched else piece.clone().unsqueeze(0)

    def encode(self, piece: torch.Tensor, module: nn.Module, value: torch.Tensor,
               host: Node | None = None) -> torch.Tensor:
        return (value if self.batched else value[0]).to(piece.dtype)

    def shape(self, piece: torch.Tensor, module: nn.Module, host: Node | None = None
             ) -> tuple[int, ...]:
        return tuple(piece.shape) if self.batched else (1, *piece.shape)

    def view(self, piece: torch.Tensor, module: nn.Module, host: Node | None = None
            ) -> torch.Tensor | None:
        if not self.writable:
            return None
        return piece if self.batched else piece.unsqueeze(0)


class Scaled(Rows):
    """Rows served multiplied by a factor the host gives, written back divided by it.

    For blocks that scale a sublayer's output before adding it to the stream (Granite's
    `residual_multiplier`): the standard contribution is what reaches the stream, while the
    module returns it unscaled. `factor(host)` is read at each use, from the model's modules.
    """

    def __init__(self, factor: Callable[[Node], float]) -> None:
        super().__init__()
        self.factor = factor

    def _factor(self, host: Node | None) -> float:
        if host is None:
            raise TypeError("a scaled value is read with its host's factor: pass the host")
        return self.factor(host)

    def decode(self, piece: torch.Tensor, module: nn.Module, host: Node | None = None
              ) -> torch.Tensor:
        return super().decode(piece, module, host) * self._factor(host)

    def encode(self, piece: torch.Tensor, module: nn.Module, value: torch.Tensor,
               host: Node | None = None) -> torch.Tensor:
        return super().encode(piece, module, value / self._factor(host), host)

    def view(self, piece: torch.Tensor, module: nn.Module, host: Node | None = None
            ) -> torch.Tensor | None:
        return None  # a product is a copy


class Stream(Codec):
    """The residual stream of a block that passes it as `(hidden, residual)` halves.

    vLLM's fused blocks hand the stream on in two halves whose sum is the stream (`residual` is
    `None` before the first block). A read is the sum; a write puts the whole edited stream in
    the hidden half and zeros in the residual half, so the next fused add-norm rebuilds exactly
    the edited stream. A plain tensor (no halves) is served like `Rows`.
    """

    rowwise = True

    def _halves(self, piece: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(piece, torch.Tensor):
            return piece, None
        hidden, residual = piece
        return hidden, residual

    def decode(self, piece: Any, module: nn.Module, host: Node | None = None) -> torch.Tensor:
        hidden, residual = self._halves(piece)
        stream = hidden.clone() if residual is None else hidden + residual
        return stream.unsqueeze(0)

    def encode(self, piece: Any, module: nn.Module, value: torch.Tensor,
               host: Node | None = None) -> Any:
        hidden, residual = self._halves(piece)
        new_hidden = value[0].to(hidden.dtype)
        if isinstance(piece, torch.Tensor):
            return new_hidden
        return new_hidden, None if residual is None else torch.zeros_like(residual)

    def shape(self, piece: Any, module: nn.Module, host: Node | None = None) -> tuple[int, ...]:
        return (1, *self._halves(piece)[0].shape)

    def view(self, piece: Any, module: nn.Module, host: Node | None = None) -> torch.Tensor | None:
        hidden, residual = self._halves(piece)
        return hidden.unsqueeze(0) if residual is None else None  # two halves sum to a copy


class Heads(Codec):
    """A `[tokens, heads * head_dim]` tensor split into heads by the module's own head size.

    `heads_first` serves `[1, heads, tokens, head_dim]` (queries, keys, values), otherwise
    `[1, tokens, heads, head_dim]` (head outputs). The head size comes from the module
    (`head_dim(module)`), never from the config, so per-layer sizes and tensor-parallel wholes
    (which hold every head) both split correctly.
    """

    rowwise = True

    def __init__(self, head_dim: Callable[[nn.Module], int], heads_first: bool) -> None:
        self.head_dim = head_dim
        self.heads_first = heads_first

    def _split(self, piece: torch.Tensor, module: nn.Module) -> torch.Tensor:
        size = self.head_dim(module)
        tokens = piece.shape[0]
        return piece.reshape(tokens, -1, size)

    def decode(self, piece: torch.Tensor, module: nn.Module, host: Node | None = None
              ) -> torch.Tensor:
        heads = self._split(piece, module)
        heads = heads.transpose(0, 1) if self.heads_first else heads
        return heads.unsqueeze(0).clone(memory_format=torch.contiguous_format)

    def encode(self, piece: torch.Tensor, module: nn.Module, value: torch.Tensor,
               host: Node | None = None) -> torch.Tensor:
        heads = value[0].transpose(0, 1) if self.heads_first else value[0]
        return heads.reshape(piece.shape).to(piece.dtype)

    def shape(self, piece: torch.Tensor, module: nn.Module, host: Node | None = None
             ) -> tuple[int, ...]:
        tokens, heads, size = self._split(piece, module).shape
        return (1, heads, tokens, size) if self.heads_first else (1, tokens, heads, size)

    def view(self, piece: torch.Tensor, module: nn.Module, host: Node | None = None
            ) -> torch.Tensor | None:
        try:
            heads = piece.view(piece.shape[0], -1, self.head_dim(module))
        except RuntimeError:  # rows laid out so that no view splits them into heads
            return None
        return (heads.transpose(0, 1) if self.heads_first else heads).unsqueeze(0)


class Probabilities(Rows):
    """Read-only softmax over the last axis of `[rows, vocab]` logits (next-token probabilities)."""

    writable = False

    def __init__(self) -> None:
        super().__init__(writable=False)

    def decode(self, piece: torch.Tensor, module: nn.Module, host: Node | None = None
              ) -> torch.Tensor:
        return piece.float().softmax(-1).to(piece.dtype).unsqueeze(0)
