"""Which work at a tap runs inside the compiled graph, from buffers, with no Python (tier 3).

A tap's op runs Python at every forward (`taps`): on a GPU the piecewise graphs split around it,
and a step whose programs need it cannot replay a full CUDA graph. `ProjectOut`, `Add` and
`Save` need none: at a tap of a residual-width value (`[tokens, hidden]` rows, or vLLM's two
stream halves) that is whole on every rank, the tap's hook first takes from each row its
component along the row's ablated direction, then adds the row's steering vector, both from
buffers (`tap_edits`), then copies the value into a ring buffer (`tap_saves`); the runtime
fills the first two before the forward and reads the last after it. A location is served this
way on a step when every program waiting there has only such ops there and in that order (at
most one `ProjectOut`, then its `Add`s, then its `Save`s: the copy follows the edits), and at
most one `Add` if any names `positions` or `steps` (a row gets one vector). Anything else at
that location on that step is served by the tap's Python, all of it, in program order, as
before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm_envoys import Value
from vllm_envoys.codecs import Rows, Stream
from vllm_envoys.layouts import RESIDUAL

from vllm_runner.compiled.tap_edits import AblateRows, RowTable, SteerRows
from vllm_runner.compiled.tap_saves import SaveRing
from vllm_runner.ops import Add, Op, ProjectOut
from vllm_runner.ops.graph_ops import GraphOps
from vllm_runner.saves.arena import SaveArena


def in_graph_value(value: Value) -> bool:
    """Whether `ProjectOut`, `Add` and `Save` at `value` can run inside the graph:
    residual-width rows read as they sit (`Rows`, writable, not batched) or the stream's halves
    (`Stream`)."""
    codec = value.eproperty.codec
    if value.eproperty.layout != RESIDUAL:
        return False
    if type(codec) is Rows:
        return codec.writable and not codec.batched
    return type(codec) is Stream


def _one_row(vector: torch.Tensor, width: int) -> bool:
    """Whether a vector is one row of the value (`[hidden]`, any leading 1s)."""
    shape = [size for size in vector.shape if size != 1]
    return not shape or shape == [width]


def in_graph_ops(ops: Iterable[Op], width: int) -> GraphOps | None:
    """A program's `ops` at one location (in program order) split as the graph runs them, if
    they can all run inside it (at most one `ProjectOut`, then `Add`s, then `Save`s, every
    vector one row's, and no more than one `Add` if any keeps only some positions); else
    `None`."""
    ops = list(ops)
    if any(getattr(op, "tokens", None) is not None for op in ops):
        return None  # a token filter needs the step's token ids: the module tree
    split = GraphOps.of(ops)
    if split is None:
        return None  # another op, or these in another order (a `Save` before an `Add`)
    ablations, adds = split.ablations, split.adds
    if len(ablations) > 1 or not all(tuple(op.direction.shape) == (width,) for op in ablations):
        return None  # one `[hidden]` direction a row (as the tap's Python takes it): two in
        # turn are not one projection
    if not all(_one_row(op.vector, width) for op in adds):
        return None
    if len(adds) > 1 and any(op.position_filter(1) is not None for op in adds):
        return None
    return split


class InGraphRows:
    """The in-graph work of one tapped value: ablation, steering, then the copy for saves."""

    def __init__(self, value: Value, ablate: AblateRows, steer: SteerRows,
                 saves: SaveRing) -> None:
        site = value.eproperty.site
        if site is None:  # `in_graph_value` admits only values read at a site
            raise ValueError(f"{value.location} has no site to serve it in the graph")
        self._site, self._stream = site, type(value.eproperty.codec) is Stream
        self.ablate = ablate
        self.steer = steer
        self.saves = saves
        self.width = steer.width

    def edit_tables(self) -> tuple[tuple[RowTable, str], ...]:
        """Each table the runtime fills before a forward, with the kind of op (`Op.kind`) whose
        vectors it holds."""
        return (self.ablate, ProjectOut.kind), (self.steer, Add.kind)

    def clear(self) -> None:
        """No row gets a direction or a vector (after a step that filled them, or failed to)."""
        for table, _ in self.edit_tables():
            table.clear()

    def apply(self, module: nn.Module, raw: Any) -> None:
        """What the tap's hook runs before its op (traced into the graph). vLLM's two stream
        halves are ablated and steered through the first (the stream is their sum) and saved as
        their sum, as the value is read everywhere else."""
        hidden = self._site.get(raw, module)
        residual = None
        if self._stream and not isinstance(hidden, torch.Tensor):
            hidden, residual = hidden
        self.ablate.apply(module, hidden, hidden if residual is None else hidden + residual)
        self.steer.apply(module, hidden)
        self.saves.apply(module, hidden if residual is None else hidden + residual)


class InGraphBuffers:
    """Makes the buffers of a model's tapped values (`Runtime.install_taps`): on the model's
    device, in its dtype, one hidden state wide."""

    def __init__(self, model: nn.Module, hf_config: Any) -> None:
        weight = next((p for p in model.parameters() if p.is_floating_point()), None)
        self.device = weight.device if weight is not None else torch.device("cpu")
        self.dtype = weight.dtype if weight is not None else torch.get_default_dtype()
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.width: int | None = getattr(text, "hidden_size", None)

    def buffers(self, values: list[Value], rows: int, slots: int) -> dict[str, InGraphRows]:
        """An `InGraphRows` for each of `values` the graph can serve (`in_graph_value`), for
        `rows` rows a forward (the most one runs) and `slots` steered requests a step."""
        width = self.width
        if width is None:
            return {}
        arena = SaveArena(width, rows, self.device, self.dtype)  # shared: `saves.arena`
        tables = (width, rows, slots)
        return {value.location: InGraphRows(
            value, AblateRows(value, *tables, str(number), self.device, self.dtype),
            SteerRows(value, *tables, str(number), self.device, self.dtype),
            SaveRing(value, width, rows, str(number), arena))
            for number, value in enumerate(values) if in_graph_value(value)}

    def bytes_per_value(self, rows: int, slots: int) -> int:
        """What one value's buffers hold, in bytes: the ring and the two vector tables (each
        with its zero slot) dominate; each table's row index is 8 bytes a row."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return (self.width or 0) * (rows + 2 * (slots + 1)) * size + 2 * rows * 8
