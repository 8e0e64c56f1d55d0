"""Operations a request's program runs on its own rows: what users put in `interventions`.

Each op is a small value object that turns itself into plain data (`to_data`), so a program can
travel in `SamplingParams.extra_args` across process boundaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, Literal, get_args

import torch
from tokenspan import READ_MODES, ReadMode

Steps = Literal["all", "prefill", "decode"]
STEPS: tuple[str, ...] = get_args(Steps)


def _name(op: Any) -> str:
    return f"{type(op).__name__}({op.location!r})"


def _checked_where(op: Any) -> None:
    """Refuse `steps` outside `STEPS` and `positions` that are not a sequence of whole numbers,
    naming the op (a typo such as `steps="sometimes"` would otherwise act as `"all"`)."""
    if op.steps not in STEPS:
        raise ValueError(f"{_name(op)}: steps={op.steps!r} must be one of {', '.join(STEPS)}")
    positions = op.positions
    if positions is not None and (not isinstance(positions, (tuple, list, range)) or not all(
            isinstance(p, Integral) and not isinstance(p, bool) for p in positions)):
        raise ValueError(f"{_name(op)}: positions={positions!r} must be a tuple of whole "
                         "numbers (absolute, or negative from the end of the prompt), e.g. "
                         "(-1,)")


def _checked_tensor(op: Any, field_name: str) -> None:
    """Refuse a tensor argument that is not a real tensor or holds NaN or infinity: a
    non-finite vector makes every value it touches non-finite (e.g. a direction normalised
    from a zero vector)."""
    tensor = getattr(op, field_name)
    if not isinstance(tensor, torch.Tensor) or tensor.is_complex():
        raise TypeError(f"{_name(op)}: {field_name} must be a real-valued torch.Tensor, not "
                        f"{type(tensor).__name__}" + (" (complex)" if isinstance(
                            tensor, torch.Tensor) else ""))
    if tensor.is_floating_point():
        # As it travels: float32 (`tensor_to_data`), where a float64 1e300 is infinite.
        bad = non_finite(tensor.detach().float(), op.location == "logits")
        if bad:
            raise ValueError(f"{_name(op)}: {field_name} holds {bad} non-finite values (NaN or "
                             f"infinity, or beyond float32's range) of {tensor.numel()}; was it "
                             "normalised from a zero vector?")


def non_finite(tensor: torch.Tensor, on_logits: bool) -> int:
    """How many values of `tensor` are NaN or infinite — except `-inf` on the logits, which
    bans a token and touches nothing the engine keeps."""
    bad = ~torch.isfinite(tensor)
    if on_logits:
        bad &= tensor != float("-inf")
    return int(bad.sum())


def _checked_number(op: Any, field_name: str) -> None:
    """Refuse a scale or factor that is not a finite real number."""
    number = getattr(op, field_name)
    if isinstance(number, bool) or not isinstance(number, Real):
        raise TypeError(f"{_name(op)}: {field_name} must be a number, not "
                        f"{type(number).__name__}")
    if not math.isfinite(float(number)):
        raise ValueError(f"{_name(op)}: {field_name}={number!r} is not finite")


def _where(op: Any) -> dict[str, Any]:
    """The `positions` and `steps` filters of an op, as plain data."""
    positions = None if op.positions is None else [int(p) for p in op.positions]  # numpy ints
    return {"positions": positions, "steps": op.steps}


@dataclass(frozen=True)
class Save:
    """Save the value at `location` for this request, at every position it runs through.

    `outputs[i].saved[location]` is then a CPU tensor in the value's layout with the token axis
    covering the prompt and each generated token but the last, in position order. `positions`
    (absolute, or negative from the end of the prompt) keeps only those positions; `steps`
    keeps only prefill or decode steps.
    """

    location: str
    positions: tuple[int, ...] | None = None
    steps: Steps = "all"

    def __post_init__(self) -> None:
        _checked_where(self)

    def to_data(self) -> dict[str, Any]:
        """Plain data for `SamplingParams.extra_args`."""
        return {"op": "save", "location": self.location,
                **_where(self)}


def tensor_to_data(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor as plain data (float32 bytes and a shape), which msgpack carries anywhere."""
    flat = tensor.detach().to("cpu", torch.float32).contiguous()
    return {"shape": list(flat.shape), "float32": flat.numpy().tobytes()}


def tensor_from_data(data: dict[str, Any]) -> torch.Tensor:
    """The inverse of `tensor_to_data`."""
    return torch.frombuffer(bytearray(data["float32"]), dtype=torch.float32).reshape(data["shape"])


@dataclass(frozen=True)
class Add:
    """Add `scale * vector` to the value at `location`, on this request's rows only (steering).

    `vector` broadcasts over the value's layout (e.g. `[hidden]` for `layer_output`). `positions`
    and `steps` limit where it is added, as for `Save`.
    """

    location: str
    vector: torch.Tensor = field(repr=False)
    scale: float = 1.0
    positions: tuple[int, ...] | None = None
    steps: Steps = "all"

    def __post_init__(self) -> None:
        _checked_tensor(self, "vector")
        _checked_number(self, "scale")
        _checked_where(self)
        if non_finite(self.vector.detach().float() * float(self.scale),
                      self.location == "logits"):
            raise ValueError(f"{_name(self)}: scale * vector overflows float32 (scale="
                             f"{self.scale!r}); every value it is added to would be infinite")

    def to_data(self) -> dict[str, Any]:
        """Plain data for `SamplingParams.extra_args` (the vector as bytes)."""
        return {"op": "add", "location": self.location, "vector": tensor_to_data(self.vector),
                "scale": float(self.scale),
                **_where(self)}


@dataclass(frozen=True)
class Set:
    """Replace the value at `location` with `value` (broadcast over its layout) on this request's
    rows, e.g. a patched activation taken from another run."""

    location: str
    value: torch.Tensor = field(repr=False)
    positions: tuple[int, ...] | None = None
    steps: Steps = "all"

    def __post_init__(self) -> None:
        _checked_tensor(self, "value")
        _checked_where(self)

    def to_data(self) -> dict[str, Any]:
        """Plain data for `SamplingParams.extra_args`."""
        return {"op": "set", "location": self.location, "value": tensor_to_data(self.value),
                **_where(self)}


@dataclass(frozen=True)
class Scale:
    """Multiply the value at `location` by `factor` on this request's rows."""

    location: str
    factor: float
    positions: tuple[int, ...] | None = None
    steps: Steps = "all"

    def __post_init__(self) -> None:
        _checked_number(self, "factor")
        _checked_where(self)

    def to_data(self) -> dict[str, Any]:
        """Plain data for `SamplingParams.extra_args`."""
        return {"op": "scale", "location": self.location, "factor": float(self.factor),
                **_where(self)}


@dataclass(frozen=True)
class Zero:
    """Zero the value at `location` on this request's rows — only the given `heads` for values
    with a heads axis (queries, keys, values, head outputs), e.g. head ablation."""

    location: str
    heads: tuple[int, ...] | None = None
    positions: tuple[int, ...] | None = None
    steps: Steps = "all"

    def __post_init__(self) -> None:
        _checked_where(self)
        if self.heads is not None and (not isinstance(self.heads, (tuple, list)) or not all(
                isinstance(h, Integral) and not isinstance(h, bool) and h >= 0
                for h in self.heads)):
            raise ValueError(f"{_name(self)}: heads={self.heads!r} must be a tuple of head "
                             "indices (0 or more)")

    def to_data(self) -> dict[str, Any]:
        """Plain data for `SamplingParams.extra_args`."""
        return {"op": "zero", "location": self.location,
                "heads": None if self.heads is None else list(self.heads),
                **_where(self)}


@dataclass(frozen=True)
class ProjectOut:
    """Remove the component along `direction` from the value at `location` (its last axis) on
    this request's rows: `x - (x·d̂) d̂`, e.g. directional ablation."""

    location: str
    direction: torch.Tensor = field(repr=False)
    positions: tuple[int, ...] | None = None
    steps: Steps = "all"

    def __post_init__(self) -> None:
        _checked_tensor(self, "direction")
        _checked_where(self)
        if not bool(self.direction.detach().abs().sum() > 0):
            raise ValueError(f"{_name(self)}: direction is a zero vector; there is no "
                             "component to remove")

    def to_data(self) -> dict[str, Any]:
        """Plain data for `SamplingParams.extra_args`."""
        return {"op": "project_out", "location": self.location,
                "direction": tensor_to_data(self.direction),
                **_where(self)}


@dataclass(frozen=True)
class Skip:
    """Skip layer `layer` for this request only: its output becomes its input, on this request's
    rows (the layer still runs for every other request — safe on a shared engine)."""

    layer: int

    @property
    def location(self) -> str:
        """The layer, as a location prefix (`layers.<i>`)."""
        return f"layers.{self.layer}"

    def to_data(self) -> dict[str, Any]:
        """Plain data for `SamplingParams.extra_args`."""
        return {"op": "skip", "location": self.location}


@dataclass(frozen=True)
class Call:
    """Run `fn(value, ctx)` on this request's value at `location`, each step it runs.

    How `value` is lent is the read mode, `reads` (default: the engine's, `LLM(interp_reads=)`):

    - `"lease"` (the engine default): a private copy you may keep — the engine never overwrites
      it; edit it in place or return a replacement, and the change is written back to this
      request's rows only. An untouched value costs one copy and writes nothing.
    - `"copy"`: a private copy; only a returned replacement is written back (in-place edits
      stay in your copy), for code that scribbles on what it reads.
    - `"view"`: the engine's own rows where the value is stored as read (`Rows`, `Heads`
      values); no copy, in-place edits land at once, but a kept view may be overwritten by the
      engine's later in-place kernels. Values computed from the rows (a fused stream's two
      halves, patterns, probabilities) are lent as a lease instead.

    `ctx` has `location`, `positions` (absolute position of each row) and `prompt_length`. The
    function is cloudpickled, so it runs in the worker process(es) — on every rank under tensor
    parallelism, with the whole value — and what it keeps lives there (save values with `Save`).
    """

    location: str
    fn: Any = field(repr=False)
    reads: ReadMode | None = None

    def to_data(self) -> dict[str, Any]:
        """Plain data for `SamplingParams.extra_args` (the function as cloudpickled bytes)."""
        import cloudpickle

        if self.reads is not None and self.reads not in READ_MODES:
            raise ValueError(f"Call(reads={self.reads!r}): the read mode must be one of "
                             f"{', '.join(READ_MODES)} (or None for the engine's)")
        return {"op": "call", "location": self.location, "fn": cloudpickle.dumps(self.fn),
                "reads": self.reads}


@dataclass(frozen=True)
class Lens:
    """A logit lens inside the engine: project the residual value at `location` through the
    model's final norm and unembedding, and save only the top-k tokens and probabilities.

    `saved[f"{location}.lens_tokens"]` and `saved[f"{location}.lens_probs"]` are
    `[1, positions, top_k]`; no hidden state leaves the worker.
    """

    location: str
    top_k: int = 10
    positions: tuple[int, ...] | None = None
    steps: Steps = "all"

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, Integral) \
                or self.top_k < 1:
            raise ValueError(f"Lens({self.location!r}, top_k={self.top_k!r}): top_k must be a "
                             "whole number of tokens, at least 1")
        _checked_where(self)

    def to_data(self) -> dict[str, Any]:
        """Plain data for `SamplingParams.extra_args`."""
        return {"op": "lens", "location": self.location, "top_k": int(self.top_k),
                **_where(self)}


Op = Save | Add | Set | Scale | Zero | ProjectOut | Skip | Call | Lens
