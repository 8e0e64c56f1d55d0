"""Interventions as JSON (`json_ops`): tensors in and out, ops from their JSON objects, and
each bad field refused as an `InterventionInputError` naming it; no engine."""

from __future__ import annotations

import base64
import dataclasses
import struct

import pytest
import torch
from vllm_runner import ops
from vllm_runner.server.json_ops import (
    InterventionInputError,
    ops_from_json,
    saves_to_json,
    tensor_from_json,
    tensor_to_json,
)

LOCATION = "layers.1.layer_output"


def no_vectors(name: str) -> torch.Tensor | None:
    return None


def same_op(made: ops.Op, expected: ops.Op) -> bool:
    """Same class and equal fields (tensors equal in dtype, shape and every value)."""
    if type(made) is not type(expected):
        return False
    for item in dataclasses.fields(expected):
        mine, theirs = getattr(made, item.name), getattr(expected, item.name)
        if isinstance(theirs, torch.Tensor):
            if not (isinstance(mine, torch.Tensor) and mine.dtype == theirs.dtype
                    and torch.equal(mine, theirs)):
                return False
        elif mine != theirs or type(mine) is not type(theirs):
            return False
    return made.to_data() == expected.to_data()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int64], ids=str)
@pytest.mark.parametrize("shape", [(5,), (2, 3), (2, 1, 4), (0,), (0, 3), ()], ids=str)
def test_tensor_round_trip_is_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(len(shape) * 7 + sum(shape))
    if dtype.is_floating_point:
        tensor = (torch.randn(shape, generator=generator, dtype=torch.float64) * 1e3).to(dtype)
    else:
        tensor = torch.randint(-2**62, 2**62, shape, generator=generator, dtype=dtype)
    sent = tensor_to_json(tensor)
    back = tensor_from_json(sent, "x", no_vectors)
    assert sent["shape"] == list(shape)
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert back.view(-1).view(torch.uint8).tolist() == tensor.view(-1).view(torch.uint8).tolist()


def test_tensor_base64_is_raw_little_endian_bytes() -> None:
    sent = tensor_to_json(torch.tensor([1.5, -2.25, 3.0e-8], dtype=torch.float32))
    assert sent["dtype"] == "float32" and sent["shape"] == [3]
    assert base64.b64decode(sent["base64"]) == struct.pack("<3f", 1.5, -2.25, 3.0e-8)
    hand_made = {"base64": base64.b64encode(struct.pack("<4f", 1, 2, 3, 4)).decode(),
                 "dtype": "float32", "shape": [2, 2]}
    assert torch.equal(tensor_from_json(hand_made, "x", no_vectors),
                       torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


def test_tensor_from_nested_list_is_float32() -> None:
    tensor = tensor_from_json([[1, 2], [3, 4.5]], "x", no_vectors)
    assert tensor.dtype == torch.float32
    assert torch.equal(tensor, torch.tensor([[1.0, 2.0], [3.0, 4.5]]))


def test_ragged_list_names_the_field() -> None:
    with pytest.raises(InterventionInputError) as raised:
        tensor_from_json([[1.0, 2.0], [3.0]], "interventions[0].vector", no_vectors)
    assert raised.value.field == "interventions[0].vector"
    assert "equal" in str(raised.value)


def bytes_form(**changes: object) -> dict[str, object]:
    good = {"base64": base64.b64encode(struct.pack("<2f", 1, 2)).decode(), "dtype": "float32",
            "shape": [2]}
    return {**good, **changes}


@pytest.mark.parametrize(("sent", "field", "fix"), [
    (bytes_form(dtype="float8"), "x.dtype", "float32"),
    (bytes_form(dtype=["float32"]), "x.dtype", "float32"),
    (bytes_form(shape=[-1]), "x.shape", "whole numbers"),
    (bytes_form(shape=[True, 2]), "x.shape", "whole numbers"),
    (bytes_form(shape=2), "x.shape", "list of sizes"),
    (bytes_form(base64="not base64!"), "x.base64", "base64"),
    (bytes_form(base64=12), "x.base64", "base64"),
    (bytes_form(shape=[3]), "x", "needs 12"),
    ({"dtype": "float32", "shape": [2]}, "x", "missing base64"),
    ("1, 2", "x", "list of numbers"),
], ids=["unknown-dtype", "unhashable-dtype", "negative-size", "bool-size", "shape-not-list",
        "bad-base64", "base64-not-text", "byte-count", "missing-key", "not-a-tensor"])
def test_bad_tensor_names_its_field_and_the_fix(sent: object, field: str, fix: str) -> None:
    with pytest.raises(InterventionInputError) as raised:
        tensor_from_json(sent, "x", no_vectors)
    assert raised.value.field == field
    assert str(raised.value).startswith(f"{field}: ") and fix in str(raised.value)


def test_named_vector_comes_from_the_lookup() -> None:
    kept = torch.arange(4, dtype=torch.float16)
    asked: list[str] = []

    def lookup(name: str) -> torch.Tensor | None:
        asked.append(name)
        return kept if name == "honesty" else None

    assert tensor_from_json({"name": "honesty"}, "x", lookup) is kept
    assert asked == ["honesty"]
    with pytest.raises(InterventionInputError) as raised:
        tensor_from_json({"name": "missing"}, "interventions[3].vector", lookup)
    assert raised.value.field == "interventions[3].vector"
    assert "PUT" in str(raised.value) and "/v1/interp/vectors/missing" in str(raised.value)


def test_ops_from_json_make_the_python_ops() -> None:
    vector = torch.tensor([0.5, -1.0, 2.0])
    sent = [
        {"op": "save", "location": LOCATION, "positions": [0, -1], "steps": "prefill"},
        {"op": "add", "location": LOCATION, "vector": vector.tolist(), "scale": 2.0},
        {"op": "set", "location": "layers.0.mlp_output", "value": tensor_to_json(vector)},
        {"op": "scale", "location": LOCATION, "factor": 0.5, "steps": "decode"},
        {"op": "zero", "location": "layers.0.attn.head_output", "heads": [1, 3]},
        {"op": "project_out", "location": LOCATION, "direction": {"name": "d"}},
        {"op": "skip", "location": "layers.2"},
        {"op": "skip", "layer": 2},
        {"op": "lens", "location": LOCATION, "top_k": 3, "positions": [-1]},
    ]
    made = ops_from_json(sent, lambda name: vector if name == "d" else None)
    expected = [
        ops.Save(LOCATION, positions=(0, -1), steps="prefill"),
        ops.Add(LOCATION, vector, scale=2.0),
        ops.Set("layers.0.mlp_output", vector),
        ops.Scale(LOCATION, 0.5, steps="decode"),
        ops.Zero("layers.0.attn.head_output", heads=(1, 3)),
        ops.ProjectOut(LOCATION, vector),
        ops.Skip(2),
        ops.Skip(layer=2),
        ops.Lens(LOCATION, top_k=3, positions=(-1,)),
    ]
    assert len(made) == len(expected)
    for index, (op, want) in enumerate(zip(made, expected, strict=True)):
        assert same_op(op, want), (index, op, want)
    assert made[0].positions == (0, -1) and isinstance(made[0].positions, tuple)
    assert made[6].layer == made[7].layer == 2


def refused(sent: object, allow_code: bool = False) -> InterventionInputError:
    with pytest.raises(InterventionInputError) as raised:
        ops_from_json(sent, no_vectors, allow_code=allow_code)
    return raised.value


def test_interventions_not_a_list_is_refused() -> None:
    assert refused({"op": "save", "location": LOCATION}).field == "interventions"


def test_op_not_an_object_is_refused() -> None:
    assert refused(["save"]).field == "interventions[0]"


@pytest.mark.parametrize("kind", ["steer", None, ["add"]], ids=["steer", "none", "list"])
def test_unknown_op_names_the_op_field_and_lists_the_ops(kind: object) -> None:
    error = refused([{"op": "save", "location": LOCATION}, {"op": kind, "location": LOCATION}])
    assert error.field == "interventions[1].op"
    for known in ("save", "add", "set", "scale", "zero", "project_out", "skip", "lens"):
        assert known in str(error)


def test_missing_location_is_refused() -> None:
    error = refused([{"op": "add", "vector": [1.0]}])
    assert error.field == "interventions[0].location"
    assert "layers." in str(error)


@pytest.mark.parametrize("sent", [
    {"op": "add", "location": LOCATION, "vector": [1.0], "colour": "red"},
    {"op": "save", "location": LOCATION, "colour": "red"},
    {"op": "skip", "location": "layers.2", "colour": "red"},
    {"op": "skip", "layer": 2, "positions": [0]},
], ids=["add", "save", "skip-location", "skip-layer"])
def test_unknown_field_is_refused_with_the_fields_accepted(sent: dict[str, object]) -> None:
    error = refused([sent])
    assert error.field == "interventions[0]"
    assert "location" in str(error)
    if sent["op"] == "add":
        assert all(name in str(error) for name in ("vector", "scale", "positions", "steps"))


def test_call_is_refused_unless_code_is_allowed() -> None:
    sent = [{"op": "call", "location": LOCATION, "fn": "not a function"}]
    error = refused(sent)
    assert error.field == "interventions[0].op"
    assert "--interp-allow-code" in str(error) or "operator" in str(error)
    allowed = refused(sent, allow_code=True)  # past the gate, the bad fn itself is refused
    assert allowed.field == "interventions[0].fn" and "--interp-allow-code" not in str(allowed)


def test_a_call_takes_its_function_in_base64_and_rowwise_as_a_boolean() -> None:
    import cloudpickle

    sent = {"op": "call", "location": LOCATION, "rowwise": True,
            "fn": base64.b64encode(cloudpickle.dumps(_doubled)).decode()}
    (op,) = ops_from_json([sent], no_vectors, allow_code=True)
    assert isinstance(op, ops.Call) and op.rowwise is True
    assert torch.equal(op.fn(torch.ones(2), None), torch.full((2,), 2.0))
    error = refused([{**sent, "rowwise": "yes"}], allow_code=True)
    assert error.field == "interventions[0]" and "rowwise must be True or False" in str(error)
    error = refused([{**sent, "fn": "not base64!"}], allow_code=True)
    assert error.field == "interventions[0].fn" and "cloudpickle.dumps" in str(error)
    error = refused([{**sent, "fn": base64.b64encode(b"no pickle").decode()}], allow_code=True)
    assert error.field == "interventions[0]" and "not a cloudpickled function" in str(error)


def _doubled(value, context):
    return value * 2


def test_op_check_failure_becomes_an_input_error() -> None:
    error = refused([{"op": "add", "location": LOCATION, "vector": [1.0, float("nan")]}])
    assert error.field == "interventions[0]"
    assert isinstance(error, ValueError) and "non-finite" in str(error)
    assert refused([{"op": "lens", "location": LOCATION, "top_k": 0}]).field == "interventions[0]"


def test_saves_to_json_gives_each_location_in_base64_form() -> None:
    saved = {"layers.0.layer_output": torch.randn(1, 3, 4),
             "layers.0.layer_output.lens_tokens": torch.tensor([[[7, 1]]], dtype=torch.int64)}
    sent = saves_to_json(saved)
    assert set(sent) == set(saved)
    for location, tensor in saved.items():
        assert set(sent[location]) == {"base64", "dtype", "shape"}
        assert torch.equal(tensor_from_json(sent[location], location, no_vectors), tensor)
