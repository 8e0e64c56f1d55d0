"""`Group`: the ranks a value is spread over, and the two collectives that reassemble it.

The collectives are plain callables so that the same rules run over a torch.distributed process
group (gloo on CPU in tests, NCCL on GPUs) or over an engine's own communicator (vLLM's
`GroupCoordinator`, which may use custom all-reduce kernels or shared memory). Counting or
timing collectives is then a matter of wrapping the callables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["AllGather", "AllReduce", "Group"]

AllGather = Callable[[Tensor], Tensor]
"""Gathers one tensor from every rank: returns them stacked, shape `[size, *tensor.shape]`, in
rank order, identical on every rank."""

AllReduce = Callable[[Tensor], Tensor]
"""Sums one tensor over the ranks and returns the sum, identical on every rank. It may overwrite
its input (torch.distributed's all_reduce does); callers hand it a tensor they own."""


class Group:
    """The ranks of one tensor-parallel group, seen from one of them.

    A `Group` knows this rank's index, the number of ranks and how to run the two collectives the
    rules need. It exists so that rules never call torch.distributed directly: an engine that
    has its own communicator injects it, and tests inject counting wrappers.

    Args:
        rank: this process's index in the group, `0 <= rank < size`.
        size: the number of ranks.
        all_gather: see `AllGather`; needed by rules that gather (`Shard`, `Stacked`).
        all_reduce: see `AllReduce`; needed by `Partial`.
        name: shown in messages and `repr`.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        *,
        all_gather: AllGather | None = None,
        all_reduce: AllReduce | None = None,
        name: str = "group",
    ) -> None:
        if size < 1:
            raise ValueError(f"a group has at least one rank, got size {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of size {size}")
        self.rank = rank
        self.size = size
        self.name = name
        self._all_gather = all_gather
        self._all_reduce = all_reduce

    def __repr__(self) -> str:
        return f"Group(name={self.name!r}, rank={self.rank}, size={self.size})"

    def all_gather(self, tensor: Tensor) -> Tensor:
        """Every rank's `tensor`, stacked along a new leading dimension of length `size`.

        The result's shape is checked, because an injected collective that concatenates instead
        of stacking would otherwise be read as a wrong layout without any error.
        """
        if self.size == 1:
            return tensor.unsqueeze(0)
        if self._all_gather is None:
            raise RuntimeError(f"{self!r} was built without an all_gather collective")
        gathered = self._all_gather(tensor)
        expected = (self.size, *tensor.shape)
        if tuple(gathered.shape) != expected:
            raise RuntimeError(
                f"{self!r}: the injected all_gather returned shape {tuple(gathered.shape)} for an "
                f"input of shape {tuple(tensor.shape)}; it must stack the ranks' tensors, giving "
                f"{expected}"
            )
        return gathered

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """The sum of every rank's `tensor`. `tensor` may be overwritten; pass one you own."""
        if self.size == 1:
            return tensor
        if self._all_reduce is None:
            raise RuntimeError(f"{self!r} was built without an all_reduce collective")
        reduced = self._all_reduce(tensor)
        if reduced.shape != tensor.shape:
            raise RuntimeError(
                f"{self!r}: the injected all_reduce returned shape {tuple(reduced.shape)} for an "
                f"input of shape {tuple(tensor.shape)}"
            )
        return reduced

    @classmethod
    def single(cls, name: str = "single") -> Group:
        """A group of one rank: every value is already whole and nothing is ever communicated."""
        return cls(0, 1, name=name)

    @classmethod
    def from_torch(cls, process_group: ProcessGroup | None = None, name: str = "torch") -> Group:
        """Wrap a torch.distributed process group (the default group when `None`).

        Works with any backend that implements all-gather and all-reduce for the tensors' device
        (gloo on CPU, NCCL on CUDA). `torch.distributed` must already be initialised.
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group")
        rank = dist.get_rank(process_group)
        size = dist.get_world_size(process_group)

        def all_gather(tensor: Tensor) -> Tensor:
            tensor = tensor.contiguous()
            # The single-tensor form wants the ranks concatenated along dim 0; a 0-d tensor
            # therefore travels as a 1-element vector.
            flat = tensor.reshape(1) if tensor.dim() == 0 else tensor
            single = getattr(dist, "all_gather_single", None)
            if single is None:
                # Older torch: the list form is the one every backend (gloo included) supports.
                parts = [torch.empty_like(tensor) for _ in range(size)]
                dist.all_gather(parts, tensor, group=process_group)
                return torch.stack(parts)
            out = flat.new_empty((size * flat.shape[0], *flat.shape[1:]))
            single(out, flat, group=process_group)
            return out.view(size, *tensor.shape)

        def all_reduce(tensor: Tensor) -> Tensor:
            dist.all_reduce(tensor, group=process_group)
            return tensor

        return cls(rank, size, all_gather=all_gather, all_reduce=all_reduce, name=name)
