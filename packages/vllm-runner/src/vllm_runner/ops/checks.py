"""Checks of an op's arguments when it is made, and of an edit's result before it is written.

An op is checked where the user makes it (a clear error at their line, naming the op), and
again where a worker decodes it from the wire: both build the same class.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any, Literal, get_args

import numpy as np
import torch

Steps = Literal["all", "prefill", "decode"]
STEPS: tuple[str, ...] = get_args(Steps)


#: How many values of a list an error message shows (a request may send a million positions).
SHOWN_VALUES = 10


def listed(values: Any, most: int = SHOWN_VALUES) -> str:
    """`values` as an error message shows them: their `repr`, or the first `most` and how many
    more where there are more (a message must not echo a huge request back)."""
    if not isinstance(values, (tuple, list, range)) or len(values) <= most:
        return repr(values)
    shown = ", ".join(repr(value) for value in values[:most])
    opening, closing = ("(", ")") if isinstance(values, tuple) else ("[", "]")
    return f"{opening}{shown}, … and {len(values) - most:,} more{closing}"


def op_name(op: Any) -> str:
    """`Save('layers.0.layer_output')`: how errors name an op."""
    return f"{type(op).__name__}({op.location!r})"


def non_finite(tensor: torch.Tensor, on_logits: bool) -> int:
    """How many values of `tensor` are NaN or infinite — except `-inf` on the logits, which
    bans a token and touches nothing the engine keeps."""
    # Every edit of every request is checked each step (a `Call` on 64 requests: 64 checks a
    # step), and nearly all are finite: one reduction and one answer for them, the count only
    # when something may not be. A NaN or an infinity anywhere makes the sum NaN or infinite, so
    # a finite sum proves every value finite; a sum that overflowed (huge finite values) only
    # takes the exact count below. One sum costs a fraction of `isfinite(...).all()`, which
    # writes a mask of the whole edit first.
    if math.isfinite(float(tensor.sum(dtype=torch.float32))):
        return 0
    bad = ~torch.isfinite(tensor)
    if on_logits:
        bad &= tensor != float("-inf")
    return int(bad.sum())


def check_where(op: Any) -> None:
    """Refuse `steps` outside `STEPS` and `positions` that are not a sequence of whole numbers,
    naming the op (a typo such as `steps="sometimes"` would otherwise act as `"all"`)."""
    if op.steps not in STEPS:
        raise ValueError(f"{op_name(op)}: steps={op.steps!r} must be one of {', '.join(STEPS)}")
    positions = op.positions
    if positions is not None and (not isinstance(positions, (tuple, list, range)) or not all(
            isinstance(p, Integral) and not isinstance(p, bool) for p in positions)):
        raise ValueError(f"{op_name(op)}: positions={listed(positions)} must be a tuple of whole "
                         "numbers (absolute, or negative from the end of the prompt), e.g. "
                         "(-1,)")
    tokens = op.tokens
    if tokens is not None and (not isinstance(tokens, (tuple, list, range)) or not tokens or
                               not all(isinstance(t, Integral) and not isinstance(t, bool)
                                       and int(t) >= 0 for t in tokens)):
        raise ValueError(f"{op_name(op)}: tokens={listed(tokens)} must be a non-empty tuple of "
                         "token ids (whole numbers >= 0), e.g. tokenizer.encode(' love')")


def check_tensor(op: Any, field_name: str) -> None:
    """Refuse a tensor argument that is not a real tensor or holds NaN or infinity: a
    non-finite vector makes every value it touches non-finite (e.g. a direction normalised
    from a zero vector)."""
    tensor = getattr(op, field_name)
    if not isinstance(tensor, torch.Tensor) or tensor.is_complex():
        raise TypeError(f"{op_name(op)}: {field_name} must be a real-valued torch.Tensor, not "
                        f"{type(tensor).__name__}" + (" (complex)" if isinstance(
                            tensor, torch.Tensor) else ""))
    if tensor.is_floating_point():
        # As it travels: float32 (`ops.data.tensor_to_data`), where a float64 1e300 is infinite.
        bad = non_finite(tensor.detach().float(), op.location == "logits")
        if bad:
            raise ValueError(f"{op_name(op)}: {field_name} holds {bad} non-finite values (NaN "
                             f"or infinity, or beyond float32's range) of {tensor.numel()}; was "
                             "it normalised from a zero vector?")


def check_result_name(op: Any, field_name: str) -> None:
    """Refuse a result's name that is not a plain name (it becomes part of a saved key:
    `f"{location}.{name}"`); `None` (no result) passes."""
    name = getattr(op, field_name)
    if name is None:
        return
    if not isinstance(name, str) or not name or not name.replace("_", "a").isalnum():
        raise ValueError(f"{op_name(op)}: {field_name}={name!r} must be a name of letters, "
                         "digits and underscores, e.g. 'probe' (it becomes part of the saved "
                         "key: '<location>.<name>')")


def check_number(op: Any, field_name: str) -> None:
    """Refuse a scale or factor that is not a finite real number."""
    number = getattr(op, field_name)
    if isinstance(number, bool) or not isinstance(number, Real):
        raise TypeError(f"{op_name(op)}: {field_name} must be a number, not "
                        f"{type(number).__name__}")
    if not math.isfinite(float(number)):
        raise ValueError(f"{op_name(op)}: {field_name}={number!r} is not finite")


def check_whole_numbers(op: Any, field_name: str, what: str) -> None:
    """Refuse a field that is not a tuple of whole numbers, 0 or more (head indices)."""
    numbers = getattr(op, field_name)
    if numbers is not None and (not isinstance(numbers, (tuple, list)) or not all(
            isinstance(n, Integral) and not isinstance(n, bool) and int(n) >= 0
            for n in numbers)):
        raise ValueError(f"{op_name(op)}: {field_name}={listed(numbers)} must be a tuple of {what} "
                         "(0 or more)")


def refuse_non_finite(edited: Any, what: str, location: str) -> None:
    """Raise if an edit's result holds NaN or infinity (`-inf` on the logits bans a token and is
    allowed), before it is written: written into the engine's rows it would spread through the
    request's later layers and its KV cache."""
    if isinstance(edited, torch.Tensor) and edited.is_floating_point():
        bad = non_finite(edited, location == "logits")
        if bad:
            raise non_finite_error(bad, edited.numel(), what)


def non_finite_each(edits: Sequence[torch.Tensor], location: str) -> list[int]:
    """`non_finite` of each edit (floating tensors on one device) with one answer from the
    device for all: the edits of a step's requests checked together wait for the device once,
    where checking each alone waits once a request."""
    if not edits:
        return []
    # One multi-tensor kernel for every edit's sum of magnitudes (where a sum a request would
    # launch one kernel each), 16-bit edits summed in float32 (float16's range is small):
    # NaN or infinity in an edit makes its total so; a total that overflows from finite values
    # is looked at closely by `non_finite`.
    wide = {"dtype": torch.float32} if edits[0].element_size() < 4 else {}
    totals = torch.stack(torch._foreach_norm(list(edits), 1, **wide)).tolist()
    return [0 if math.isfinite(total) else non_finite(edit, location == "logits")
            for total, edit in zip(totals, edits, strict=True)]


def finite_on_the_host(edits: Sequence[torch.Tensor]) -> bool:
    """Whether `edits` are on the host and free of NaN and infinity (or not floating point):
    nothing to count per request then, answered by one sum each. `False` on an accelerator,
    where reading the answer would make the host wait (`non_finite_counts` counts there)."""
    if not edits[0].is_floating_point():
        return True
    if edits[0].device.type != "cpu":
        return False
    return not any(non_finite(edit, False) for edit in edits)


def non_finite_counts(edits: Sequence[torch.Tensor], token_axis: int,
                      rows_per_owner: Sequence[int] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """How many NaN or infinite values each owner's rows hold (int64, one per owner, where the
    edits are), and whether each row may be written (bool, one per row along `token_axis`, the
    edits joined in their order: its owner's count is 0): what `non_finite_each` counts, `-inf`
    on the logits aside. The owners hold consecutive rows, `rows_per_owner` of them each (by
    default one owner per edit: an edit of a run of rows can count for each request in it). On
    an accelerator it is counted there and not read (`non_finite_counts_on_device`); on the
    host, where nothing waits, first by the cheaper one sum per edit, and `None` where every
    edit is finite (nothing to hold back), as it is for edits that are not floating point."""
    if finite_on_the_host(edits):
        return None
    return non_finite_counts_on_device(edits, token_axis, rows_per_owner)


def non_finite_counts_on_device(edits: Sequence[torch.Tensor], token_axis: int,
                                rows_per_owner: Sequence[int] | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`non_finite_counts` in a few kernels whatever the number of edits or owners (floating
    tensors of one layout but their token axis, `token_axis`): joined along it and counted row
    by row. Each kernel costs the host a launch at a tap of every step, so the common shapes
    take the fewest: one owner (a request's own edit) is counted in one sum, owners of a row
    each (a decode step's requests) are their rows' counts; only owners of several rows each
    add their rows' counts up by an index of each row's owner, copied to the device."""
    if rows_per_owner is None:
        rows_per_owner = [edit.shape[token_axis] for edit in edits]
    joined = _by_rows(torch.cat(list(edits), token_axis) if len(edits) > 1 else edits[0],
                      token_axis)
    if len(rows_per_owner) == 1:
        counts = (~torch.isfinite(joined)).sum().reshape(1)
        return counts, (counts == 0).expand(joined.shape[0])
    per_row = (~torch.isfinite(joined)).sum(1)
    if all(owned == 1 for owned in rows_per_owner):
        return per_row, per_row == 0
    owners = _rows_owner(rows_per_owner, per_row.device)
    counts = torch.zeros(len(rows_per_owner), dtype=torch.long, device=per_row.device)
    counts.index_add_(0, owners, per_row)
    return counts, (counts == 0)[owners]


def _rows_owner(rows_per_owner: Sequence[int], device: torch.device) -> torch.Tensor:
    """The index of the owner of each row, owners holding `rows_per_owner` consecutive rows
    each, on `device` (copied there without waiting)."""
    owners = np.repeat(np.arange(len(rows_per_owner)), rows_per_owner)
    return torch.from_numpy(owners).to(device, non_blocking=True)


def _by_rows(edit: torch.Tensor, token_axis: int) -> torch.Tensor:
    """`edit` as `[rows, values of a row]` (rows along `token_axis`; none is fine)."""
    rows = edit.movedim(token_axis, 0)
    return rows.flatten(1) if rows.dim() > 1 else rows.unsqueeze(1)


def non_finite_error(bad: int, size: int, what: str) -> ValueError:
    """The error that refuses an edit of `size` values holding `bad` non-finite ones (nothing
    written)."""
    return ValueError(f"{what} gave {bad} non-finite values (NaN or infinity) of {size}; "
                      "nothing was written")
