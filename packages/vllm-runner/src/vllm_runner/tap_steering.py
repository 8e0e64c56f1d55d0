"""Steering inside the compiled model: `Add` at a tap from buffers the runtime fills (tier 3).

A tap's op runs Python at every forward (`taps`); on a GPU its piecewise graphs split around it,
and a step whose programs act there cannot replay a full CUDA graph. An `Add` needs no Python in
the forward: each row of the step gets `scale[row] * table[index[row]]`, where `table` holds
this step's vectors (one per steered request), `index` the vector of each row and `scale` 1 on
the rows an `Add` keeps and 0 elsewhere (every other request, padding, positions it skips).
Those three tensors are buffers of the tapped module, so the compiler sees them as the model's
own inputs (never as constants it could fold) and a CUDA graph reads them where they live; the
runtime rewrites their contents before each forward that steers there (`SteerRows.fill`) and
zeroes them after, so a step that does not steer adds zeros.

Served this way: a residual-width value (`[tokens, hidden]` rows, or vLLM's two stream halves,
whose sum the `Add` reaches through the first) that is whole on every rank, and programs with at
most one filtered `Add` per location (several unfiltered ones are summed into one vector). Any
other op at a tap is served by the tap's Python, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm_envoys import Value
from vllm_envoys.codecs import Rows, Stream
from vllm_envoys.layouts import RESIDUAL

from vllm_runner.ops import Add, Op
from vllm_runner.serving import Want


def steerable(value: Value) -> bool:
    """Whether an `Add` at `value` can run inside the compiled model: residual-width rows read
    as they sit (`Rows`, writable, not batched) or the stream's halves (`Stream`)."""
    codec = value.eproperty.codec
    if value.eproperty.layout != RESIDUAL:
        return False
    if type(codec) is Rows:
        return codec.writable and not codec.batched
    return type(codec) is Stream


def _in_graph_vector(op: Add, width: int) -> bool:
    """Whether an `Add`'s vector is one row of the value (`[hidden]`, any leading 1s)."""
    shape = [size for size in op.vector.shape if size != 1] or [1]
    return shape == [width] or (op.vector.numel() == 1)


def in_graph_ops(ops: Iterable[Op], width: int) -> bool:
    """Whether a program's `ops` at one location can all run inside the compiled model: `Add`s
    with one vector per row, and no more than one of them if any keeps only some positions (a
    row gets one vector: unfiltered ones are summed)."""
    adds = list(ops)
    if not all(isinstance(op, Add) and _in_graph_vector(op, width) for op in adds):
        return False
    filtered = [op for op in adds if isinstance(op, Add) and op.keeps(1) is not None]
    return not filtered or len(adds) == 1


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
        self._site, self._stream = value.eproperty.site, type(value.eproperty.codec) is Stream
        self._names = tuple(f"interp_steer_{name}_{part}" for part in ("table", "index", "scale"))
        for part, tensor in zip(self._names, (
                torch.zeros(slots, width, device=device, dtype=dtype),
                torch.zeros(rows, device=device, dtype=torch.long),
                torch.zeros(rows, device=device, dtype=dtype)), strict=True):
            module.register_buffer(part, tensor, persistent=False)
        self.table, self.index, self.scale = (getattr(module, part) for part in self._names)
        self.dirty = False

    def apply(self, module: nn.Module, raw: Any) -> None:
        """Add each row's vector in place (traced into the compiled graph: no Python at run
        time). The buffers are read through `module`, so the compiler takes them as inputs."""
        table, index, scale = (getattr(module, part) for part in self._names)
        piece = self._site.get(raw, module)
        if self._stream and not isinstance(piece, torch.Tensor):
            piece = piece[0]  # the hidden half: the stream is its sum with the residual
        rows = piece.shape[0]
        piece.add_(table.index_select(0, index[:rows]) * scale[:rows, None])

    def fill(self, steered: list[SteeredRows]) -> None:
        """Write this step's vectors, row indices and scales (zeros on every other row)."""
        if len(steered) > self.table.shape[0]:
            raise ValueError(f"{self.location}: {len(steered)} steered requests in one step, "
                             f"more than the {self.table.shape[0]} slots")
        index = torch.zeros(self.index.shape[0], dtype=torch.long)
        scale = torch.zeros(self.scale.shape[0], dtype=torch.float32)
        for slot, rows in enumerate(steered):
            index[rows.start:rows.stop] = slot
            if rows.keep is None:
                scale[rows.start:rows.stop] = 1.0
            else:
                scale[rows.start:rows.stop] = torch.tensor(
                    [float(rows.keep(rows.first_position + offset))
                     for offset in range(rows.stop - rows.start)])
        if steered:
            vectors = torch.stack([rows.vector.reshape(-1).expand(self.width)
                                   for rows in steered])
            self.table[:len(steered)].copy_(vectors.to(self.table.dtype))
        self.index.copy_(index)
        self.scale.copy_(scale.to(self.scale.dtype))
        self.dirty = True

    def clear(self) -> None:
        """No row steered (after a step that steered here)."""
        if self.dirty:
            self.scale.zero_()
            self.dirty = False


class InGraphSteering:
    """Makes the steering buffers of a model's steerable tapped values (`Runtime.install_taps`):
    on the model's device, in its dtype, one hidden state wide."""

    def __init__(self, model: nn.Module, hf_config: Any) -> None:
        weight = next((p for p in model.parameters() if p.is_floating_point()), None)
        self.device = weight.device if weight is not None else torch.device("cpu")
        self.dtype = weight.dtype if weight is not None else torch.get_default_dtype()
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.width: int | None = getattr(text, "hidden_size", None)

    def buffers(self, values: list[Value], rows: int, slots: int) -> dict[str, SteerRows]:
        """A `SteerRows` for each of `values` an `Add` can reach in the graph (`steerable`)."""
        if self.width is None:
            return {}
        return {value.location: SteerRows(value, self.width, rows, slots, str(number),
                                          self.device, self.dtype)
                for number, value in enumerate(values) if steerable(value)}


def steered_rows(value: Value, groups: Iterable[Iterable[Want]],
                 failed: Callable[[str], bool]) -> list[SteeredRows]:
    """Each waiting request's rows and vector at `value` this step: its `Add`s there summed
    (`scale * vector`, in float32), skipping requests whose program failed and steps the value
    is not served at (as the taps' Python would)."""
    found: dict[str, SteeredRows] = {}
    for want in (want for members in groups for want in members):
        op = want.op
        if not isinstance(op, Add) or failed(want.program_id) or value.reason(want.step):
            continue
        vector = op.vector.detach().to("cpu", torch.float32).reshape(-1) * float(op.scale)
        earlier = found.get(want.request_id)
        if earlier is not None:  # unfiltered `Add`s only (`in_graph_ops`): one sum
            vector = earlier.vector + vector
        span = want.span
        found[want.request_id] = SteeredRows(span.start, span.stop, span.first_position,
                                             vector, op.keeps(want.step.prompt_length))
    return list(found.values())
