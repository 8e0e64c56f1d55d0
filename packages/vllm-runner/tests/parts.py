"""Small stand-ins for the runtime's unit tests: a value over a plain torch module, the step
plan of a few requests, and the serving services — no engine anywhere."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tokenspan import StepLayout
from torch import nn
from vllm_envoys import EProperty, Host, Rows, Stream, Value
from vllm_envoys.layouts import RESIDUAL
from vllm_envoys.sites import Output
from vllm_runner.ops import Op
from vllm_runner.ops.program import Program
from vllm_runner.ops.wants import ScheduledRequest
from vllm_runner.runtime.row_serving import Services, Visits
from vllm_runner.saves.store import SaveStore

HIDDEN = 4


class Toy(nn.Module):
    """A layer whose output is its input plus one: `[tokens, hidden]` rows, as vLLM's are."""

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return rows + 1


def residual_value(module: nn.Module, location: str = "layers.0") -> Value:
    """The `layer_output` value of `module`: its whole output, served as `[1, tokens, hidden]`."""
    prop = EProperty(Output(), Rows(), RESIDUAL, "a toy layer's output")
    prop.__set_name__(Host, "layer_output")
    return Value(Host(module, location), prop)


def stream_value(module: nn.Module, location: str = "layers.0") -> Value:
    """The `layer_output` value of a fused block whose output is the stream in two halves,
    `(hidden, residual)`, as vLLM's decoder layers return it: read as their sum, written as
    the whole stream in the hidden half and zeros in the residual half."""
    prop = EProperty(Output(0, 1), Stream(), RESIDUAL, "a fused block's output stream")
    prop.__set_name__(Host, "layer_output")
    return Value(Host(module, location), prop)


def layout_of(counts: list[int], firsts: list[int] | None = None) -> StepLayout:
    """Requests `r0, r1, ...` back to back, with `counts` rows from `firsts` (default 0)."""
    keys = [f"r{i}" for i in range(len(counts))]
    return StepLayout.from_counts(keys, counts, firsts or [0] * len(counts))


def scheduled(layout: StepLayout, ops: list[Op], digest: str = "same",
              prompt_length: int = 100) -> list[ScheduledRequest]:
    """Every request of `layout` running `ops` (one program each, one digest for all)."""
    return [ScheduledRequest(key, Program(f"p-{key}", digest, tuple(ops)), prompt_length)
            for key in layout.keys]


def services() -> Services:
    """Serving services with a fresh store and a lens that must not be called."""
    def no_lens(rows: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("no lens in these tests")
    return Services(SaveStore(), no_lens)


class OnADevice(torch.Tensor):
    """A host tensor that says it is on a GPU, as do tensors computed from it (`torch.cat`,
    slices); copies the store makes through its staging buffer are plain host tensors."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def on_a_device(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as an `OnADevice`: the store's device path, run on the host."""
    return tensor.as_subclass(OnADevice)


_TORCH_CAT = torch.cat


def cat_on_one_device(tensors, *args, **kwargs):
    """`torch.cat` that refuses tensors of two devices, as on a GPU machine (on the host, a cat
    of a host tensor and an `OnADevice` one would succeed)."""
    devices = {tensor.device for tensor in tensors}
    assert len(devices) == 1, f"torch.cat of tensors on {devices}"
    return _TORCH_CAT(tensors, *args, **kwargs)


def served_through(name: str, value: Value, raw: Any, visits: Visits, used: Services
                   ) -> list[bool]:
    """Serve `visits` at `value`'s location (`row_serving.serve`) and say what `serving.<name>` (a
    way of serving a group together) answered each time it was asked: `[True]` when it served
    the one group, `[]` when it was never asked."""
    from vllm_runner.runtime import row_serving
    answers: list[bool] = []
    way = getattr(row_serving, name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(row_serving, name, lambda *args: answers.append(way(*args)) or answers[-1])
        row_serving.serve(value, raw, visits, used)
    return answers
