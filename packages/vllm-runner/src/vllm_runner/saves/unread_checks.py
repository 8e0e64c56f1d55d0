"""Finiteness checks of a step's edits answered on the device, read by the host later.

Each result of a plain `Call` is checked for NaN and infinity before it reaches the engine's
rows. Reading that answer in the middle of the forward made the host wait for the device there
once a step (on a GPU: the device idles while the tap's Python runs, and the host cannot run
ahead to the next step). Instead the device keeps the answer — how many NaN or infinite values
each request's result holds, so no result is kept alive for the error message: each request's
rows are written only where its count is 0 (`tokenspan.widen`'s `written_rows`), the counts
are copied to pinned host memory behind the forward, and the store reads them before it next
says whether one of those programs failed (`SaveStore.failed`: the next step's plan at the
latest, or a later edit of the same program in the same forward), failing the requests whose
result was not finite with the same error as before. Nothing non-finite is ever written either
way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch


class UnreadChecks:
    """One group's answers (`bad`: int64, how many NaN or infinite values each request's edit
    held, where the forward runs) and why the `index`-th request failed, should its count not be
    0 (`why(index, bad)`: asked only then)."""

    def __init__(self, program_ids: Sequence[str], bad: torch.Tensor,
                 why: Callable[[int, int], str]) -> None:
        self.program_ids = list(program_ids)
        self._why = why
        self._ready: torch.cuda.Event | None = None
        if bad.device.type == "cuda":
            self._answers = torch.empty(bad.shape, dtype=bad.dtype, pin_memory=True)
            self._answers.copy_(bad, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:  # the host's own answer, or a device without this copy: read now
            self._answers = bad.cpu()

    def failures(self) -> Iterator[tuple[str, str]]:
        """`(program_id, why)` of each request whose result was not finite (waits for the
        device to reach the check, if it has not yet)."""
        if self._ready is not None:
            self._ready.synchronize()
        for index, bad in enumerate(self._answers.tolist()):
            if bad:
                yield self.program_ids[index], self._why(index, bad)
