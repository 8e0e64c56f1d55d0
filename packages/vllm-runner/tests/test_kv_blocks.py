"""The bookkeeping behind zeroing KV blocks that editing requests held (`kv_blocks`), and the
zeroing used where vLLM has none of its own, on plain tensors in vLLM's two cache layouts."""

from __future__ import annotations

import torch
from vllm_runner.engine.kv_blocks import WrittenBlocks, zero_blocks


def test_blocks_are_zeroed_once_when_handed_out_again() -> None:
    written = WrittenBlocks()
    assert written.reused([1, 2, 3]) == []  # nothing edited yet: nothing to do
    written.held_by_editing([4, 5])
    written.held_by_editing([5, 6])  # marked again next step: no double entry
    assert written.reused([1, 5, 6, 7]) == [5, 6]
    assert written.reused([5, 6]) == []  # clean once zeroed
    assert len(written) == 1  # block 4 is still held


def test_zeroing_finds_the_blocks_axis_in_either_layout() -> None:
    blocks_first = torch.ones(6, 2, 4, 3)    # [blocks, 2, block_size, head_dim]
    kv_first = torch.ones(2, 6, 4, 3)        # [2, blocks, block_size, head_dim]
    zero_blocks([blocks_first, kv_first], 6, [1, 4])
    for cache, axis in ((blocks_first, 0), (kv_first, 1)):
        zeroed = cache.sum(dim=[d for d in range(4) if d != axis])
        assert zeroed.tolist() == [24.0, 0.0, 24.0, 24.0, 0.0, 24.0]
