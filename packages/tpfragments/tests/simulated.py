"""In-process stand-ins for a group's collectives, for fast checks of the local math.

`simulated_group(rank, pieces)` is what rank `rank` would see if the other ranks held `pieces`:
its all-gather returns them all, its all-reduce their sum in rank order. Hypothesis can then try
hundreds of layouts in a second; `test_collectives.py` checks the same rules over real gloo.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor
from tpfragments import Group


def simulated_group(rank: int, pieces: list[Tensor], counts: Counter | None = None) -> Group:
    """Rank `rank` of a group whose ranks hold `pieces`; counts collectives into `counts`."""
    counts = counts if counts is not None else Counter()

    def all_gather(tensor: Tensor) -> Tensor:
        counts["all_gather"] += 1
        assert torch.equal(tensor, pieces[rank]), "a rank must gather its own piece"
        return torch.stack([piece.to(tensor.dtype) for piece in pieces])

    def all_reduce(tensor: Tensor) -> Tensor:
        counts["all_reduce"] += 1
        assert torch.equal(tensor, pieces[rank]), "a rank must reduce its own piece"
        total = pieces[0].clone()
        for piece in pieces[1:]:
            total += piece
        # Like torch.distributed's, this all-reduce overwrites its input.
        tensor.copy_(total)
        return tensor

    return Group(rank, len(pieces), all_gather=all_gather, all_reduce=all_reduce,
                 name="simulated")


def bits_equal(a: Tensor, b: Tensor) -> bool:
    """Equal shapes, dtypes and bits (so `-0.0` differs from `0.0` and NaN equals itself)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return bool(torch.equal(a.contiguous().view(kind), b.contiguous().view(kind)))
    return bool(torch.equal(a, b))
