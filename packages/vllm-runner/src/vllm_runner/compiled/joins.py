"""Captured CUDA graphs joined into one, launched with one call (`compiled.replays`).

Each graph becomes a child node of a new graph, each child after the one before (CUDA clones
the child: the segment keeps its own graph), and the new graph is instantiated once. Its kernels
are the segments' kernels on the segments' memory (the addresses they were captured with, which
the capture's memory pool keeps), so a launch does on the device what replaying the segments in
order does, with one host call instead of one per segment.

Through CUDA's runtime API as `cuda-python` (`cuda.bindings`, which vLLM's GPU builds depend on)
exposes it, and the segments' templates as PyTorch keeps them (`CUDAGraph(keep_graph=True)`,
`raw_cuda_graph`). What PyTorch's own replay adds around the launch is left out: its
per-replay advance of the random generators a capture drew from (vLLM's forward draws none:
sampling runs after it) and its replay hooks (nothing here registers any).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch


class JoinedGraph:
    """`graphs` (PyTorch CUDA graphs captured with `keep_graph=True`, in replay order) joined
    into one executable graph; calling it launches that on the current stream."""

    def __init__(self, graphs: Sequence[Any]) -> None:
        from cuda.bindings import runtime

        self._runtime = runtime
        children = [graph.raw_cuda_graph() for graph in graphs]
        children = [child for child in children if _node_count(runtime, child)]
        self._exec = None
        if not children:  # nothing to launch
            return
        parent = _checked(runtime, "cudaGraphCreate", runtime.cudaGraphCreate(0))
        try:
            node = None
            for child in children:
                node = _checked(runtime, "cudaGraphAddChildGraphNode",
                                runtime.cudaGraphAddChildGraphNode(
                                    parent, None if node is None else [node],
                                    0 if node is None else 1, child))
            self._exec = _checked(runtime, "cudaGraphInstantiate",
                                  runtime.cudaGraphInstantiate(parent, 0))
        finally:
            runtime.cudaGraphDestroy(parent)  # the executable graph stands on its own
        weakref.finalize(self, runtime.cudaGraphExecDestroy, self._exec)

    def __call__(self) -> None:
        if self._exec is None:
            return
        _checked(self._runtime, "cudaGraphLaunch", self._runtime.cudaGraphLaunch(
            self._exec, torch.cuda.current_stream().cuda_stream))


def _node_count(runtime: Any, graph: int) -> int:
    """How many nodes `graph` holds (a segment between two taps with no kernel between holds
    none: it is left out)."""
    _, count = _checked(runtime, "cudaGraphGetNodes", runtime.cudaGraphGetNodes(graph, numNodes=0))
    return int(count)


def _checked(runtime: Any, call: str, result: Any) -> Any:
    """What a `cuda.bindings` call gave after its error code (one value, or a tuple of them);
    raises, naming the call and CUDA's message, if it failed."""
    error, *values = result
    if error != runtime.cudaError_t.cudaSuccess:
        _, message = runtime.cudaGetErrorString(error)
        text = message.decode() if isinstance(message, bytes) else message
        raise RuntimeError(f"{call} failed: {error!r} ({text})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)
