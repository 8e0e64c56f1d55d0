"""Per-position operands: an `Add` vector or a `Set` value with one row per position.

A tensor given to an edit broadcasts over the value it edits, aligned from the right as torch
broadcasts. Where it has more than one row along the value's tokens axis it is a per-position
operand, and its rows are matched to absolute positions — never to a step's rows by shape, which
would change with how vLLM splits a prompt into chunks or runs a token at a decode step:

- with `positions=` naming exactly as many positions as the operand has rows, row `i` goes to
  the `i`-th of those positions in increasing order (what `Save(..., positions=...)` returns:
  its rows are in position order);
- otherwise row `p` goes to absolute position `p` (what a `Save` without `positions` returns:
  the prompt, then each generated token).

So a saved value patched back with the same `positions` (or none) lands where it was read, at
whichever step each position runs (prompt chunks, decode steps, recompute after preemption).
Positions the operand has no row for are left as they are; a `positions=` entry it has no row
for is refused before the request runs (`uncovered`).

The logits have one row per sampled position, the first at the prompt's last position, and a
`Save("logits")` starts there: their operand's row `i` goes to position `prompt_length - 1 + i`
(`first_row_position`), so saved logits set back land where they were read too.
"""

from __future__ import annotations

import torch


def rows_axis(operand: torch.Tensor, value_dims: int, token_axis: int) -> int | None:
    """The axis of `operand` that lines up with the value's tokens axis (`token_axis` of a
    value of `value_dims` axes), if the operand has more than one row there; `None` when it
    broadcasts along tokens (the same on every row)."""
    axis = operand.dim() - (value_dims - token_axis)
    if axis < 0 or operand.shape[axis] == 1:
        return None
    return axis


def named_positions(positions: tuple[int, ...] | None, prompt_length: int) -> list[int] | None:
    """The absolute positions `positions` names for a prompt of `prompt_length` tokens, in
    increasing order, each once (`None`: no `positions` filter)."""
    if positions is None:
        return None
    return sorted({p + prompt_length if p < 0 else p for p in positions})


#: The value whose rows are the sampled positions, the first at the prompt's last.
SAMPLED_ROWS = "logits"


def first_row_position(location: str, prompt_length: int) -> int:
    """The position an operand's row 0 goes to at `location`, without `positions=`."""
    return prompt_length - 1 if location == SAMPLED_ROWS else 0


def row_of_each(position: torch.Tensor, rows: int, positions: tuple[int, ...] | None,
                prompt_length: int, first: int = 0) -> torch.Tensor:
    """The operand row each of `position` (absolute positions, int64) takes, or -1 where the
    operand has none (see the module's docstring for the rule; `first`: the position row 0
    goes to without `positions=`)."""
    named = named_positions(positions, prompt_length)
    if named is not None and len(named) == rows:
        table = torch.tensor(named, dtype=torch.long)
        found = torch.searchsorted(table, position)
        hit = (found < rows) & (table[found.clamp(max=rows - 1)] == position)
        return torch.where(hit, found, -1)
    row = position - first
    return torch.where((row >= 0) & (row < rows), row, -1)


def operand_at(operand: torch.Tensor, axis: int, position: torch.Tensor,
               positions: tuple[int, ...] | None, prompt_length: int, first: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The operand's rows for `position` (one per row of the step, along `axis`; a row with no
    operand row gets row 0, to be left out) and which rows have one (bool, per row)."""
    row = row_of_each(position, operand.shape[axis], positions, prompt_length, first)
    covered = row >= 0
    return operand.index_select(axis, row.clamp(min=0).to(operand.device)), covered


def uncovered(operand: torch.Tensor, value_dims: int, token_axis: int,
              positions: tuple[int, ...] | None, prompt_length: int, first: int = 0
              ) -> list[int]:
    """The positions `positions` names (absolute, for a prompt of `prompt_length` tokens) that
    a per-position operand has no row for; empty where it covers them all, names none, or is
    not per-position."""
    axis = rows_axis(operand, value_dims, token_axis)
    named = named_positions(positions, prompt_length)
    if axis is None or named is None:
        return []
    rows = operand.shape[axis]
    if len(named) == rows:
        return []
    return [p for p in named if not first <= p < first + rows]
