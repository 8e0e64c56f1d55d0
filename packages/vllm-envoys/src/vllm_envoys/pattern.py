"""Attention scores and probabilities, recomputed from the queries and keys an attention layer
was given. vLLM's kernels never materialise the pattern, so this is the only way to read it; the
recomputation uses the layer's own scale, logit soft-cap, sliding window, attention sinks and
grouped-query layout, and is read-only here (an edited pattern could not reach the kernel;
vllm-runner serves edits by computing the layer's output from the edited pattern itself).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_envoys.codecs import Codec
from vllm_envoys.node import Node, module_int


def attention_scale(attention: nn.Module) -> float:
    """The softmax scale vLLM's kernel applies (kept on the backend implementation)."""
    impl = getattr(attention, "impl", None)
    scale = getattr(impl, "scale", None)
    return float(scale if scale is not None else module_int(attention, "head_size") ** -0.5)


def attention_softcap(attention: nn.Module) -> float | None:
    """The attention logit soft-cap (Gemma 2), or `None` when the layer has none."""
    cap = getattr(getattr(attention, "impl", None), "logits_soft_cap", None)
    return float(cap) if cap else None


def attention_sinks(attention: nn.Module) -> torch.Tensor | None:
    """Per-head sink logits (GPT-OSS), or `None`: a sink is one more key every query sees, with
    a learned logit and no value, so it takes probability mass without appearing in the
    pattern."""
    sinks = getattr(getattr(attention, "impl", None), "sinks", None)
    return sinks if isinstance(sinks, torch.Tensor) else None


def probabilities_from(scores: torch.Tensor, attention: nn.Module) -> torch.Tensor:
    """The softmax of `[1, heads, query, key]` scores in float32, the sinks' share left out."""
    scores = scores.float()
    sinks = attention_sinks(attention)
    if sinks is None:
        return scores.softmax(-1)
    column = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]


def scores_from(query: torch.Tensor, key: torch.Tensor, attention: nn.Module) -> torch.Tensor:
    """`[1, heads, query, key]` pre-softmax scores of one request, masked with `-inf`.

    `key` holds the request's keys of positions `0..K-1` and `query` its queries of the last
    `T` of them (`K - T..K-1`): a whole prompt (`T == K`), a later chunk of one, or a decode
    step's one row. Keys are repeated over the query heads that share them (grouped-query
    attention), as the kernel does; causality and any sliding window mask by position.
    """
    head_size = module_int(attention, "head_size")
    tokens, keys_count = query.shape[0], key.shape[0]
    if keys_count < tokens:
        raise ValueError(f"a pattern needs the keys of every position up to its last query: "
                         f"got {keys_count} keys for {tokens} queries")
    queries = query.reshape(tokens, -1, head_size).transpose(0, 1).float()
    keys = key.reshape(keys_count, -1, head_size).transpose(0, 1).float()
    keys = keys.repeat_interleave(queries.shape[0] // keys.shape[0], dim=0)
    scores = queries @ keys.transpose(1, 2) * attention_scale(attention)
    cap = attention_softcap(attention)
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    positions = torch.arange(keys_count, device=query.device)
    distance = positions[keys_count - tokens:, None] - positions[None, :]
    allowed = distance >= 0
    window = getattr(attention, "sliding_window", None)
    if window:
        allowed &= distance < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.unsqueeze(0).to(query.dtype)


class Pattern(Codec):
    """Read-only codec over `(query, key)` giving scores or probabilities: one row per query,
    one column per key position from 0 (see `scores_from`)."""

    writable = False

    def __init__(self, probabilities: bool) -> None:
        self.probabilities = probabilities

    def decode(self, piece: Any, module: nn.Module, host: Node | None = None) -> torch.Tensor:
        query, key = piece
        scores = scores_from(query, key, module)
        if not self.probabilities:
            return scores
        return probabilities_from(scores, module).to(scores.dtype)

    def shape(self, piece: Any, module: nn.Module, host: Node | None = None) -> tuple[int, ...]:
        query, key = piece
        tokens = query.shape[0]
        heads = query.reshape(tokens, -1, module_int(module, "head_size")).shape[1]
        return (1, heads, tokens, key.shape[0])

    def fill(self) -> float:
        """What a masked (future) entry holds: `-inf` for scores, 0 for probabilities; rows of
        different steps are padded with it to one key width."""
        return 0.0 if self.probabilities else float("-inf")
