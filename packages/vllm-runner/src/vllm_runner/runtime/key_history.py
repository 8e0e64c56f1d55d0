"""Each request's attention keys so far, so its pattern can be served on every step.

vLLM's kernels never form the attention pattern; it is recomputed from a layer's queries and
keys (`vllm_envoys.pattern`). A step's hook sees only that step's keys, but a decode step's
query, or a later chunk's, attends to the keys of every earlier position as well. Those are in
vLLM's paged KV cache — in a layout each attention backend chooses (the CPU backend's is
ISA-packed) and possibly quantised — so they are kept here instead, exactly as the layer was
given them: for a request whose program reads a layer's pattern, that layer's keys at every
position it runs through, by absolute position. Programmed requests never read the prefix
cache, so every position runs through the model; preemption recomputes from position 0, and
a recomputed position replaces what was kept.

Pure torch over plain data, like `row_serving`: the runtime hands over the request's rows and is
given them back with the earlier keys in front of the step's.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm_envoys import Value
from vllm_envoys.pattern import Pattern


def reads_pattern(value: Value) -> bool:
    """Whether `value` is an attention pattern (recomputed from queries and every key)."""
    return isinstance(value.eproperty.codec, Pattern)


class KeyHistory:
    """Keys by (program id, attention layer): rows `0..n-1` of what the layer was given."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, str], torch.Tensor] = {}

    def with_earlier_keys(self, program_id: str, value: Value, first_position: int,
                          rows: Any) -> Any:
        """The request's rows of a pattern value (its step's queries and keys), with the keys
        replaced by those of every position up to the step's last; the step's keys are kept
        for the steps after it. Rows kept past the step's first position (a recomputation
        after preemption) are replaced."""
        site = value.eproperty.site
        if site is None:
            raise ValueError(f"{value.location} has no site to read keys from")
        module = value.module
        query, key = site.get(rows, module)
        held_at = (program_id, value.host.location)
        held = self._keys.get(held_at)
        kept = 0 if held is None else min(held.shape[0], first_position)
        if kept < first_position:
            raise ValueError(
                f"{value.location}: the keys of positions {kept}..{first_position - 1} never ran "
                "through this layer for this request (read from the prefix cache?), so its "
                "pattern cannot be recomputed")
        # A copy: the engine may overwrite the step's key tensor in place later.
        keys = key.detach().clone() if held is None or kept == 0 else torch.cat(
            [held[:kept], key.detach()])
        self._keys[held_at] = keys
        return site.put(rows, module, (query, keys))

    def forget(self, program_id: str) -> None:
        """Drop a finished or abandoned request's keys."""
        for held_at in [held_at for held_at in self._keys if held_at[0] == program_id]:
            del self._keys[held_at]
