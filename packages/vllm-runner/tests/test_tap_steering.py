"""Steering from buffers inside a compiled graph (`tap_steering`, issue [K] tier 3), engine-free:
a toy compiled with `fullgraph=True` whose tap adds each row's vector from buffers filled after
compilation (so the compiler cannot have folded them), against the same toy run eagerly with
the rows added by hand. The engine's own cases are in test_compiled.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from vllm_envoys.codecs import Heads, Rows, Stream
from vllm_envoys.layouts import QUERIES, RESIDUAL
from vllm_envoys.sites import Output
from vllm_runner import ops
from vllm_runner.tap_steering import SteeredRows, SteerRows, in_graph_ops, steerable
from vllm_runner.taps import install_taps

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


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def steered_toy(backend: str | None) -> tuple[Toy, SteerRows, Any]:
    torch.manual_seed(0)
    toy = Toy()
    value: Any = Tapped(toy.first, "first.out", Declared(Output(), Rows()))
    steer = SteerRows(value, WIDTH, ROWS, SLOTS, "0", torch.device("cpu"), torch.float32)
    install_taps([value], {value.location: steer})
    run = toy if backend is None else torch.compile(toy, backend=backend, fullgraph=True)
    return toy, steer, run


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_rows_get_their_own_vectors_in_a_compiled_graph_filled_after_compiling(
        backend: str) -> None:
    toy, steer, run = steered_toy(backend)
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
    steer.clear()
    assert torch.allclose(run(x), plain, atol=1e-6)


def test_the_stream_is_steered_through_its_hidden_half() -> None:
    module = nn.Identity()
    value: Any = Tapped(module, "layers.0.layer_output", Declared(Output(0, 1), Stream()))
    steer = SteerRows(value, WIDTH, ROWS, SLOTS, "0", torch.device("cpu"), torch.float32)
    hidden, residual = torch.zeros(2, WIDTH), torch.ones(2, WIDTH)
    vector = torch.arange(WIDTH, dtype=torch.float32)
    steer.fill([SteeredRows(1, 2, 5, vector, None)])
    steer.apply(module, (hidden, residual))
    assert torch.equal(hidden + residual, torch.stack([torch.ones(WIDTH), 1 + vector]))


def test_what_the_graph_serves_and_what_it_leaves_to_the_taps_python() -> None:
    rows: Any = Tapped(nn.Identity(), "x", Declared(Output(), Rows()))
    heads: Any = Tapped(nn.Identity(), "q", Declared(Output(), Heads(lambda m: 2, True), QUERIES))
    read_only: Any = Tapped(nn.Identity(), "r", Declared(Output(), Rows(writable=False)))
    assert steerable(rows) and not steerable(heads) and not steerable(read_only)
    vector = torch.ones(WIDTH)
    assert in_graph_ops([ops.Add("x", vector), ops.Add("x", vector, scale=2.0)], WIDTH)
    assert in_graph_ops([ops.Add("x", vector.reshape(1, 1, WIDTH), positions=(0,))], WIDTH)
    assert not in_graph_ops([ops.Add("x", vector, positions=(0,)), ops.Add("x", vector)],
                            WIDTH)  # one vector per row: a filtered Add cannot be summed
    assert not in_graph_ops([ops.Add("x", torch.ones(3, WIDTH))], WIDTH)  # per token
    assert not in_graph_ops([ops.Add("x", vector), ops.Save("x")], WIDTH)
    assert not in_graph_ops([ops.Scale("x", 2.0)], WIDTH)


def test_more_steered_requests_than_slots_is_refused_before_anything_is_written() -> None:
    _, steer, _ = steered_toy(None)
    with pytest.raises(ValueError, match="more than the 3 slots"):
        steer.fill([SteeredRows(i, i + 1, 0, torch.ones(WIDTH), None) for i in range(4)])
    assert not steer.scale.any()
