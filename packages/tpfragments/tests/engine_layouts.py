"""How an engine lays a logical tensor out over its ranks, written independently of tpfragments.

Each function follows vLLM 0.32's own arithmetic (its weight loaders and `_get_indices`), not
tpfragments' chunk math, so that a test comparing the two can fail: a rule that agreed only with
itself would prove nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor


def column_piece(logical: Tensor, rank: int, size: int, dim: int = -1) -> Tensor:
    """`ColumnParallelLinear`: `shard_size = O // tp; narrow(start=tp_rank * shard_size)`."""
    shard_size = logical.shape[dim] // size
    return logical.narrow(dim, rank * shard_size, shard_size).contiguous()


def merged_piece(parts: list[Tensor], rank: int, size: int) -> Tensor:
    """`MergedColumnParallelLinear`: each output size sharded on its own, then concatenated."""
    return torch.cat([column_piece(part, rank, size) for part in parts], dim=-1)


def heads_piece(logical: Tensor, rank: int, size: int, total_heads: int, dim: int = -1) -> Tensor:
    """The heads a rank holds, as `QKVParallelLinear.weight_loader` picks them.

    `num_heads = max(1, total // tp)`; with `tp >= total`, `num_kv_head_replicas = tp // total`
    ranks share a head and `shard_rank = tp_rank // num_kv_head_replicas`.
    """
    if size >= total_heads:
        local_heads, replicas = 1, size // total_heads
    else:
        local_heads, replicas = total_heads // size, 1
    head_width = logical.shape[dim] // total_heads
    shard_size = local_heads * head_width
    shard_rank = rank // replicas
    return logical.narrow(dim, shard_rank * shard_size, shard_size).contiguous()


def qkv_piece(q: Tensor, k: Tensor, v: Tensor, rank: int, size: int, num_heads: int,
              num_kv_heads: int) -> Tensor:
    """`QKVParallelLinear`: the rank's `[q_r, k_r, v_r]` along the last dim."""
    return torch.cat([
        heads_piece(q, rank, size, num_heads),
        heads_piece(k, rank, size, num_kv_heads),
        heads_piece(v, rank, size, num_kv_heads),
    ], dim=-1)


def pad_vocab_size(vocab_size: int, pad_to: int = 64) -> int:
    """vLLM's `pad_vocab_size`."""
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


def vocab_piece(table: Tensor, rank: int, size: int, org_vocab: int, num_added: int,
                dim: int = 0, padding_size: int = 64) -> Tensor:
    """`VocabParallelEmbedding`: a rank's `[base_r, pad, added_r, pad]`, as `_get_indices` says.

    `table` is indexed by token id along `dim` (base tokens, then added tokens).
    """
    org_padded = pad_vocab_size(org_vocab, padding_size)
    total_padded = pad_vocab_size(org_padded + num_added, padding_size)
    added_padded = total_padded - org_padded
    per_org, per_added = org_padded // size, added_padded // size
    org_start = rank * per_org
    org_end = min(org_start + per_org, org_vocab)
    added_start = org_vocab + rank * per_added
    added_end = min(added_start + per_added, org_vocab + num_added)
    shape = list(table.shape)
    shape[dim] = per_org + per_added
    piece = torch.zeros(shape, dtype=table.dtype)
    if org_end > org_start:
        piece.narrow(dim, 0, org_end - org_start).copy_(
            table.narrow(dim, org_start, org_end - org_start))
    if added_end > added_start:
        piece.narrow(dim, per_org, added_end - added_start).copy_(
            table.narrow(dim, added_start, added_end - added_start))
    return piece


def generic_piece(parts: list[tuple[Tensor, int | None, int]], rank: int, size: int,
                  dim: int) -> Tensor:
    """Any stack of parts `(tensor, units, padding)`, each padded then sharded like vLLM's KV
    heads: `shard_rank = rank // replicas`, `start = shard_rank * shard_size`."""
    pieces = []
    for tensor, units, padding in parts:
        if padding:
            pad_shape = list(tensor.shape)
            pad_shape[dim] = padding
            tensor = torch.cat([tensor, torch.zeros(pad_shape, dtype=tensor.dtype)], dim=dim)
        length = tensor.shape[dim]
        if units is not None and units < size:
            replicas, shard_size = size // units, length // units
        else:
            replicas, shard_size = 1, length // size
        shard_rank = rank // replicas
        pieces.append(tensor.narrow(dim, shard_rank * shard_size, shard_size))
    return torch.cat(pieces, dim=dim).contiguous()
