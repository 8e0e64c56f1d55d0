"""Ops as plain data, and back into the same classes.

Plain data (str, int, float, lists, dicts, bytes) survives msgpack between the client, the
engine core and the workers, so one program works in-process, across processes and (issue [L])
over HTTP. Each op is `{"op": <its kind>, "location": ..., <its fields by the same names>}`:
tensors as float32 bytes and a shape, `Call` functions cloudpickled. A worker turns the data
back into the op's own class (`ops.op_from_data`), which does the rest.
"""

from __future__ import annotations

from typing import Any

import torch

#: The key of an op's kind in its plain data.
TAG = "op"


def tensor_to_data(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor as plain data (float32 bytes and a shape), which msgpack carries anywhere."""
    flat = tensor.detach().to("cpu", torch.float32).contiguous()
    return {"shape": list(flat.shape), "float32": flat.numpy().tobytes()}


def tensor_from_data(data: dict[str, Any]) -> torch.Tensor:
    """The inverse of `tensor_to_data`."""
    return torch.frombuffer(bytearray(data["float32"]), dtype=torch.float32).reshape(data["shape"])


def field_to_data(value: Any) -> Any:
    """One field of an op as plain data: tensors as bytes, sequences of numbers as lists (numpy
    integers as Python ones), everything else as it is."""
    if isinstance(value, torch.Tensor):
        return tensor_to_data(value)
    if isinstance(value, (tuple, list, range)):
        return [int(item) for item in value]
    return value


def field_from_data(data: Any) -> Any:
    """The inverse of `field_to_data` (sequences come back as tuples, as users write them)."""
    if isinstance(data, dict) and "float32" in data:
        return tensor_from_data(data)
    if isinstance(data, list):
        return tuple(data)
    return data
