"""Steering inside the compiled model: `Add` at a tap from buffers the runtime fills (tier 3;
which ops and values are served this way: `in_graph`).

A tap's op runs Python at every forward (`taps`); on a GPU its piecewise graphs split around it,
and a step whose programs act there cannot replay a full CUDA graph. An `Add` needs no Python in
the forward: each row of the step gets `scale[row] * table[index[row]]`, where `table` holds
this step's vectors (one per steered request), `index` the vector of each row and `scale` 1 on
the rows an `Add` keeps and 0 elsewhere (every other request, padding, positions it skips).
Those three tensors are buffers of the tapped module, so the compiler sees them as the model's
own inputs (never as constants it could fold) and a CUDA graph reads them where they live; the
runtime rewrites their contents before each forward that steers there (`SteerRows.fill`) and
zeroes them after, so a step that does not steer adds zeros.

A row gets one vector: several unfiltered `Add`s of a request at one location are summed into
one (`steered_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from vllm_envoys import Value

from vllm_runner.ops import Add
from vllm_runner.serving import Want, passed_over


@dataclass(frozen=True)
class SteeredRows:
    """One request's rows of a step at a location and the vector they get (`scale * vector`
    summed over its `Add`s there), with `keep(position)` for a filtered `Add`."""

    start: int
    stop: int
    first_position: int
    vector: torch.Tensor
    keep: Callable[[int], bool] | None


class SteerRows:
    """The buffers of one steerable tapped value, and the code the tap's hook runs with them."""

    def __init__(self, value: Value, width: int, rows: int, slots: int, name: str,
                 device: torch.device, dtype: torch.dtype) -> None:
        """Buffers for `slots` vectors of `width` and `rows` rows (the most one forward runs),
        registered on the value's module as `interp_steer_<name>_*` (not saved with it)."""
        module = value.module
        self.location = value.location
        self.width = width
        self._names = tuple(f"interp_steer_{name}_{part}" for part in ("table", "index", "scale"))
        for part, tensor in zip(self._names, (
                torch.zeros(slots, width, device=device, dtype=dtype),
                torch.zeros(rows, device=device, dtype=torch.long),
                torch.zeros(rows, device=device, dtype=dtype)), strict=True):
            module.register_buffer(part, tensor, persistent=False)
        self.table, self.index, self.scale = (getattr(module, part) for part in self._names)
        self.dirty = False

    def apply(self, module: nn.Module, rows: torch.Tensor) -> None:
        """Add each row's vector to `rows` (`[tokens, hidden]`) in place, traced into the
        compiled graph: no Python at run time. The buffers are read through `module`, so the
        compiler takes them as inputs."""
        table, index, scale = (getattr(module, part) for part in self._names)
        count = rows.shape[0]
        rows.add_(table.index_select(0, index[:count]) * scale[:count, None])

    def fill(self, steered: list[SteeredRows]) -> None:
        """Write this step's vectors, row indices and scales (zeros on every other row). Only
        the rows up to the last steered one are written: past it the scales are zero already
        (`clear` after every step that steered)."""
        if len(steered) > self.table.shape[0]:
            raise ValueError(f"{self.location}: {len(steered)} steered requests in one step, "
                             f"more than the {self.table.shape[0]} slots")
        vectors = torch.stack([rows.vector.reshape(-1).expand(self.width)
                               for rows in steered]).to(self.table.dtype) if steered else None
        # A vector that overflows the model's dtype (float16) would put inf in the table, and
        # `0 * inf` is NaN on every row whose scale is 0: other requests' rows included.
        if vectors is not None and not bool(torch.isfinite(vectors).all()):
            raise ValueError(f"{self.location}: a steering vector is not finite in "
                             f"{self.table.dtype}")
        self.dirty = True  # from here on `clear` zeroes the scales, whatever fails below
        end = max((rows.stop for rows in steered), default=0)
        index = torch.zeros(end, dtype=torch.long)
        scale = torch.zeros(end, dtype=torch.float32)
        for slot, rows in enumerate(steered):
            index[rows.start:rows.stop] = slot
            if rows.keep is None:
                scale[rows.start:rows.stop] = 1.0
            else:
                scale[rows.start:rows.stop] = torch.tensor(
                    [float(rows.keep(rows.first_position + offset))
                     for offset in range(rows.stop - rows.start)])
        if vectors is not None:
            self.table[:len(steered)].copy_(vectors)
        self.index[:end].copy_(index)
        self.scale[:end].copy_(scale.to(self.scale.dtype))

    def clear(self) -> None:
        """No row steered (after a step that steered here)."""
        if self.dirty:
            self.scale.zero_()
            self.dirty = False


def steered_rows(value: Value, groups: Iterable[Iterable[Want]],
                 failed: Callable[[str], bool]) -> list[SteeredRows]:
    """Each waiting request's rows and vector at `value` this step: its `Add`s there summed
    (`scale * vector`, in float32), skipping requests whose program failed and steps the value
    is not served at (as the taps' Python would)."""
    found: dict[str, SteeredRows] = {}
    for want in (want for members in groups for want in members):
        op = want.op
        if not isinstance(op, Add) or passed_over(want, value, failed):
            continue
        vector = op.vector.detach().to("cpu", torch.float32).reshape(-1) * float(op.scale)
        earlier = found.get(want.request_id)
        if earlier is not None:  # unfiltered `Add`s only (`in_graph.in_graph_ops`): one sum
            vector = earlier.vector + vector
        span = want.span
        found[want.request_id] = SteeredRows(span.start, span.stop, span.first_position,
                                             vector, op.keeps(want.step.prompt_length))
    return list(found.values())
