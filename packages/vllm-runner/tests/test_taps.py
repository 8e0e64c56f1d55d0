"""The tap op without an engine: raw values through the op's flat tensor list and back, and a
toy model compiled by torch (`fullgraph=True`: no graph break is allowed) whose taps serve what
the server holds when the compiled forward runs, not when it was traced, and whose in-place
edits reach the rest of the compiled forward. The oracle is the same module run eagerly."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from vllm_envoys import HookArgs
from vllm_runner.client.llm import tap_patterns
from vllm_runner.compiled.opaque_calls import called_inside_opaque_ops, opaque_reason
from vllm_runner.compiled.taps import flatten, install_taps, rebuild, serve_taps
from vllm_runner.errors import LocationError, TapsRefused
from vllm_runner.runtime.hooks import Hooks
from vllm_runner.runtime.runtime import tap_locations

leaves = st.one_of(
    st.integers(1, 4).map(lambda n: torch.arange(float(n))),
    st.none(),
)
raw_values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(tuple),
        st.lists(inner, max_size=3),
        st.builds(lambda args, kwargs: HookArgs(tuple(args), kwargs),
                  st.lists(inner, max_size=3),
                  st.dictionaries(st.sampled_from(["hidden_states", "residual", "x"]), inner,
                                  max_size=2))),
    max_leaves=8)


def same(one: Any, other: Any) -> bool:
    if isinstance(one, torch.Tensor):
        return isinstance(other, torch.Tensor) and one is other
    if isinstance(one, HookArgs):
        return isinstance(other, HookArgs) and same(one.args, other.args) and \
            one.kwargs.keys() == other.kwargs.keys() and \
            all(same(one.kwargs[k], other.kwargs[k]) for k in one.kwargs)
    if isinstance(one, (tuple, list)):
        return type(one) is type(other) and len(one) == len(other) and \
            all(same(a, b) for a, b in zip(one, other, strict=True))
    return one is None and other is None


@settings(max_examples=200, deadline=None)
@given(raw_values)
def test_a_raw_value_comes_back_from_its_tensors_and_structure(raw: Any) -> None:
    tensors, structure = flatten(raw)
    assert same(rebuild(structure, tensors), raw)


def test_what_is_not_a_tensor_comes_back_as_none() -> None:
    tensors, structure = flatten((torch.ones(2), 7, "text"))
    assert structure == "(T,O,O,)"
    assert rebuild(structure, tensors)[1:] == (None, None)


@dataclass
class Tapped:
    """What `install_tap` needs of a value: where it is and which side of its module."""

    module: nn.Module
    location: str
    side: str


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


class Server:
    """Adds `shift` to every tapped value and keeps what it saw (a copy)."""

    def __init__(self) -> None:
        self.shift = 0.0
        self.seen: list[tuple[str, Any]] = []

    def wants_tap(self, location: str) -> bool:
        return True

    def serve_tap(self, location: str, raw: Any) -> None:
        tensor = raw if isinstance(raw, torch.Tensor) else raw.args[0]
        self.seen.append((location, tensor.clone()))
        tensor.add_(self.shift)


# inductor once (the engine's compiled tests run it on every kind of tap): it compiles slowly.
@pytest.mark.parametrize(("side", "backend"),
                         [("output", "aot_eager"), ("input", "aot_eager"), ("input", "inductor")])
def test_a_compiled_tap_serves_at_run_time_and_its_edits_reach_the_rest(side: str,
                                                                        backend: str) -> None:
    torch.manual_seed(0)
    toy = Toy()
    server = Server()
    # The output of `first`, or the input of `second` (after the relu): both edited in place.
    module = toy.first if side == "output" else toy.second
    (handle,) = install_taps([Tapped(module, "place", side)])  # type: ignore[list-item]
    compiled = torch.compile(toy, backend=backend, fullgraph=True, dynamic=True)
    x = torch.randn(3, 4)
    with torch.no_grad():
        compiled(x)  # traced now; nobody serves the taps outside a forward of an engine
        assert server.seen == []
        serve_taps(server)
        plain = compiled(x)
        server.shift = 2.0  # read when the op runs, never frozen at trace time
        shifted = compiled(x)
        serve_taps(None)
        handle.remove()
        hidden = toy.first(x)
        expected = toy.second((hidden if side == "input" else hidden + 2.0).relu()
                              + (2.0 if side == "input" else 0.0))
    torch.testing.assert_close(shifted, expected)
    assert not torch.equal(plain, shifted)
    assert [location for location, _ in server.seen] == ["place", "place"]
    torch.testing.assert_close(server.seen[1][1], server.seen[0][1])  # what it saw, unedited


def test_an_ordinary_hook_that_a_compiler_traces_fails_loudly() -> None:
    # Only taps may run inside a compiled model: a hook traced there would be frozen into
    # every later forward, so the trace stops with the hook's location named.
    toy = Toy()
    seen: list[str] = []
    hooks = Hooks({"place": Tapped(toy.first, "place", "output")},  # type: ignore[dict-item]
                  lambda location, value, raw: seen.append(location))
    hooks.sync(["place"])
    toy(torch.randn(2, 4))  # eager: served
    assert seen == ["place"]
    compiled = torch.compile(toy, backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="the hook at place ran while the model was being "
                                           "compiled"):
        compiled(torch.randn(2, 4))


def tap_plan(worker: Any, patterns: list[str]) -> tuple[list[str], dict[str, str]]:
    runtime = worker.model_runner.interp
    return tap_locations(patterns, runtime.resolve, runtime.support())


def test_tap_patterns_resolve_on_the_model_and_bad_ones_are_refused_by_name(llm) -> None:
    patterns = ["layers.*.layer_output", "layers.1.mlp_neurons", "layers.0.layer_output",
                "layers.7.layer_output", "layers.0.mlp_activation", "logits", "layers.0.nonsense"]
    (locations, refused), *_ = llm.collective_rpc(tap_plan, args=(patterns,))
    assert locations == ["layers.0.layer_output", "layers.1.layer_output",
                         "layers.2.layer_output", "layers.1.mlp.mlp_neurons"]  # once each
    assert list(refused) == ["layers.7.layer_output", "layers.0.mlp_activation", "logits",
                             "layers.0.nonsense"]
    assert "gated" in refused["layers.0.mlp_activation"]  # the value's own reason
    assert "needs no tap" in refused["logits"]
    assert "layers.0.nonsense" in refused["layers.0.nonsense"]  # the resolver's own message
    assert "layers.7" in refused["layers.7.layer_output"]


@pytest.mark.parametrize("taps", [["layers.0.layer_output", 3], [""], 5])
def test_taps_that_are_not_patterns_are_refused_before_an_engine_starts(taps: Any) -> None:
    with pytest.raises(ValueError, match="taps="):
        tap_patterns(taps)
    assert tap_patterns("layers.0.layer_output") == ["layers.0.layer_output"]


def test_values_at_one_module_side_share_one_op_served_in_order() -> None:
    # Two ops declaring they mutate the same tensors one after the other corrupt strided
    # views under the compiler (NaN logits, seen with keys and values of one attention layer):
    # every tapped value at one module side is served by one op, in the order given.
    toy = Toy()
    server = Server()
    handles = install_taps([Tapped(toy.first, "a", "output"), Tapped(toy.second, "c", "input"),
                            Tapped(toy.first, "b", "output")])  # type: ignore[list-item]
    assert len(handles) == 2
    serve_taps(server)
    try:
        with torch.no_grad():
            toy(torch.randn(2, 4))
    finally:
        serve_taps(None)
        for handle in handles:
            handle.remove()
    assert [location for location, _ in server.seen] == ["a", "b", "c"]


class FusedMoERunner(nn.Module):
    """Shaped like vLLM's MoE runner: it holds the router gate and enters `_forward_entry`."""

    def __init__(self, entry: Any) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 2)
        self.routed = nn.Linear(4, 4)
        self.routed_output_transform = nn.Sequential(nn.Linear(4, 4))  # called outside the op
        self._forward_entry = entry


def test_modules_called_inside_an_opaque_custom_op_are_found_and_their_taps_refused() -> None:
    """On a GPU vLLM's MoE runner applies its gate inside `torch.ops.vllm.moe_forward`, which
    Dynamo does not trace: a tap at the gate would be captured into a CUDA graph and never run
    again. On the CPU the runner calls the op's Python, which Dynamo traces: taps work there."""
    opaque = FusedMoERunner(torch.ops.vllm_interp.tap)
    traced = FusedMoERunner(lambda *args: None)
    model = nn.ModuleDict({"opaque": opaque, "traced": traced})
    found = called_inside_opaque_ops(model)
    # Not the runner (it enters the op), nor what it calls before or after the op.
    assert set(found) == {id(opaque.gate), id(opaque.routed)}
    assert found[id(opaque.gate)] == "vllm_interp.tap"
    values = {"opaque.router_logits": opaque.gate, "traced.router_logits": traced.gate}

    def untappable(location: str) -> str | None:
        name = found.get(id(values[location]))
        return None if name is None else opaque_reason(location, name)

    locations, refused = tap_locations(["*.router_logits"], lambda pattern: list(values),
                                       dict.fromkeys(values), untappable)
    assert locations == ["traced.router_logits"]
    assert "opaque.router_logits is computed inside vLLM's opaque custom op vllm_interp.tap" \
        in refused["*.router_logits"]


def test_refused_taps_cross_processes_with_their_reasons() -> None:
    refused = TapsRefused("tap 'x': why", {"x": "why"})
    again = pickle.loads(pickle.dumps(refused))
    assert isinstance(again, LocationError) and again.refused == {"x": "why"}
    assert str(again) == "tap 'x': why"
