"""`Call`: the user's own function on a request's value at each step, run in the worker, and
the context it is handed (`CallContext`)."""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
from tokenspan import READ_MODES, ReadMode, Selection, Span, lend

from vllm_runner.ops.base import GroupServer, Op
from vllm_runner.ops.checks import (
    check_result_name,
    op_name,
    refuse_non_finite,
)

if TYPE_CHECKING:
    from vllm_runner.runtime.row_serving import Visit


@dataclass(frozen=True)
class CallContext:
    """What a `Call` function learns about the rows it is given: `location`, `positions` (the
    absolute position of each row in its own request), `prompt_lengths` (the prompt length of
    each row's request) and `prompt_length` (`None` for a `rowwise` call, whose rows may come
    from several requests)."""

    location: str
    _rows: Span | Selection = field(repr=False)
    prompt_length: int | None
    #: The prompt length of each request of `_rows` (one for a span), in slab order.
    _prompt_lengths: tuple[int, ...] = field(default=(), repr=False)

    @cached_property
    def positions(self) -> torch.Tensor:
        """The absolute position of each row (int64), made when first asked for: most
        functions never ask, and a `Call` runs for every request at every step."""
        rows = self._rows
        return rows.positions() if isinstance(rows, Span) else rows.positions

    @cached_property
    def prompt_lengths(self) -> torch.Tensor:
        """The prompt length of each row's request (int64, one per row, made when first asked
        for): `positions >= prompt_lengths` marks the rows of generated tokens, in a `rowwise`
        call too."""
        rows, lengths = self._rows, torch.tensor(self._prompt_lengths, dtype=torch.long)
        return lengths.expand(len(rows)).clone() if isinstance(rows, Span) else \
            rows.per_row(lengths)


@dataclass(frozen=True)
class Call(Op):
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

    `ctx` has `location`, `positions` (absolute position of each row), `prompt_length` and
    `prompt_lengths` (the prompt length again, one per row). The
    function is cloudpickled, so it runs in the worker process(es) — on every rank under tensor
    parallelism, with the whole value — and what it keeps lives there (save values with `Save`).

    `rowwise=True` promises that the function treats every row on its own — row i of what it
    returns (or writes in place) depends on row i of the value only, as an SAE's encoder and
    decoder, a probe or a per-token rule do — and keeps no state of its own per request. Then
    the requests running this same program are handed to it together: one call a step for all
    their rows at the location (a value of row-by-row values only: the residual stream,
    attention and MLP outputs, queries, keys, values, neurons), instead of one call per
    request; `ctx.positions` and `ctx.prompt_lengths` give each row's position and its
    request's prompt length, and `ctx.prompt_length` is `None`. The rows are lent as a private
    copy (a lease, or a copy in `"copy"` mode). Where that call raises or leaves a row not
    finite, the requests are run again one by one, so that only those at fault fail (the
    function then runs twice on their rows). Values that are not row by row (attention
    patterns) are always served per request.

    `saves="name"` makes the function's return value a result to keep rather than a
    replacement: a tensor `[1, rows, ...]` (one row per row it was handed: `ctx.positions`)
    lands in `outputs[i].saved[f"{location}.{name}"]` as a `Save` would keep it — concatenated
    over steps in position order — and a dict of such tensors under
    `f"{location}.{name}.{key}"` (a probe's score per token moves a few bytes instead of the
    residual). In-place edits of the value still land; returning `None` keeps nothing that
    step. Such calls are served request by request.
    """

    kind = "call"

    fn: Any = field(repr=False)
    reads: ReadMode | None = None
    rowwise: bool = False
    saves: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rowwise, bool):
            raise TypeError(f"{op_name(self)}: rowwise must be True or False, not "
                            f"{self.rowwise!r}")
        check_result_name(self, "saves")

    def shares_rows(self) -> bool:
        """Whether the requests running this call are served with one call a step
        (`rowwise=True`, and no results to keep: those are kept request by request)."""
        return self.rowwise and self.saves is None

    def serve_group(self, server: GroupServer) -> bool:
        """Served together as a call."""
        return server.call(self)

    def saved_names(self, location: str) -> tuple[str, ...]:
        """The result's name, where the function returns one tensor (a dict's keys are known
        only when it returns)."""
        return () if self.saves is None else (f"{location}.{self.saves}",)

    def data_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """The function as cloudpickled bytes; a bad read mode is refused here, in the user's
        process."""
        import cloudpickle

        if self.reads is not None and self.reads not in READ_MODES:
            raise ValueError(f"Call(reads={self.reads!r}): the read mode must be one of "
                             f"{', '.join(READ_MODES)} (or None for the engine's)")
        return {**fields, "fn": cloudpickle.dumps(self.fn)}

    @classmethod
    def fields_from_data(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """The function unpickled (in the worker: each request gets its own unless the call is
        `rowwise`); bytes that are no function are refused naming the field."""
        try:
            fn = pickle.loads(fields["fn"])
        except Exception as error:  # unpickling raises whatever the bytes make it raise
            raise ValueError(f"call: fn is not a cloudpickled function ({type(error).__name__}: "
                             f"{error}); send base64.b64encode(cloudpickle.dumps(fn))") from None
        return {**fields, "fn": fn}

    def serve(self, visit: Visit) -> None:
        """Lend the value to the function in the op's read mode and write back what changed."""
        mode = self.reads or visit.services.reads
        lent = None
        if mode == "view" and (view := visit.value.view(visit.rows, visit.want.step)) is not None:
            lent = lend(view, "view")
        if lent is None:  # a copy, or a value not stored as read (lent as a lease)
            # Read outside inference mode, so the copy counts its in-place edits.
            with torch.inference_mode(False):
                value = visit.read()
            lent = lend(value, "copy" if mode == "copy" else "lease", owned=True)
        prompt_length = visit.want.step.prompt_length
        context = CallContext(visit.location, visit.want.span,
                              None if self.rowwise else prompt_length, (prompt_length,))
        result = self.run_user_code(lent.value, context)
        if self.saves is not None:
            self.keep_results(visit, result)
            result = None  # a result, not a replacement: only in-place edits are written
        edited = lent.written(result)
        if edited is None:
            if lent.mode == "view":  # its writes landed already: say so if they broke it
                refuse_non_finite(lent.value, "the function (in view mode: its writes landed)",
                                  visit.location)
            return  # untouched: nothing is written
        visit.write_if_finite(edited, "the function" if edited is lent.value else
                              "the function's result")

    def keep_results(self, visit: Visit, result: Any) -> None:
        """Keep what a `saves` call returned, per position as a `Save` keeps its rows; a result
        of another form fails the request, naming what it should be."""
        if result is None:
            return
        name = f"{visit.location}.{self.saves}"
        found = result.items() if isinstance(result, dict) else [(None, result)]
        rows = len(visit.want.span)
        kept = []
        for key, tensor in found:
            label = name if key is None else f"{name}.{key}"
            if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 \
                    or tensor.shape[0] != 1 or tensor.shape[1] != rows:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else \
                    type(tensor).__name__
                raise ValueError(f"Call(saves={self.saves!r}) returned {shape} for {label}; "
                                 f"return a tensor [1, {rows}, ...] (one row per row handed "
                                 "to the function: ctx.positions) or a dict of them")
            kept.append((label, tensor.detach().clone()))
        if not visit.services.keeps_saves:
            return
        first = visit.want.span.first_position
        for label, tensor in kept:
            visit.services.store.save(visit.want.program_id, label, first, tensor, 1)

    def run_user_code(self, value: torch.Tensor, context: CallContext) -> Any:
        """`fn(value, context)`: the one frame between our code and the user's, which
        `failure_detail` cuts a traceback at."""
        return self.fn(value, context)

    def failure_detail(self, error: BaseException) -> str:
        """The traceback lines of the function's failure below our call into it (the user's own
        code, with its file and line); nothing for an error raised outside the function (its
        result refused), which names what is wrong itself."""
        frames = traceback.extract_tb(error.__traceback__)
        ours = [index for index, frame in enumerate(frames)
                if frame.filename == __file__ and frame.name == "run_user_code"]
        user = frames[ours[-1] + 1:] if ours else []
        if not user:
            return ""
        return "\n" + "".join(traceback.format_list(user)).rstrip()
