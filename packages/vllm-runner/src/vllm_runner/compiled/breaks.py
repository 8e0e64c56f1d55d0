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
taps look for it (`captures`, by `engine.v2_tap_graphs.TapBrokenCapture`): vLLM's own breaks
(attention, and other ops it marks with `eager_break_during_capture`) look for captures of
theirs and find none, so they stay inside the graph, and the forward runs exactly as in V2's
own full-graph capture (its forward context says no graph, as V2's does: collectives and
kernels that branch on a full graph's mode choose the same way). A tap breaks vLLM's own
breakable captures too, where a user turns them on (`VLLM_USE_BREAKABLE_CUDAGRAPH=1`), since
its Python must run wherever a graph is replayed.

This module is the taps' side and, like the taps, imports nothing from vLLM (the runtime runs
without an engine: `test_engine_seam`): the engine adapter hands it vLLM's `weak_ref_tensor`
when it attaches (`engine.attach`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

#: What a tap runs: its tensors and its key (`taps._serve_tap`).
TapBody = Callable[[list[torch.Tensor], str], None]

#: The capture broken at the taps that records this thread's stream now, as `active` (set by
#: `engine.v2_tap_graphs.TapBrokenCapture`): a registry apart from vLLM's, whose breaks never
#: look here.
captures = threading.local()

#: How a recorded tap refers to its tensors without keeping them alive (vLLM's
#: `weak_ref_tensor`, set by `engine.attach`; no capture runs before an engine attached).
weak_ref: Callable[[torch.Tensor], torch.Tensor] | None = None


def break_at_tap(body: TapBody, tensors: list[torch.Tensor], key: str) -> bool:
    """While a breakable capture (ours, or vLLM's own) records this thread's stream, end its
    graph segment here, run `body` now (nothing is served during a capture) and record it for
    every replay, with references to the tensors that do not keep them alive (the graph's
    memory pool owns them; a replay finds the same addresses). Whether it did; outside such a
    capture it does nothing and the caller runs `body` itself."""
    capture = getattr(captures, "active", None) or _vllms_own_capture()
    if capture is None or not torch.cuda.is_current_stream_capturing():
        return False
    if weak_ref is None:
        raise RuntimeError("a tap was captured before an engine adapter attached "
                           "(vllm_runner.engine.attach sets compiled.breaks.weak_ref)")
    held = [weak_ref(tensor) for tensor in tensors]
    add_tap = getattr(capture, "add_tap", None)  # ours: it replays only the taps a step needs
    if add_tap is not None:
        add_tap(lambda: body(held, key), key)
    else:
        capture.add_eager(lambda: body(held, key))
    return True


def _vllms_own_capture() -> Any:
    """vLLM's breakable capture running on this thread, if vLLM has one (its module loaded:
    none can run before)."""
    module = sys.modules.get("vllm.compilation.breakable_cudagraph")
    return None if module is None else module.BreakableCUDAGraphCapture.current()
