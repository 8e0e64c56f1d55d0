"""Interventions as JSON (the server's `interventions` field) into the op classes, and saves out.

Each op is `{"op": <kind>, "location": ..., <the Python op's other fields by the same names>}`,
the same ops and location grammar as `vllm_runner.ops`. A tensor field (`vector`, `value`,
`direction`) is a JSON list of numbers, `{"base64": ..., "dtype": ..., "shape": [...]}` of raw
little-endian bytes, or `{"name": ...}` of a vector the server keeps. Saves come back in the
base64 form. Everything a request could get wrong is refused here, before it is queued, as an
`InterventionInputError` naming the field (`interventions[2].vector`) and the fix.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any

import torch
from tokenspan import READ_MODES

from vllm_runner.ops import OPS_BY_KIND, Op
from vllm_runner.ops.checks import STEPS
from vllm_runner.ops.data import TAG

#: The dtypes a tensor travels in (little-endian raw bytes), by their JSON names (the integer
#: ones for saves such as a lens's token ids).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
#: Ops that run client code in the server; refused unless the operator allows them.
CODE_OPS = frozenset({"call"})

VectorLookup = Callable[[str], torch.Tensor | None]


class InterventionInputError(ValueError):
    """One field of a request's `interventions` is wrong; `field` names it, the message says
    what to send instead (the server answers 400 with both)."""

    #: The HTTP status the server answers with.
    status = HTTPStatus.BAD_REQUEST

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _tensor_fields(op_class: type[Op]) -> set[str]:
    return {item.name for item in dataclasses.fields(op_class)
            if "Tensor" in str(item.type)}


def _optional(op_class: type[Op], name: str) -> bool:
    """Whether the op's field `name` may be left out as `null` (`Probe.bias`)."""
    return any(item.name == name and item.default is None for item in dataclasses.fields(op_class))


def tensor_from_json(value: Any, field: str, vectors: VectorLookup) -> torch.Tensor:
    """A tensor sent as a list of numbers, as base64 bytes with dtype and shape, or by name."""
    if isinstance(value, list):
        try:
            tensor = torch.tensor(value, dtype=torch.float32)
        except (TypeError, ValueError) as error:
            raise InterventionInputError(field, f"a list of numbers (nested lists of equal "
                                                f"length) was expected: {error}") from None
        return tensor
    if not isinstance(value, dict):
        raise InterventionInputError(field, "send a list of numbers, {\"base64\": ..., "
                                            "\"dtype\": ..., \"shape\": [...]}, or "
                                            "{\"name\": ...} of a registered vector")
    if "name" in value:
        found = vectors(str(value["name"]))
        if found is None:
            raise InterventionInputError(field, f"no vector is registered as "
                                                f"{value['name']!r}; PUT it to "
                                                f"/v1/interp/vectors/{value['name']} first")
        return found
    return _tensor_from_base64(value, field)


def _tensor_from_base64(value: dict[str, Any], field: str) -> torch.Tensor:
    missing = [key for key in ("base64", "dtype", "shape") if key not in value]
    if missing:
        raise InterventionInputError(field, f"missing {', '.join(missing)} (a tensor as bytes "
                                            "is {\"base64\", \"dtype\", \"shape\"})")
    dtype = DTYPES.get(value["dtype"]) if isinstance(value["dtype"], str) else None
    if dtype is None:
        raise InterventionInputError(f"{field}.dtype", f"{value['dtype']!r} is not one of "
                                                       f"{', '.join(DTYPES)}")
    shape = value["shape"]
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool)
                                              and n >= 0 for n in shape):
        raise InterventionInputError(f"{field}.shape", "a list of sizes (whole numbers >= 0)")
    try:
        raw = base64.b64decode(value["base64"], validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise InterventionInputError(f"{field}.base64", "not valid base64") from None
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(raw) != expected:
        raise InterventionInputError(field, f"{len(raw)} bytes, but shape {shape} of "
                                            f"{value['dtype']} needs {expected}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape).clone()


def tensor_to_json(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor as `{"base64", "dtype", "shape"}` (the form `tensor_from_json` reads)."""
    flat = tensor.detach().cpu().contiguous()
    if flat.dtype not in DTYPE_NAMES:
        flat = flat.to(torch.float32)
    raw = flat.reshape(-1).view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {"dtype": DTYPE_NAMES[flat.dtype], "shape": list(flat.shape),
            "base64": base64.b64encode(raw).decode("ascii")}


def ops_from_json(interventions: Any, vectors: VectorLookup,
                  allow_code: bool = False) -> list[Op]:
    """The ops of one request's `interventions`, each checked as the Python op checks itself."""
    if not isinstance(interventions, list):
        raise InterventionInputError("interventions", "a list of ops, each {\"op\": ..., "
                                                      "\"location\": ..., ...}")
    return [op_from_json(item, f"interventions[{index}]", vectors, allow_code)
            for index, item in enumerate(interventions)]


def op_from_json(item: Any, field: str, vectors: VectorLookup, allow_code: bool) -> Op:
    """One op from its JSON object (see the module's docstring)."""
    if not isinstance(item, Mapping):
        raise InterventionInputError(field, "an op is an object {\"op\": ..., \"location\": "
                                            "..., ...}")
    kind = item.get(TAG)
    known = ", ".join(sorted(set(OPS_BY_KIND) - CODE_OPS))
    if isinstance(kind, str) and kind in CODE_OPS and not allow_code:
        raise InterventionInputError(f"{field}.op", f"{kind!r} runs client code in the server, "
                                                    "which this server does not allow (its "
                                                    "operator can, with --interp-allow-code); "
                                                    f"the ops are {known}")
    op_class = OPS_BY_KIND.get(kind) if isinstance(kind, str) else None
    if op_class is None:
        raise InterventionInputError(f"{field}.op", f"unknown op {kind!r}; the ops are {known}")
    if kind == "skip":
        item = _skip_item(item, field)
    if op_class.PATTERN_FIELD == "location" and not isinstance(item.get("location"), str):
        raise InterventionInputError(f"{field}.location", "a location such as "
                                                          "\"layers.3.layer_output\"")
    if op_class.PATTERN_FIELD == "sae" and not isinstance(item.get("sae"), str):
        raise InterventionInputError(f"{field}.sae", "the name of one of the server's SAEs "
                                                     "(vllm-interp serve --interp-sae NAME=PATH)")
    tensors = _tensor_fields(op_class)
    fields: dict[str, Any] = {}
    for name, value in item.items():
        if name == TAG:
            continue
        if name in tensors:
            fields[name] = None if value is None and _optional(op_class, name) else \
                tensor_from_json(value, f"{field}.{name}", vectors)
        elif kind in CODE_OPS and name == "fn":
            fields[name] = _function_bytes(value, f"{field}.fn")
        elif isinstance(value, list):
            fields[name] = tuple(value)
        else:
            fields[name] = value
    try:
        return op_class(**op_class.fields_from_data(fields))
    except TypeError as error:
        accepted = sorted({item.name for item in dataclasses.fields(op_class) if item.init}
                          | {TAG})
        raise InterventionInputError(field, f"{error}; {kind} takes "
                                            f"{', '.join(accepted)}") from None
    except ValueError as error:
        raise InterventionInputError(field, str(error)) from None


def _function_bytes(value: Any, field: str) -> bytes:
    """A code op's function as sent: cloudpickled bytes in base64 (unpickled by the op)."""
    try:
        if isinstance(value, str):
            return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        pass
    raise InterventionInputError(field, "a cloudpickled function in base64: "
                                        "base64.b64encode(cloudpickle.dumps(fn)).decode()")


def _skip_item(item: Mapping[str, Any], field: str) -> Mapping[str, Any]:
    """A skip names its layer as `location` ("layers.3", as in its plain data) or as `layer`
    (3, as `Skip(layer=3)`), and takes nothing else: it always skips the whole layer."""
    extra = sorted(set(item) - {TAG, "location", "layer"})
    if extra:
        raise InterventionInputError(field, f"skip takes op and location (\"layers.<i>\") or "
                                            f"layer (<i>), not {', '.join(extra)}: it skips "
                                            "the whole layer for the request")
    if "layer" not in item:
        return item
    if "location" in item:
        raise InterventionInputError(field, "skip takes location or layer, not both")
    return {TAG: "skip", "location": f"layers.{item['layer']}"}


def saves_to_json(saved: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """A request's saves (`outputs[i].saved`) in the JSON form, by location."""
    return {location: tensor_to_json(tensor) for location, tensor in saved.items()}


def _field_schema(type_name: str) -> dict[str, Any]:
    """The JSON Schema of one op field, from its annotation (a new kind of field fails here,
    in the test that checks the documented schema, until it is described)."""
    whole_numbers = {"type": "array", "items": {"type": "integer"}}
    known: dict[str, dict[str, Any]] = {
        "str": {"type": "string"},
        "float": {"type": "number"},
        "bool": {"type": "boolean"},
        "int": {"type": "integer", "minimum": 1},
        "int | None": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
        "dict[int, float]": {"type": "object", "minProperties": 1,
                             "propertyNames": {"pattern": r"^\d+$"},
                             "additionalProperties": {"type": "number"},
                             "description": "feature index -> value, e.g. {\"1234\": 8.0}"},
        "torch.Tensor": {"$ref": "#/$defs/tensor"},
        "torch.Tensor | None": {"anyOf": [{"$ref": "#/$defs/tensor"}, {"type": "null"}]},
        "str | None": {"anyOf": [{"type": "string", "pattern": r"^\w+$"}, {"type": "null"}]},
        "tuple[int, ...] | None": {"anyOf": [whole_numbers, {"type": "null"}]},
        "Steps": {"enum": list(STEPS)},
        "ReadMode | None": {"anyOf": [{"enum": list(READ_MODES)}, {"type": "null"}]},
        "Any": {"description": "a cloudpickled function, base64 (only with "
                               "--interp-allow-code)", "type": "string"},
    }
    if type_name not in known:
        raise TypeError(f"no JSON schema for op fields of type {type_name!r}: add it to "
                        "json_ops._field_schema")
    return known[type_name]


def interventions_schema(allow_code: bool = False) -> dict[str, Any]:
    """The JSON Schema of the `interventions` field, made from the op classes themselves (so
    the documented form cannot drift from what the server accepts)."""
    variants = []
    for kind, op_class in OPS_BY_KIND.items():
        if kind in CODE_OPS and not allow_code:
            continue
        fields = [item for item in dataclasses.fields(op_class) if item.init]
        properties: dict[str, Any] = {TAG: {"const": kind}}
        required = [TAG, op_class.PATTERN_FIELD]
        for item in fields:
            properties[item.name] = _field_schema(str(item.type))
            if item.default is dataclasses.MISSING and item.default_factory is \
                    dataclasses.MISSING and item.name != op_class.PATTERN_FIELD:
                required.append(item.name)
        if kind == "skip":
            properties["location"] = {"type": "string", "pattern": r"^layers\.\d+$"}
        variants.append({"title": op_class.__name__, "type": "object",
                         "properties": properties, "required": required,
                         "additionalProperties": False})
    tensor = {"description": "a list of numbers (nested for more axes), the raw little-endian "
                             "bytes of a tensor, or the name of a registered vector",
              "anyOf": [{"type": "array"},
                        {"type": "object", "required": ["base64", "dtype", "shape"],
                         "properties": {"base64": {"type": "string"},
                                        "dtype": {"enum": list(DTYPES)},
                                        "shape": {"type": "array",
                                                  "items": {"type": "integer", "minimum": 0}}},
                         "additionalProperties": False},
                        {"type": "object", "required": ["name"],
                         "properties": {"name": {"type": "string"}},
                         "additionalProperties": False}]}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "interventions", "type": "array",
            "items": {"oneOf": variants}, "$defs": {"tensor": tensor}}
