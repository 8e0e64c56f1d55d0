"""Ablation, steering and saves from buffers inside a compiled graph (`in_graph`, issue [K] tier
3), engine-free: a toy compiled with `fullgraph=True` whose tap takes from each row its
component along the row's direction and adds the row's vector, from buffers filled after
compilation (so the compiler cannot have folded them), and copies the edited rows into its ring,
against the same toy computed by hand (and `ProjectOut`'s own edit). The engine's cases are in
test_compiled.py and test_preemption.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from tokenspan import Span
from torch import nn
from vllm_envoys import Step
from vllm_envoys.codecs import Heads, Rows, Stream
from vllm_envoys.layouts import QUERIES, RESIDUAL
from vllm_envoys.sites import Output
from vllm_runner import ops
from vllm_runner.compiled.in_graph import InGraphRows, in_graph_ops, in_graph_value
from vllm_runner.compiled.tap_edits import AblateRows, SteeredRows, SteerRows
from vllm_runner.compiled.tap_saves import SaveRing
from vllm_runner.compiled.taps import install_taps
from vllm_runner.ops.wants import Want
from vllm_runner.saves.arena import SaveArena
from vllm_runner.saves.store import SaveStore, ToCollect

WIDTH, ROWS, SLOTS = 4, 16, 3


@dataclass
class Declared:
    """What a value declares: its site, codec and layout."""

    site: Any
    codec: Any
    layout: tuple[str, ...] = RESIDUAL


@dataclass
class Tapped:
    """The parts of an envoys `Value` the steering and the tap's hook use."""

    module: nn.Module
    location: str
    eproperty: Declared
    side: str = "output"

    def reason(self, step: Step | None = None) -> None:
        return None


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def steered_toy(backend: str | None) -> tuple[Toy, InGraphRows, Any]:
    torch.manual_seed(0)
    toy = Toy()
    value: Any = Tapped(toy.first, "first.out", Declared(Output(), Rows()))
    rows = in_graph_rows(value)
    install_taps([value], {value.location: rows})
    run = toy if backend is None else torch.compile(toy, backend=backend, fullgraph=True)
    return toy, rows, run


def in_graph_rows(value: Any) -> InGraphRows:
    cpu = torch.device("cpu")
    tables = (value, WIDTH, ROWS, SLOTS, "0", cpu, torch.float32)
    return InGraphRows(value, AblateRows(*tables), SteerRows(*tables),
                       SaveRing(value, WIDTH, ROWS, "0",
                                SaveArena(WIDTH, ROWS, cpu, torch.float32)))


def want(request: str, span: Span, op: ops.Op) -> Want:
    return Want(request, f"program {request}", span, Step(span.first_position, len(span), 5),
                op)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_rows_get_their_own_vectors_in_a_compiled_graph_filled_after_compiling(
        backend: str) -> None:
    toy, in_graph, run = steered_toy(backend)
    steer = in_graph.steer
    x = torch.randn(7, WIDTH)
    first = torch.nn.functional.linear(x, toy.first.weight, toy.first.bias).detach()  # no hook
    plain = run(x)  # compiled here, with the buffers all zero
    assert torch.allclose(plain, toy.second(torch.relu(first)), atol=1e-6)
    one, other = torch.randn(WIDTH), torch.randn(WIDTH)
    only_last = SteeredRows(4, 7, 10, other, keep=lambda position: position == 12)
    steer.fill([SteeredRows(0, 3, 0, one, None), only_last])
    expected = first.clone()
    expected[0:3] += one
    expected[6] += other  # rows 4..6 hold positions 10..12: only 12 is kept
    assert torch.allclose(run(x), toy.second(torch.relu(expected)), atol=1e-5)
    # The ring holds the steered rows of that forward; the saving requests take theirs.
    assert torch.allclose(in_graph.saves.ring[:7], expected, atol=1e-6)
    store = SaveStore()
    value: Any = Tapped(toy.first, "first.out", Declared(Output(), Rows()))
    in_graph.saves.take([[want("a", Span(0, 3, 0), ops.Save("first.out")),
                          want("b", Span(4, 7, 10), ops.Save("first.out"))],
                         [want("a", Span(0, 3, 0), ops.Add("first.out", one))]],
                        lambda program: False, value, store)
    steer.clear()
    assert torch.allclose(run(x), plain, atol=1e-6)
    every = {"first.out": None}
    saved = store.collect([ToCollect("program a", 3, every), ToCollect("program b", 13, every)])
    assert torch.equal(saved["program a"]["first.out"], expected[0:3].unsqueeze(0))
    assert torch.equal(saved["program b"]["first.out"], expected[4:7].unsqueeze(0))


def test_the_stream_is_steered_through_its_hidden_half() -> None:
    module = nn.Identity()
    value: Any = Tapped(module, "layers.0.layer_output", Declared(Output(0, 1), Stream()))
    rows = in_graph_rows(value)
    hidden, residual = torch.zeros(2, WIDTH), torch.ones(2, WIDTH)
    vector = torch.arange(WIDTH, dtype=torch.float32)
    rows.steer.fill([SteeredRows(1, 2, 5, vector, None)])
    rows.apply(module, (hidden, residual))
    assert torch.equal(hidden + residual, torch.stack([torch.ones(WIDTH), 1 + vector]))


def test_what_the_graph_serves_and_what_it_leaves_to_the_taps_python() -> None:
    rows: Any = Tapped(nn.Identity(), "x", Declared(Output(), Rows()))
    heads: Any = Tapped(nn.Identity(), "q", Declared(Output(), Heads(lambda m: 2, True), QUERIES))
    read_only: Any = Tapped(nn.Identity(), "r", Declared(Output(), Rows(writable=False)))
    assert in_graph_value(rows) and not in_graph_value(heads) and not in_graph_value(read_only)
    vector = torch.ones(WIDTH)
    assert in_graph_ops([ops.Add("x", vector), ops.Add("x", vector, scale=2.0)], WIDTH)
    assert in_graph_ops([ops.Add("x", vector.reshape(1, 1, WIDTH), positions=(0,))], WIDTH)
    assert not in_graph_ops([ops.Add("x", vector, positions=(0,)), ops.Add("x", vector)],
                            WIDTH)  # one vector per row: a filtered Add cannot be summed
    assert not in_graph_ops([ops.Add("x", torch.ones(3, WIDTH))], WIDTH)  # per token
    assert in_graph_ops([ops.Add("x", vector), ops.Save("x"), ops.Save("x", steps="decode")],
                        WIDTH)  # saves the steered value: the copy follows the steering
    assert not in_graph_ops([ops.Save("x"), ops.Add("x", vector)], WIDTH)
    assert not in_graph_ops([ops.Scale("x", 2.0)], WIDTH)
    # Ablation first (the graph's order: ablate, steer, save), one direction a row.
    assert in_graph_ops([ops.ProjectOut("x", vector), ops.Add("x", vector), ops.Save("x")],
                        WIDTH)
    assert in_graph_ops([ops.ProjectOut("x", vector, steps="decode")], WIDTH)
    assert not in_graph_ops([ops.Add("x", vector), ops.ProjectOut("x", vector)], WIDTH)
    assert not in_graph_ops([ops.Save("x"), ops.ProjectOut("x", vector)], WIDTH)
    assert not in_graph_ops([ops.ProjectOut("x", vector), ops.ProjectOut("x", -vector)], WIDTH)
    for shape in ((2, WIDTH), (1, WIDTH), (1,), ()):  # the tap's Python takes `[hidden]` only
        assert not in_graph_ops([ops.ProjectOut("x", torch.ones(shape))], WIDTH), shape


def test_more_steered_requests_than_slots_is_refused_before_anything_is_written() -> None:
    _, in_graph, _ = steered_toy(None)
    steer = in_graph.steer
    with pytest.raises(ValueError, match="4 steering vectors in one step, more than the 3 slots"):
        steer.fill([SteeredRows(i, i + 1, 0, torch.ones(WIDTH), None) for i in range(4)])
    assert not steer.index.any()


def test_a_vector_that_overflows_the_models_dtype_is_refused_before_anything_is_written() -> None:
    # float16 tops out at 65504: its inf would make 0 * inf = NaN on the other requests' rows.
    value: Any = Tapped(nn.Identity(), "x", Declared(Output(), Rows()))
    steer = SteerRows(value, WIDTH, ROWS, SLOTS, "0", torch.device("cpu"), torch.float16)
    with pytest.raises(ValueError, match=r"not finite in torch\.float16"):
        steer.fill([SteeredRows(0, 2, 0, torch.ones(WIDTH), None),
                    SteeredRows(2, 3, 0, torch.full((WIDTH,), 1e5), None)])
    assert not steer.index.any() and not steer.table.any()


def test_the_stream_is_saved_as_the_sum_of_its_halves() -> None:
    module = nn.Identity()
    value: Any = Tapped(module, "layers.0.layer_output", Declared(Output(0, 1), Stream()))
    rows = in_graph_rows(value)
    hidden, residual = torch.randn(2, WIDTH), torch.randn(2, WIDTH)
    rows.apply(module, (hidden, residual))  # nothing steered: the halves as they came
    assert torch.equal(rows.saves.ring[:2], hidden + residual)


def test_requests_of_one_program_share_a_slot_and_a_new_set_of_vectors_replaces_the_last() -> None:
    """One vector per program (not per request) in the table, rewritten only when the step's
    vectors change: a step whose single vector differs from the last step's single vector must
    still get its own."""
    toy, in_graph, run = steered_toy("aot_eager")
    steer = in_graph.steer
    x = torch.randn(7, WIDTH)
    first = torch.nn.functional.linear(x, toy.first.weight, toy.first.bias).detach()
    cache = steer.vectors
    add_one, add_other = ops.Add("first.out", torch.randn(WIDTH), scale=0.5), \
        ops.Add("first.out", torch.randn(WIDTH))
    one = cache.vector((add_one,))
    assert cache.vector((add_one,)) is one  # computed once per program
    assert torch.equal(cache.vector((add_one, add_other)),
                       0.5 * add_one.vector + add_other.vector)
    for vector in (one, cache.vector((add_other,))):
        steer.fill([SteeredRows(0, 2, 0, vector, None), SteeredRows(3, 5, 0, vector, None)])
        assert int(steer.index.max()) == 1  # both requests in slot 1
        expected = first.clone()
        expected[0:2] += vector
        expected[3:5] += vector
        assert torch.allclose(run(x), toy.second(torch.relu(expected)), atol=1e-5)
        steer.clear()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_rows_lose_their_own_direction_in_a_compiled_graph_as_project_out_edits_them(
        backend: str) -> None:
    """Two requests ablating two directions (one at its last position only) and steered after
    it, a third untouched: each row as `ProjectOut.edited` then `Add` make it, by hand."""
    toy, in_graph, run = steered_toy(backend)
    x = torch.randn(7, WIDTH)
    first = torch.nn.functional.linear(x, toy.first.weight, toy.first.bias).detach()
    plain = run(x)  # compiled here, with the buffers all zero
    one = ops.ProjectOut("first.out", torch.randn(WIDTH))
    other = ops.ProjectOut("first.out", torch.randn(WIDTH), positions=(-1,))
    vector = torch.randn(WIDTH)
    cache = in_graph.ablate.vectors
    last_only = other.position_filter(13)
    in_graph.ablate.fill([SteeredRows(0, 3, 0, cache.vector((one,)), None),
                          SteeredRows(4, 7, 10, cache.vector((other,)), last_only)])
    in_graph.steer.fill([SteeredRows(0, 3, 0, vector, None)])
    expected = first.clone()
    expected[0:3] = one.edited(first[0:3], ("tokens", "hidden")) + vector
    expected[6] = other.edited(first[6:7], ("tokens", "hidden"))[0]  # position 12: the last
    assert torch.allclose(run(x), toy.second(torch.relu(expected)), atol=1e-5)
    assert torch.allclose(in_graph.saves.ring[:7], expected, atol=1e-5)
    unit = one.direction / one.direction.norm()
    assert torch.allclose(in_graph.saves.ring[0:3] @ unit, vector @ unit, atol=1e-5)
    in_graph.ablate.clear()
    in_graph.steer.clear()
    assert torch.allclose(run(x), plain, atol=1e-6)


def test_the_stream_is_ablated_through_its_hidden_half() -> None:
    """The direction comes off the stream (the halves' sum), taken from the hidden half."""
    module = nn.Identity()
    value: Any = Tapped(module, "layers.0.layer_output", Declared(Output(0, 1), Stream()))
    rows = in_graph_rows(value)
    hidden, residual = torch.randn(2, WIDTH), torch.randn(2, WIDTH)
    stream = hidden + residual
    ablation = ops.ProjectOut("layers.0.layer_output", torch.randn(WIDTH))
    rows.ablate.fill([SteeredRows(1, 2, 5, rows.ablate.vectors.vector((ablation,)), None)])
    rows.apply(module, (hidden, residual))
    assert torch.equal(hidden[0] + residual[0], stream[0])
    assert torch.allclose(hidden[1] + residual[1],
                          ablation.edited(stream[1:2], ("tokens", "hidden"))[0], atol=1e-6)
    assert torch.allclose(rows.saves.ring[1], hidden[1] + residual[1])


def test_a_row_nobody_ablates_keeps_what_it_holds_even_infinities() -> None:
    """Slot 0 leaves a row as it was: `inf * 0` would have made the whole row NaN."""
    module = nn.Identity()
    value: Any = Tapped(module, "x", Declared(Output(), Rows()))
    rows = in_graph_rows(value)
    hidden = torch.randn(3, WIDTH)
    hidden[0, 1] = float("inf")
    before = hidden.clone()
    ablation = ops.ProjectOut("x", torch.randn(WIDTH))
    rows.ablate.fill([SteeredRows(2, 3, 0, rows.ablate.vectors.vector((ablation,)), None)])
    rows.apply(module, hidden)
    assert torch.equal(hidden[:2], before[:2])
    assert torch.allclose(hidden[2], ablation.edited(before[2:3], ("tokens", "hidden"))[0],
                          atol=1e-6)


def test_a_save_with_positions_takes_only_its_rows_from_the_ring() -> None:
    """A request saving its prompt's last token (`positions=(-1,)`, prompt length 5) keeps one
    row of its chunk in the arena, one saving positions -1 and -3 the rows from the one to the
    other, one saving everything its whole chunk; each collects what the ring held there. One
    whose position is never reached gets its name back with no rows."""
    module = nn.Identity()
    value: Any = Tapped(module, "first.out", Declared(Output(), Rows()))
    rows = in_graph_rows(value)
    ring = torch.arange(10 * WIDTH, dtype=torch.float32).reshape(10, WIDTH)
    rows.apply(module, ring)
    arena = rows.saves.arena
    reserved = []
    reserve = arena.reserve
    arena.reserve = lambda count: reserved.append(count) or reserve(count)  # type: ignore[method-assign]
    store = SaveStore()
    last = ops.Save("first.out", positions=(-1,))
    two = ops.Save("first.out", positions=(-1, -3))
    every = ops.Save("first.out")
    never = ops.Save("first.out", positions=(40,))
    rows.saves.take([[want("a", Span(0, 4, 1), last)], [want("b", Span(4, 7, 2), two)],
                     [want("c", Span(7, 10, 0), every)], [want("d", Span(7, 10, 0), never)]],
                    lambda program: False, value, store)
    assert reserved == [1 + 3 + 3]
    saved = store.collect([ToCollect("program a", 5, {"first.out": last.position_filter(5)}),
                           ToCollect("program b", 5, {"first.out": two.position_filter(5)}),
                           ToCollect("program c", 3, {"first.out": None}),
                           ToCollect("program d", 3, {"first.out": never.position_filter(5)})])
    assert saved["program d"]["first.out"].shape == (1, 0, WIDTH)  # its name, no rows
    assert torch.equal(saved["program a"]["first.out"], ring[[3]].unsqueeze(0))  # position 4
    assert torch.equal(saved["program b"]["first.out"], ring[[4, 6]].unsqueeze(0))  # 2 and 4
    assert torch.equal(saved["program c"]["first.out"], ring[7:10].unsqueeze(0))
