"""Saving inside the compiled model: a tap's value copied into a buffer in the graph (tier 3;
which ops and values are served this way: `in_graph`).

A `Save` needs no Python in the forward either: the tap's hook copies the whole value, every row
of the step, into a ring buffer of the tapped module (`ring[:rows] = value`), traced into the
graph like the rest of the model. The copy is private at once, so vLLM's later in-place kernels
cannot overwrite it. After the forward, the runtime takes the saving requests' rows from the
ring (`SaveRing.take`: one copy per run of adjacent requests) into the save store, as the tap's
Python would have; the ring is rewritten by the next forward, and on a GPU that copy is ordered
before it on the same stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from vllm_envoys import Value

from vllm_runner.ops import Save
from vllm_runner.serving import Want, passed_over
from vllm_runner.store import SaveStore


class SaveRing:
    """The ring buffer of one tapped value, and the copy the tap's hook makes into it."""

    def __init__(self, value: Value, width: int, rows: int, name: str, device: torch.device,
                 dtype: torch.dtype) -> None:
        """A `[rows, width]` buffer (`rows`: the most one forward runs) registered on the
        value's module as `interp_save_<name>_ring` (not saved with it)."""
        self.location = value.location
        self._name = f"interp_save_{name}_ring"
        value.module.register_buffer(self._name, torch.zeros(rows, width, device=device,
                                                             dtype=dtype), persistent=False)
        self.ring: torch.Tensor = getattr(value.module, self._name)

    def apply(self, module: nn.Module, rows: torch.Tensor) -> None:
        """Copy the value's `rows` (`[tokens, hidden]`) into the ring, traced into the compiled
        graph; the buffer is read through `module`, so the compiler takes it as an input."""
        getattr(module, self._name)[:rows.shape[0]].copy_(rows)

    def take(self, groups: Iterable[Iterable[Want]], failed: Callable[[str], bool],
             value: Value, store: SaveStore) -> None:
        """Keep each saving request's rows of the last forward (a request's `Save`s there
        share one copy), skipping programs that failed and steps the value is not served at."""
        spans = {}
        for want in (want for members in groups for want in members):
            if isinstance(want.op, Save) and not passed_over(want, value, failed):
                spans[want.program_id] = want.span
        owners: list[tuple[str, int]] = []
        pieces: list[torch.Tensor] = []
        for run in _runs(sorted(spans.items(), key=lambda item: item[1].start)):
            start, stop = run[0][1].start, run[-1][1].stop
            # One copy per run; its requests' pieces as views, made in one call.
            copied = self.ring[start:stop].clone().unsqueeze(0)
            pieces.extend(copied.split([span.stop - span.start for _, span in run], dim=1))
            owners.extend((program_id, span.first_position) for program_id, span in run)
        if owners:
            store.save_rows(self.location, 1, owners, pieces)


def _runs(spans: list[tuple[str, Any]]) -> list[list[tuple[str, Any]]]:
    """Spans (sorted by start) in runs of adjacent ones."""
    runs: list[list[tuple[str, Any]]] = []
    for item in spans:
        if runs and runs[-1][-1][1].stop == item[1].start:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs
