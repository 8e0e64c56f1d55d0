"""Full CUDA graphs broken at the taps, so a step whose programs need a tap's Python still runs
at nearly the speed of vLLM's full graphs.

Without this, such a step leaves the full graph for the piecewise graphs, which run every
attention layer eagerly between their pieces: on the SmolLM2 shape at 64 decodes a step that
cost 0.27 of vLLM's default engine whatever the taps did (`call1`, docs/gpu.md). Here the
engine keeps a second set of full graphs, captured the same way as V2's own but with the
stream capture ended at every tap, the tap's Python recorded, and capture resumed: a replay
runs graph, tap, graph, tap, ... with attention inside the graphs.

The capture is vLLM's own (`vllm.compilation.breakable_cudagraph.BreakableCUDAGraphCapture`,
the mechanism vLLM uses for models it cannot compile piecewise), registered where only the
taps look for it (`TapBrokenCapture`): vLLM's own breaks (attention, and other ops it marks
with `eager_break_during_capture`) look for captures of theirs and find none, so they stay
inside the graph and the forward runs exactly as in V2's own full-graph capture (its forward
context says no graph, as V2's does: collectives and kernels that branch on a full graph's
mode choose the same way). A tap breaks vLLM's own breakable captures too, where a user turns
them on (`VLLM_USE_BREAKABLE_CUDAGRAPH=1`), since its Python must run wherever a graph is
replayed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
from vllm.utils.torch_utils import weak_ref_tensor

#: What a tap runs: its tensors and its key (`taps._serve_tap`).
TapBody = Callable[[list[torch.Tensor], str], None]


class TapBrokenCapture(BreakableCUDAGraphCapture):
    """vLLM's breakable capture, found by the taps alone: it is this thread's active capture in
    a registry of its own, so vLLM's breaks, which ask `BreakableCUDAGraphCapture.current()`,
    run inside the graph."""

    _tls = threading.local()

    def __enter__(self) -> TapBrokenCapture:
        if self.current() is not None:
            raise RuntimeError("a capture broken at the taps is already running on this thread")
        TapBrokenCapture._tls.active = self
        self._begin_segment()
        return self

    def __exit__(self, *exception: object) -> None:
        try:
            self._end_segment()
        finally:
            TapBrokenCapture._tls.active = None


def break_at_tap(body: TapBody, tensors: list[torch.Tensor], key: str) -> bool:
    """While a breakable capture (ours, or vLLM's own) records this thread's stream, end its
    graph segment here, run `body` now (nothing is served during a capture) and record it for
    every replay, with references to the tensors that do not keep them alive (the graph's
    memory pool owns them; a replay finds the same addresses). Whether it did; outside such a
    capture it does nothing and the caller runs `body` itself."""
    capture = TapBrokenCapture.current() or BreakableCUDAGraphCapture.current()
    if capture is None or not torch.cuda.is_current_stream_capturing():
        return False
    held = [weak_ref_tensor(tensor) for tensor in tensors]
    capture.add_eager(lambda: body(held, key))
    return True


def capture_broken(forward: Callable[[], Any], pool: Any) -> TapBrokenCapture:
    """`forward` (V2's capture forward for one batch descriptor) captured into `pool`, broken at
    the taps only; replay it with `.replay()`."""
    torch.cuda.synchronize()  # as `torch.cuda.graph` does before it captures
    with TapBrokenCapture(pool=pool) as capture:
        forward()
    return capture
