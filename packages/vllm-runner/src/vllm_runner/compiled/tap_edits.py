"""Steering and ablation inside the compiled model: `Add` and `ProjectOut` at a tap from buffers
the runtime fills (tier 3; which ops and values are served this way: `in_graph`).

A tap's op runs Python at every forward (`taps`); on a GPU its piecewise graphs split around it,
and a step whose programs act there cannot replay a full CUDA graph. An `Add` needs no Python in
the forward: each row of the step gets `table[index[row]]`, where `table` holds this step's
distinct vectors from slot 1 on, slot 0 staying zero, and `index` the slot of each row (0 on
every other request, on padding and on positions a filtered `Add` skips). Both are buffers of
the tapped module, so the compiler sees them as the model's own inputs (never as constants it
could fold) and a CUDA graph reads them where they live; the runtime rewrites them before each
forward that steers there (`SteerRows.fill`) and points every row back at slot 0 after it, so a
step that does not steer adds zeros.

Filling must not make the host wait for the device: vLLM's V2 runner prepares a step while the
GPU still runs the last one, and a copy from ordinary host memory waits for the GPU to finish
everything queued first (three such copies a step halved throughput with every request
steered). So the host data crosses through pinned buffers with copies that do
not wait (`StagedCopies`), and requests running the same program share one vector, computed
once (`VectorCache`): the table is rewritten only when the step's set of vectors changes.

A row gets one vector: several unfiltered `Add`s of a request at one location are summed into
one (`steered_rows`). `ProjectOut` (directional ablation) works the same way from a table of its
own (`AblateRows`): each row's unit direction, slot 0 zero, and the row loses its component
along it (`x - (x·d̂) d̂`; nothing, at slot 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from vllm_envoys import Value

from vllm_runner.ops import Add, Op, ProjectOut
from vllm_runner.ops.wants import Want, passed_over


@dataclass(frozen=True)
class SteeredRows:
    """One request's rows of a step at a location and the vector they get (`scale * vector`
    summed over its `Add`s there, or its `ProjectOut`'s unit direction), with `keep(position)`
    for a filtered op. Requests that run the same program share one `vector` object
    (`VectorCache`)."""

    start: int
    stop: int
    first_position: int
    vector: torch.Tensor
    keep: Callable[[int], bool] | None


class StagedCopies:
    """Host-to-device copies that do not make the host wait: each goes through a pinned buffer
    (one of `BUFFERS`, taken in turn), reused only once the copy that last read it has run."""

    BUFFERS = 4  # a step makes one or two copies; the host runs at most a step or two ahead

    def __init__(self, device: torch.device) -> None:
        self._asynchronous = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * self.BUFFERS
        self._done: list[torch.cuda.Event | None] = [None] * self.BUFFERS
        self._turn = 0

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """`destination.copy_(source)` (`source` on the host), queued on the current stream."""
        if not self._asynchronous:
            destination.copy_(source)
            return
        turn, self._turn = self._turn, (self._turn + 1) % self.BUFFERS
        done = self._done[turn]
        if done is not None:
            done.synchronize()  # long done, unless the host is two steps ahead of the device
        buffer = self._buffers[turn]
        size = source.numel() * source.element_size()
        if buffer is None or buffer.numel() < size:
            buffer = self._buffers[turn] = torch.empty(max(size, 1 << 16), dtype=torch.uint8,
                                                       pin_memory=True)
        staged = buffer[:size].view(source.dtype).view(source.shape)
        staged.copy_(source)
        destination.copy_(staged, non_blocking=True)
        event = self._done[turn] = self._done[turn] or torch.cuda.Event()
        event.record()


class VectorCache:
    """Each program's vector at a location, computed from its ops there (`combine`: for `Add`s
    their `scale * vector` summed, `summed`; for a `ProjectOut` its unit direction,
    `unit_direction`), in float32 on the host, computed and checked once, then shared by every
    request running it."""

    LIMIT = 1024  # entries kept before the cache starts again (programs come and go)

    def __init__(self, combine: Callable[[tuple[Any, ...]], torch.Tensor] | None = None
                 ) -> None:
        self._combine = combine or summed
        self._vectors: dict[tuple[int, ...], tuple[tuple[Any, ...], torch.Tensor]] = {}

    def vector(self, ops: tuple[Any, ...]) -> torch.Tensor:
        """The vector of `ops` (the same object for the same ops)."""
        key = tuple(map(id, ops))
        found = self._vectors.get(key)
        if found is None:
            if len(self._vectors) >= self.LIMIT:
                self._vectors.clear()
            # The ops are kept with their vector: their ids stay theirs.
            found = self._vectors[key] = (ops, self._combine(ops))
        return found[1]


def summed(adds: tuple[Add, ...]) -> torch.Tensor:
    """`scale * vector` of each `Add`, summed (float32, flat)."""
    return sum((add.vector.detach().to("cpu", torch.float32).reshape(-1) * float(add.scale)
                for add in adds), torch.zeros(()))


def unit_direction(ablations: tuple[ProjectOut, ...]) -> torch.Tensor:
    """The unit direction of a `ProjectOut` (float32, flat; one per row: `in_graph_ops`)."""
    (ablation,) = ablations
    direction = ablation.direction.detach().to("cpu", torch.float32).reshape(-1)
    return direction / direction.norm()


class RowTable:
    """A table of vectors (slot 0 zero) and each row's slot, as buffers of a tapped module that
    the runtime fills before a forward and points back at slot 0 after it (`SteerRows`,
    `AblateRows`: what the tap's hook does with them)."""

    #: What the table's vectors are, for errors and buffer names.
    WHAT = "vectors"
    PREFIX = "interp_table"

    def __init__(self, value: Value, width: int, rows: int, slots: int, name: str,
                 device: torch.device, dtype: torch.dtype) -> None:
        """Buffers for `slots` vectors of `width` (and the zero slot) and `rows` rows (the most
        one forward runs), registered on the value's module as `<PREFIX>_<name>_*` (not
        saved with it)."""
        module = value.module
        self.location = value.location
        self.width = width
        self._names = tuple(f"{self.PREFIX}_{name}_{part}" for part in ("table", "index"))
        for part, tensor in zip(self._names, (
                torch.zeros(slots + 1, width, device=device, dtype=dtype),
                torch.zeros(rows, device=device, dtype=torch.long)), strict=True):
            module.register_buffer(part, tensor, persistent=False)
        self.table, self.index = (getattr(module, part) for part in self._names)
        self.vectors = self._cache()
        self._copies = StagedCopies(device)
        self._in_table: tuple[torch.Tensor, ...] = ()  # the vectors in slots 1.. now
        self.dirty = False

    def _cache(self) -> VectorCache:
        return VectorCache()

    def buffers_of(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The table and the row index, read through `module` in the traced forward, so the
        compiler takes them as the model's inputs."""
        table, index = (getattr(module, part) for part in self._names)
        return table, index

    def fill(self, steered: list[SteeredRows]) -> None:
        """Write this step's vectors and each row's slot, request by request (`write`)."""
        vectors = tuple({id(rows.vector): rows.vector for rows in steered}.values())
        slots = {id(vector): slot for slot, vector in enumerate(vectors, start=1)}
        index = np.zeros(max((rows.stop for rows in steered), default=0), dtype=np.int64)
        for rows in steered:
            slot = slots[id(rows.vector)]
            if rows.keep is None:
                index[rows.start:rows.stop] = slot
            else:
                index[rows.start:rows.stop] = [
                    slot if rows.keep(rows.first_position + offset) else 0
                    for offset in range(rows.stop - rows.start)]
        self.write(vectors, index)

    def write(self, vectors: tuple[torch.Tensor, ...], index: np.ndarray) -> None:
        """Put `vectors` in slots 1.. (only if they changed) and `index` (each row's slot, int64,
        up to the last row with a vector: past it every row points at the zero slot already,
        `clear` after every step that used the table) in the buffers."""
        if len(vectors) > self.table.shape[0] - 1:
            raise ValueError(f"{self.location}: {len(vectors)} {self.WHAT} in one step, "
                             f"more than the {self.table.shape[0] - 1} slots")
        if vectors and (len(vectors) != len(self._in_table) or any(
                new is not old for new, old in zip(vectors, self._in_table, strict=False))):
            table = torch.stack([vector.expand(self.width) for vector in vectors]).to(
                self.table.dtype)
            # A vector that overflows the model's dtype (float16) would put inf on its rows.
            if not bool(torch.isfinite(table).all()):
                raise ValueError(f"{self.location}: a vector of the {self.WHAT} is not finite "
                                 f"in {self.table.dtype}")
            self._copies.copy(self.table[1:1 + len(vectors)], table)
            self._in_table = vectors
        self.dirty = True  # from here on `clear` points the rows back at the zero slot
        self._copies.copy(self.index[:len(index)], torch.from_numpy(index))

    def clear(self) -> None:
        """No row gets a vector (after a step that used the table)."""
        if self.dirty:
            self.index.zero_()
            self.dirty = False


class SteerRows(RowTable):
    """The steering vectors of one tapped value (`Add`), and what the tap's hook does with them."""

    WHAT = "steering vectors"
    PREFIX = "interp_steer"

    def apply(self, module: nn.Module, rows: torch.Tensor) -> None:
        """Add each row's vector to `rows` (`[tokens, hidden]`) in place, traced into the
        compiled graph: no Python at run time."""
        table, index = self.buffers_of(module)
        rows.add_(table.index_select(0, index[:rows.shape[0]]))


class AblateRows(RowTable):
    """The ablated directions of one tapped value (`ProjectOut`: unit vectors), and what the
    tap's hook does with them."""

    WHAT = "ablated directions"
    PREFIX = "interp_ablate"

    def _cache(self) -> VectorCache:
        return VectorCache(unit_direction)

    def apply(self, module: nn.Module, rows: torch.Tensor, stream: torch.Tensor) -> None:
        """Take from `rows` (`[tokens, hidden]`, in place) the component of `stream` (the value
        the rows are part of: the rows themselves, or vLLM's two halves summed) along each
        row's direction, traced into the compiled graph; a row at slot 0 loses nothing, even
        one holding infinities (`inf * 0` is NaN: the component is zeroed there, not
        computed as zero)."""
        table, index = self.buffers_of(module)
        slots = index[:rows.shape[0]]
        directions = table.index_select(0, slots)
        component = (stream * directions).sum(-1, keepdim=True)
        rows.sub_(component.masked_fill(slots.unsqueeze(-1) == 0, 0) * directions)


def steered_rows(value: Value, groups: Iterable[Iterable[Want]],
                 failed: Callable[[str], bool], vectors: VectorCache,
                 kind: str = Add.kind) -> list[SteeredRows]:
    """Each waiting request's rows and vector at `value` this step from its ops of `kind`
    (`Op.kind`) there: its `Add`s summed (`scale * vector`, in float32, once per program:
    `vectors`), or its `ProjectOut`'s unit direction; skipping requests whose program failed
    and steps the value is not served at (as the taps' Python would)."""
    found: dict[str, tuple[Want, list[Op]]] = {}
    for want in (want for members in groups for want in members):
        op = want.op
        if op.kind != kind or passed_over(want, value, failed):
            continue
        earlier = found.get(want.request_id)
        if earlier is None:
            found[want.request_id] = (want, [op])
        else:  # unfiltered `Add`s only (`in_graph.in_graph_ops`): one sum
            earlier[1].append(op)
    steered = []
    for want, adds in found.values():
        span = want.span
        steered.append(SteeredRows(span.start, span.stop, span.first_position,
                                   vectors.vector(tuple(adds)),
                                   adds[0].position_filter(want.step.prompt_length)))
    return steered
