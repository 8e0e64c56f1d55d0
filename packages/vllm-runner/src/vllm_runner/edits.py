"""Edit ops on a value as read: what `Add`, `Set`, `Scale`, `Zero` and `ProjectOut` compute,
and which rows their `positions` and `steps` keep. Pure functions of tensors and plain-data ops;
the runtime reads the rows and writes the result back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_runner.ops import non_finite, tensor_from_data


def edit(op: dict[str, Any], current: torch.Tensor, layout: tuple[str, ...]) -> torch.Tensor:
    """The value after an edit op (`add`, `set`, `scale`, `zero`, `project_out`), on every row;
    `layout` names the value's axes (for `Zero(heads=)` and error messages)."""
    kind = op["op"]
    if kind == "add":
        vector = _fitted(tensor_from_data(op["vector"]), current, layout, "Add's vector")
        edited = current + vector.to(current.device, current.dtype) * op["scale"]
    elif kind == "set":
        value = _fitted(tensor_from_data(op["value"]), current, layout, "Set's value")
        edited = value.to(current.device, current.dtype).expand_as(current).clone()
    elif kind == "scale":
        edited = current * op["factor"]
    elif kind == "zero":
        edited = current.clone()
        if op.get("heads") is None:
            edited.zero_()
        else:
            if "heads" not in layout and "kv_heads" not in layout:
                raise ValueError(f"Zero(heads=...) needs a value with a heads axis, not "
                                 f"[{' '.join(layout)}]")
            axis = layout.index("heads" if "heads" in layout else "kv_heads")
            edited.index_fill_(axis, torch.tensor(op["heads"], dtype=torch.long,
                                                  device=current.device), 0.0)
    elif kind == "project_out":
        direction = tensor_from_data(op["direction"]).to(current.device, current.dtype)
        unit = direction / direction.norm()
        edited = current - (current @ unit).unsqueeze(-1) * unit
    else:
        raise ValueError(f"unknown op {kind!r}")
    return edited


def refuse_non_finite(edited: Any, what: str, location: str) -> None:
    """Raise if an edit's result holds NaN or infinity (`-inf` on the logits bans a token and is
    allowed), before it is written: written into the engine's rows it would spread through the
    request's later layers and its KV cache."""
    if isinstance(edited, torch.Tensor) and edited.is_floating_point():
        bad = non_finite(edited, location == "logits")
        if bad:
            raise ValueError(f"{what} gave {bad} non-finite values (NaN or infinity) of "
                             f"{edited.numel()}; nothing was written")


def same_on_every_row(op: dict[str, Any], current: torch.Tensor, token_axis: int) -> bool:
    """Whether an edit's tensor, if it has one, is the same for every row (it does not extend
    along the tokens axis): only then is editing many requests' rows at once the same as
    editing each request's (a `[tokens, hidden]` value sized for one request must fail alone,
    not fit two requests by chance)."""
    data = op.get("vector") or op.get("value")
    if data is None:
        return True
    shape = data["shape"]
    reach = current.dim() - token_axis  # axes from the right, up to the tokens axis
    return len(shape) < reach or shape[len(shape) - reach] == 1


def _fitted(tensor: torch.Tensor, current: torch.Tensor, layout: tuple[str, ...],
            what: str) -> torch.Tensor:
    """`tensor` if it broadcasts over the value as read, else an error that says which shape
    would (the value's layout and this step's shape)."""
    try:
        fits = torch.broadcast_shapes(tuple(tensor.shape), tuple(current.shape)) == current.shape
    except RuntimeError:
        fits = False
    if not fits:  # e.g. two rows for a request that has one this step
        raise ValueError(
            f"{what} has shape {tuple(tensor.shape)}, which does not broadcast over the value "
            f"[{' '.join(layout)}] (this step: {tuple(current.shape)}); e.g. give "
            f"[{current.shape[-1]}] for a vector along its last axis")
    return tensor


def only_kept_rows(op: dict[str, Any], prompt_length: int, first: int, current: torch.Tensor,
                   edited: torch.Tensor, token_axis: int | None) -> torch.Tensor:
    """`edited` where the op's `positions`/`steps` keep the row (the rows hold positions
    `first, first + 1, ...`), `current` elsewhere."""
    keep = position_filter(op, prompt_length)
    if token_axis is None or keep is None:
        return edited
    for offset in range(current.shape[token_axis]):
        if not keep(first + offset):
            edited.select(token_axis, offset).copy_(current.select(token_axis, offset))
    return edited


def position_filter(op: dict[str, Any], prompt_length: int) -> Callable[[int], bool] | None:
    """`position -> bool` for an op's `positions` (negative: from the prompt's end) and `steps`;
    `None` when the op keeps every position."""
    positions = op.get("positions")
    if positions is None and op.get("steps", "all") == "all":
        return None
    absolute = None if positions is None else {p + prompt_length if p < 0 else p
                                               for p in positions}
    steps = op.get("steps", "all")

    def keep(position: int) -> bool:
        if absolute is not None and position not in absolute:
            return False
        if steps == "prefill":
            return position < prompt_length
        if steps == "decode":
            return position >= prompt_length
        return True
    return keep


def before_the_prompt(ops: list[dict[str, Any]], prompt_length: int) -> str | None:
    """Why a program can never run as written on a prompt of `prompt_length` tokens (a
    negative position counted past the prompt's start), or `None`."""
    for op in ops:
        never = [p for p in op.get("positions") or () if p < -prompt_length]
        if never:
            return (f"{op['op']} at {op['location']}: positions {never} are before the start "
                    f"of the prompt, which has {prompt_length} tokens (-1..-{prompt_length} "
                    "count from its end)")
    return None
