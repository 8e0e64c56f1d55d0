"""Serving one hook visit: every waiting request's op on its own rows, alone or together.

Pure torch over plain data (a `StepLayout`, the step's wants, the value as the hook saw it):
nothing here knows the engine, so each piece is tested with small tensors. Edits are written
into the engine's tensors in place (`tokenspan.widen`), only on the request's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from operator import attrgetter
from typing import Any, Protocol, cast

import numpy as np
import torch
from tokenspan import ReadMode, RunRead, Selection, Span, StepLayout, lend, narrow, widen
from tokenspan import token_axis as axis_along_tokens
from tokenspan.tree import iter_leaves
from vllm_envoys import Step, Value
from vllm_envoys.pattern import Pattern

from vllm_runner.ops import Call, CallContext, EditOp, Op, RowOp, Save, with_rows_kept
from vllm_runner.ops.checks import (
    finite_on_the_host,
    non_finite_counts,
    non_finite_each,
    non_finite_error,
    refuse_non_finite,
)
from vllm_runner.ops.reads import RowResults
from vllm_runner.ops.wants import Want, passed_over
from vllm_runner.runtime.key_history import KeyHistory, reads_pattern
from vllm_runner.runtime.pattern_edits import EditedPatterns, is_pattern
from vllm_runner.saves.arena import row_index
from vllm_runner.saves.recorded import GroupRecord, offsets_in
from vllm_runner.saves.store import SaveStore
from vllm_runner.saves.unread_checks import UnreadChecks

#: One planned read of a group and each piece's owner: (program id, first position).
PlannedRead = tuple[RunRead, list[tuple[str, int]]]


@dataclass
class SelectedRows:
    """The rows a group's filtered `Save` keeps this step (`_save_selected_together`), worked out
    at its first visit: their slab rows (an index, moved to the value's device once), each
    run's owner (program id, first position) and size, and the members that keep none."""

    index: torch.Tensor
    owners: list[tuple[str, int]]
    sizes: list[int]
    keep_none: list[Want]


class OpGroup(list[Want]):
    """The wants of one op of one program this step (requests running the same program), and
    what is made at the group's first visit and kept for the rest of the step (a group acting at
    every layer visits as many locations as there are layers, with the same rows): `reads`, how
    a save reads them all, `record`, where it keeps what it read (`saves.recorded`), and
    `selection`, their rows in the step."""

    __slots__ = ("kept", "prompt_lengths", "reads", "record", "selection")

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[PlannedRead] | None = None
        self.record: GroupRecord | None = None
        self.selection: Selection | None = None
        self.prompt_lengths: tuple[int, ...] | None = None
        self.kept: SelectedRows | None = None

    def selected(self, layout: StepLayout) -> Selection:
        """The members' rows in `layout` (the step's), made at the first visit."""
        if self.selection is None:
            self.selection = layout.select([want.request_id for want in self])
        return self.selection

    def selected_prompt_lengths(self, layout: StepLayout) -> tuple[int, ...]:
        """Each selected member's prompt length, in the selection's (slab) order."""
        if self.prompt_lengths is None:
            lengths = {want.request_id: want.step.prompt_length for want in self}
            self.prompt_lengths = tuple(lengths[str(key)] for key in self.selected(layout).keys)
        return self.prompt_lengths


@dataclass(frozen=True)
class Visits:
    """The rows of one kind of visit this step (tokens, or sampled rows) and who waits there:
    per canonical location, the groups of wants, one group per op of one program."""

    layout: StepLayout
    wants: dict[str, list[OpGroup]] = field(default_factory=dict)


class LogitLens(Protocol):
    """`(rows, top_k) -> (probabilities, tokens)`: the model's next-token top-k of residual
    rows `[1, tokens, hidden]`, each `[tokens, top_k]`."""

    def __call__(self, rows: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class Services:
    """What ops use while they serve: where saves go, the lens, the read mode of `Call`s, a
    skipped layer's input rows within one forward (per program id and layer), and the keys
    each request's patterns need from earlier steps."""

    store: SaveStore
    lens: LogitLens
    reads: ReadMode = "lease"
    keeps_saves: bool = True
    skipped: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    keys: KeyHistory = field(default_factory=KeyHistory)
    patterns: EditedPatterns = field(default_factory=EditedPatterns)
    #: The step's token ids, one per row of the slab, where an op with `tokens=` needs them
    #: (read at the model's embedding: `Runtime`), else `None`.
    token_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class Visit:
    """One request's op at one hook visit: what `Op.serve` works on."""

    want: Want
    value: Value
    raw: Any  # what the hook saw (made whole under tensor parallelism)
    rows: Any  # the request's rows of `raw`
    layout: StepLayout
    token_axis: int | None
    services: Services

    @property
    def location(self) -> str:
        """The canonical location visited."""
        return self.value.location

    @property
    def device(self) -> torch.device:
        """Where the engine's rows are (what an op's results with no rows are made on)."""
        return _device_of(self.raw)

    def read(self) -> torch.Tensor:
        """The request's value as read (a private copy); a pattern the request edited earlier
        in this step as edited (`pattern_edits`)."""
        patterns = self.services.patterns
        if patterns.active and is_pattern(self.value) and (
                edited := patterns.pending(self.want.program_id, self.value)) is not None:
            return edited.clone()
        return self.value.read(self.rows, self.want.step)

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        """The value over rows `start:stop` of the request's (offsets in its span), a private
        copy of those rows only: read from them alone where the value is row by row, else cut
        from the whole read (an attention pattern's rows need every key)."""
        codec = self.value.eproperty.codec
        if self.token_axis is None or codec is None or not codec.rowwise:
            axis = self.token_axis if self.token_axis is not None else 0
            return self.read().narrow(axis, start, stop - start).clone()
        span = self.want.span
        rows = narrow(self.raw, Span(span.start + start, span.start + stop), self.layout)
        return self.value.read(rows, self.want.step)

    @property
    def fill(self) -> float | None:
        """What pads this value's rows of different steps to one width (a pattern's masked
        entry), or `None` for a value whose rows all have one width."""
        codec = self.value.eproperty.codec
        return codec.fill() if isinstance(codec, Pattern) else None

    def write(self, edited: torch.Tensor) -> None:
        """Write the request's edited value into the engine's rows (an edited pattern is kept
        for the layer's output instead: `pattern_edits`)."""
        if is_pattern(self.value):
            self.services.patterns.edit(self, edited)
            return
        widen(self.raw, self.want.span, self.layout,
              self.value.write(self.rows, edited, self.want.step))

    def write_if_finite(self, edited: torch.Tensor, what: str) -> None:
        """Write the request's edited value unless it holds NaN or infinity, which fails the
        request instead, naming `what` made it. Checked on the device, and the rows written
        only if it passed: the store reads the answer later (`unread_checks`), so the host
        does not wait for the device here. On the logits, where `-inf` is allowed, the answer
        is read at once. An edited pattern is checked where its output is written."""
        if is_pattern(self.value):
            self.services.patterns.edit(self, edited)
            return
        if self.location == "logits" or self.token_axis is None:
            refuse_non_finite(edited, what, self.location)
            self.write(edited)
            return
        new_rows = self.value.write(self.rows, edited, self.want.step)  # a wrong shape: said
        written_rows, checks = _checked_rows(
            [edited], [(self.want, edited.shape[self.token_axis], edited.numel(), what)],
            self.value, self.token_axis, self.device)
        widen(self.raw, self.want.span, self.layout, new_rows, written_rows=written_rows)
        if checks is not None:
            self.services.store.check_later(checks)


def token_axis_of(value: Value) -> int | None:
    """The axis of the value (as read) that runs along tokens, if it has one: a pattern's
    query axis (one row per position, each against every key so far)."""
    layout = value.eproperty.layout
    for name in ("tokens", "query"):
        if name in layout:
            return layout.index(name)
    return None


def serve(value: Value, raw: Any, visits: Visits, services: Services) -> None:
    """Run every op waiting at `value`'s location on its requests' rows: groups of requests
    running the same save or edit together where that is the same, the rest one by one."""
    layout = visits.layout
    token_axis = token_axis_of(value)
    for members in visits.wants[value.location]:
        if len(members) > 1 and serve_together(value, raw, members, layout, token_axis,
                                               services):
            continue
        for want in members:
            serve_one(want, value, raw, layout, token_axis, services)


def failed_check(op: Op, store: SaveStore) -> Callable[[str], bool]:
    """How `op` asks whether a program failed: an edit reads the program's unread finiteness
    checks first (none is served after a refused one); a read does not wait for them."""
    return store.failed if op.edits else store.failed_so_far


def serve_one(want: Want, value: Value, raw: Any, layout: StepLayout, token_axis: int | None,
              services: Services) -> None:
    """Run one request's op on its own rows; a failure fails that request only."""
    store = services.store
    if passed_over(want, value, failed_check(want.op, store)):
        return  # e.g. a value this step cannot serve; a program failed earlier
    try:
        rows = narrow(raw, want.span, layout)
        if reads_pattern(value):  # the keys of every earlier position join the step's
            rows = services.keys.with_earlier_keys(want.program_id, value,
                                                   want.span.first_position, rows)
            if want.op.edits:  # and the values, for the edited attention (`pattern_edits`)
                services.patterns.keep_values(want.program_id, value,
                                              want.span.first_position, rows, want.step)
        want.op.serve(Visit(want, value, raw, rows, layout, token_axis, services))
    except Exception as error:  # one request's failure must not stop the engine
        _fail(want, value, error, store)


def _fail(want: Want, value: Value, error: BaseException, store: SaveStore) -> None:
    """Fail `want`'s program with `error`, naming its op and the location."""
    store.fail(want.program_id, failure_message(want, value, error))


def failure_message(want: Want, value: Value, error: BaseException) -> str:
    """What a request's error says when `error` failed its op at `value`."""
    return (f"{want.op.kind} at {value.location}: {type(error).__name__}: {error}"
            f"{want.op.failure_detail(error)}")


def serve_together(value: Value, raw: Any, members: OpGroup, layout: StepLayout,
                   token_axis: int | None, services: Services) -> bool:
    """Serve a group of requests running the same op with one read (and one write) per run of
    adjacent rows instead of one per request; `False` leaves them to `serve_one`, which also
    gives each request its own error if something fails.

    Per-request reads cost more than the copies themselves once a step holds dozens of requests
    (on a GPU the step is a few milliseconds). Only for values read row by row
    (`Codec.rowwise`) and ops that say they can be (`Op.shares_rows`): saves and lenses with no
    `positions` or `steps`, edits with or without them, `rowwise` calls; and plain calls, whose
    functions run request by request between one read and one write (`_call_each`)."""
    op = members[0].op
    codec = value.eproperty.codec
    if token_axis is None or codec is None or not codec.rowwise \
            or getattr(op, "tokens", None) is not None:  # token filters: one by one
        return False
    return op.serve_group(_Together(value, raw, members, layout, token_axis, services))


@dataclass(slots=True)
class _Together:
    """One group's visit as each kind of op serves it together (`ops.GroupServer`); made at
    every visit of every group, so it is kept lean (slots, not frozen: a fifth of the cost)."""

    value: Value
    raw: Any
    members: OpGroup
    layout: StepLayout
    token_axis: int
    services: Services

    def _every_row_alike(self, op: Op) -> bool:
        """Whether every member's rows are served alike: the op treats each row the same
        (`Op.shares_rows`), no member's program has failed, and every member is served at this
        step."""
        store = self.services.store
        return (op.shares_rows()
                and not (store.may_have_failed and any(map(
                    failed_check(op, store), (want.program_id for want in self.members))))
                and _served_at_every_step(self.value, self.members))

    def save(self, op: Save) -> bool:
        services = self.services
        if op.filtered:
            return not services.keeps_saves or _save_selected_together(
                op, self.value, self.raw, self.members, self.layout, self.token_axis, services)
        return self._every_row_alike(op) and (not services.keeps_saves or _save_together(
            self.value, self.raw, self.members, self.layout, self.token_axis, services.store))

    def results(self, op: RowResults) -> bool:
        if op.filtered:
            return _results_selected_together(op, self.value, self.raw, self.members,
                                              self.layout, self.token_axis, self.services)
        return self._every_row_alike(op) and _results_together(
            op, self.value, self.raw, self.members, self.layout, self.token_axis, self.services)

    def edit(self, op: EditOp) -> bool:
        return self._every_row_alike(op) and _edit_together(
            op, self.value, self.raw, self.members, self.layout, self.token_axis,
            self.services.store)

    def call(self, op: Call) -> bool:
        if op.saves is not None:
            return False  # its results are kept request by request (`Call.keep_results`)
        if not op.rowwise:
            return _call_each(op, self.value, self.raw, self.members, self.layout,
                              self.token_axis, self.services)
        return self._every_row_alike(op) and _call_together(
            op, self.value, self.raw, self.members, self.layout, self.token_axis, self.services)


def _save_together(value: Value, raw: Any, members: OpGroup, layout: StepLayout,
                   token_axis: int, store: SaveStore) -> bool:
    """One read per planned run of rows (`tokenspan.Selection.reads`), kept in the group's record
    of the step (`saves.recorded`: each member's rows are cut out when taken)."""
    step = members[0].step  # rowwise values serve every step alike
    plan = _reading_plan(members, layout)
    try:
        reads = [value.read(narrow(raw, run.span, layout), step) for run, _ in plan]
    except Exception:
        return False
    group = members.record
    if group is None:
        group = members.record = store.start_record(plan, token_axis, members[0].op)
    if group.record.axis == token_axis:
        store.record(group, value.location, reads)
        return True
    for (run, owners), whole in zip(plan, reads, strict=True):  # another axis than its record's
        store.save_rows(value.location, token_axis, owners, run.pieces(whole, token_axis))
    return True


def _save_selected_together(op: Save, value: Value, raw: Any, members: OpGroup,
                            layout: StepLayout, token_axis: int, services: Services) -> bool:
    """A `Save` with `positions` or `steps` on a group: the rows its members keep
    (`RowOp.selected_runs`) taken out of the step with one gather, read, and each member's runs
    kept as pieces of that (a probe of the prompt's last token at every layer of 64 requests:
    one gather a layer, not 64 reads); a member that keeps no row is served alone the first
    time (`Save.serve` keeps an empty piece). `False` (the gather or read failed) leaves them
    to `serve_one`."""
    kept = _group_selected_rows(op, value, members, services.store)
    if kept is None:
        return False
    if kept.owners:
        try:
            gathered = _read_kept(value, raw, members, kept, layout)
        except Exception:
            return False
        services.store.save_rows(value.location, token_axis, kept.owners,
                                 list(gathered.split(kept.sizes, token_axis)))
    _serve_keeping_none(kept, value.location, value, raw, layout, token_axis, services)
    return True


def _results_selected_together(op: RowResults, value: Value, raw: Any, members: OpGroup,
                               layout: StepLayout, token_axis: int, services: Services) -> bool:
    """A `RowResults` op with `positions` or `steps` on a group (the logit lens at each
    prompt's last token): the rows its members keep taken out of the step with one gather and
    computed once (one pass over the unembedding's or the encoder's weights for all of them,
    where each request made its own), each member's runs kept as pieces of the results; a
    member that keeps no row is served alone the first time (its empty results). `False` leaves
    them to `serve_one`."""
    kept = _group_selected_rows(op, value, members, services.store)
    if kept is None:
        return False
    names = op.saved_names(value.location)
    if kept.owners and (services.keeps_saves or op.EVERY_RANK):
        try:
            results = op.row_results(_read_kept(value, raw, members, kept, layout), services)
        except Exception:
            return False
        if services.keeps_saves:
            for name, result in zip(names, results, strict=True):
                services.store.save_rows(name, 1, kept.owners, [
                    piece.unsqueeze(0) for piece in result.split(kept.sizes)])
    _serve_keeping_none(kept, names[0], value, raw, layout, token_axis, services)
    return True


def _group_selected_rows(op: RowOp, value: Value, members: OpGroup, store: SaveStore
                         ) -> SelectedRows | None:
    """The rows a group's filtered op keeps this step, worked out at its first visit (`None`
    where the value is not served at every step alike)."""
    if not _served_at_every_step(value, members):
        return None
    if members.kept is None:
        members.kept = _selected_rows(op, [want for want in members
                                           if not passed_over(want, value, store.failed_so_far)])
    return members.kept


def _read_kept(value: Value, raw: Any, members: OpGroup, kept: SelectedRows,
               layout: StepLayout) -> torch.Tensor:
    """The value at the rows `kept` (one gather of each of the hook's tensors, then the read)."""
    if kept.index.device != (device := _device_of(raw)):
        kept.index = kept.index.to(device, non_blocking=True)
    return value.read(_rows_of(raw, kept.index, layout), members[0].step)


def _serve_keeping_none(kept: SelectedRows, name: str, value: Value, raw: Any, layout: StepLayout,
                        token_axis: int, services: Services) -> None:
    """The members that keep no row this step served alone until they have saved under `name`
    (their op keeps one empty piece, so the name comes back; with nothing kept there is
    nothing to compute either)."""
    if not services.keeps_saves:
        return
    for want in kept.keep_none:
        if not services.store.has_saves(want.program_id, name):
            serve_one(want, value, raw, layout, token_axis, services)


def _selected_rows(op: RowOp, wants: list[Want]) -> SelectedRows:
    """`SelectedRows` of `wants` running `op`."""
    firsts: list[int] = []  # each run's first slab row
    owners: list[tuple[str, int]] = []
    sizes: list[int] = []
    keep_none = []
    for want in wants:
        span = want.span
        runs = op.selected_runs(span.first_position, len(span), want.step.prompt_length)
        if not runs:
            keep_none.append(want)
        for start, stop in runs:
            firsts.append(span.start + start)
            owners.append((want.program_id, span.first_position + start))
            sizes.append(stop - start)
    return SelectedRows(torch.from_numpy(row_index(firsts, sizes)), owners, sizes, keep_none)


def _device_of(raw: Any) -> torch.device:
    """The device of the first tensor of what a hook saw (a tensor, or tensors nested in
    tuples, lists and dicts)."""
    if isinstance(raw, torch.Tensor):
        return raw.device
    return next(leaf.device for _, leaf in iter_leaves(raw) if isinstance(leaf, torch.Tensor))


def _rows_of(raw: Any, index: torch.Tensor, layout: StepLayout) -> Any:
    """The rows `index` (slab rows) of every per-token tensor of what a hook saw (a tensor, or
    a tuple of them: vLLM's stream in two halves), in that order."""
    if isinstance(raw, torch.Tensor):
        axis = axis_along_tokens(raw, layout)
        return raw if axis is None else raw.index_select(axis, index)
    if isinstance(raw, (tuple, list)):
        items = [_rows_of(item, index, layout) for item in raw]
        return type(raw)(*items) if hasattr(raw, "_fields") else type(raw)(items)
    return raw


def _results_together(op: RowResults, value: Value, raw: Any, members: OpGroup,
                      layout: StepLayout, token_axis: int, services: Services) -> bool:
    """One computation of a `RowResults` op (a lens: the final norm, the unembedding, the
    top-k; an SAE's encoder and top-k) over the rows of every planned read, joined, instead of
    one per request (each a pass over the weights); its results kept in the group's record of
    the step, under their names (`saves.recorded`)."""
    if not services.keeps_saves and not op.EVERY_RANK:
        return True  # only the rank that keeps saves computes
    step = members[0].step
    plan = _reading_plan(members, layout)
    members_only, kept = _without_gaps(plan)
    try:
        reads = [value.read(narrow(raw, run.span, layout), step) for run, _ in plan]
        joined = reads[0] if len(reads) == 1 else torch.cat(reads, token_axis)
        if kept is not None:  # the rows of requests between members are not projected
            joined = joined.index_select(token_axis, torch.from_numpy(kept).to(
                joined.device, non_blocking=True))
        results = op.row_results(joined, services)
    except Exception:
        return False
    if not services.keeps_saves:
        return True
    store = services.store
    group = members.record
    if group is None:
        group = members.record = store.start_record(members_only, 1, op)
    ends = list(accumulate(sum(run.sizes) for run, _ in members_only))
    for name, result in zip(op.saved_names(value.location), results, strict=True):
        store.record(group, name, [result[end - sum(run.sizes):end].unsqueeze(0)
                                   for (run, _), end in zip(members_only, ends, strict=True)])
    return True


def _without_gaps(plan: list[PlannedRead]) -> tuple[list[PlannedRead], np.ndarray | None]:
    """`plan` as if each read held its members' rows only, and the index of those rows in the
    joined reads (`None` where no read holds other rows: a read over the whole step takes the
    rows of requests between its members too)."""
    if all(len(run.chosen) == len(run.sizes) for run, _ in plan):
        return plan, None
    compact: list[PlannedRead] = []
    firsts: list[int] = []  # each member's first row in the joined reads
    base = 0
    for run, owners in plan:
        starts = offsets_in(run)
        sizes = tuple(run.sizes[chosen] for chosen in run.chosen)
        compact.append((RunRead(run.span, sizes, tuple(range(len(sizes))), run.keys), owners))
        firsts += [base + starts[chosen] for chosen in run.chosen]
        base += len(run.span)
    return compact, row_index(firsts, [size for run, _ in compact for size in run.sizes])


def _reading_plan(members: OpGroup, layout: StepLayout) -> list[PlannedRead]:
    """Where to read a group's value this step, and each piece's owner (program id, first
    position), made at the group's first visit and kept with it."""
    if members.reads is None:
        by_request = {want.request_id: want for want in members}
        members.reads = [
            (run, [(by_request[str(key)].program_id, by_request[str(key)].span.first_position)
                   for key in run.keys])
            for run in layout.select(list(by_request)).reads()]
    return members.reads


def _edit_together(op: EditOp, value: Value, raw: Any, members: OpGroup, layout: StepLayout,
                   token_axis: int, store: SaveStore) -> bool:
    """One read, edit and write per run of adjacent rows (rows the op does not keep, by its
    `positions` and `steps`, written back as read; a run it keeps no row of is left alone);
    nothing is written unless every run was edited. Each member's rows are written only where
    its edit is free of NaN and infinity, counted on the device (`_checked_rows`: the host
    does not wait; a member refused fails alone once the store reads the counts); on the host
    the runs are checked first, and members counted only if one is not finite; on the logits,
    where `-inf` is allowed, a refusal is known at once and serves them one by one."""
    step = members[0].step
    selection = members.selected(layout)
    kept = None
    if op.filtered:
        kept = op.selected_rows(selection.positions, selection.per_row(
            torch.tensor(members.selected_prompt_lengths(layout), dtype=torch.long)))
    what = f"the {op.kind}"
    edited_runs: list[tuple[int, Span, Any, torch.Tensor]] = []  # run's index, rows, edit
    at = 0
    try:
        if not op.same_on_every_row(len(value.eproperty.layout), token_axis):
            return False  # a tensor per position: each request's own positions
        for index, (start, stop) in enumerate(selection.runs):
            run = Span(start, stop)
            keep = None if kept is None else kept[at:at + len(run)]
            at += len(run)
            if keep is not None and not keep.any():
                continue
            rows = narrow(raw, run, layout)
            current = value.read(rows, step)
            edited = op.edited(current, value.eproperty.layout)
            if keep is not None:
                edited = with_rows_kept(edited, current, keep, token_axis)
            if value.location == "logits":
                refuse_non_finite(edited, what, value.location)
            edited_runs.append((index, run, rows, edited))
        written_rows = checks = None
        edits = [edited for _, _, _, edited in edited_runs]
        if edits and value.location != "logits" and not finite_on_the_host(edits):
            written_rows, checks = _checked_rows(edits, _run_members(
                members, selection, {index for index, _, _, _ in edited_runs},
                edits[0].numel() // len(edited_runs[0][1]), what), value, token_axis,
                _device_of(raw))
        writes = []
        first = 0  # each run's first row among the edited runs' rows
        for _, run, rows, edited in edited_runs:
            writes.append((run, value.write(rows, edited, step),
                           None if written_rows is None else written_rows[first:first + len(run)]))
            first += len(run)
    except Exception:
        return False  # nothing written yet: served one by one, each with its own error
    if checks is not None:
        store.check_later(checks)
    _write_runs(writes, raw, layout, members, f"{op.kind} at {value.location}", store)
    return True


def _run_members(members: OpGroup, selection: Selection, runs: Collection[int] | None,
                 row_size: int, what: str) -> list[tuple[Want, int, int, str]]:
    """The members whose rows the runs of `selection` numbered in `runs` hold (`None`: every
    run), in row order, each with its count of rows, the size of its part of the edit (rows of
    `row_size` values) and `what` made it (`_checked_rows`' owners). A member's rows are
    adjacent: never split between runs."""
    by_id = {want.request_id: want for want in members}
    owners = iter(zip([by_id[str(key)] for key in selection.keys], selection.counts,
                      strict=True))
    found: list[tuple[Want, int, int, str]] = []
    for index, (start, stop) in enumerate(selection.runs):
        rows = stop - start
        while rows > 0:
            want, count = next(owners)
            rows -= count
            if runs is None or index in runs:
                found.append((want, count, count * row_size, what))
    return found


def _write_runs(writes: Sequence[tuple[Span, Any, torch.Tensor | None]], raw: Any,
                layout: StepLayout, members: list[Want], what: str, store: SaveStore) -> None:
    """Write each run's new rows into the engine's (only those where its `written_rows` are
    true, if it has them); a write that fails (after others may have landed) fails every
    member."""
    try:
        for run, new_rows, written_rows in writes:
            widen(raw, run, layout, new_rows, written_rows=written_rows)
    except Exception as error:
        for want in members:
            store.fail(want.program_id, f"{what}: {type(error).__name__}: {error}")


def _call_together(op: Call, value: Value, raw: Any, members: OpGroup, layout: StepLayout,
                   token_axis: int, services: Services) -> bool:
    """A `rowwise` call: the function run once on the rows of every member (its runs of
    adjacent rows joined along the tokens axis), its result cut back into the runs and written;
    nothing is written unless the call returned and every row is finite (`False`: each
    request is run alone, and only those at fault fail)."""
    step = members[0].step
    selection = members.selected(layout)
    runs = [Span(start, stop) for start, stop in selection.runs]
    mode = op.reads or services.reads
    try:
        engine_rows = [narrow(raw, run, layout) for run in runs]
        with torch.inference_mode(False):  # the copy counts its in-place edits (a lease)
            reads = [value.read(rows, step) for rows in engine_rows]
            joined = reads[0] if len(reads) == 1 else torch.cat(reads, token_axis)
        lent = lend(joined, "copy" if mode == "copy" else "lease", owned=True)
        context = CallContext(value.location, selection, None,
                              members.selected_prompt_lengths(layout))
        edited = lent.written(op.run_user_code(lent.value, context))
        if edited is None:
            return True  # untouched: nothing is written
        if edited.shape != joined.shape:
            return False
        written_rows = checks = None
        if value.location == "logits":  # `-inf` allowed: answered on the host
            refuse_non_finite(edited, "the function", value.location)
        elif not finite_on_the_host([edited]):  # each member's rows counted on their own
            what = "the function" if edited is lent.value else "the function's result"
            written_rows, checks = _checked_rows([edited], _run_members(
                members, selection, None, edited.numel() // edited.shape[token_axis], what),
                value, token_axis, _device_of(raw))
        pieces = edited.split([len(run) for run in runs], token_axis)
        firsts = [0, *accumulate(len(run) for run in runs)]  # each run's first joined row
        writes = [(run, value.write(rows, piece, step),
                   None if written_rows is None else written_rows[first:first + len(run)])
                  for run, rows, piece, first in zip(runs, engine_rows, pieces, firsts,
                                                     strict=False)]
    except Exception:
        return False  # nothing written yet
    if checks is not None:
        services.store.check_later(checks)
    _write_runs(writes, raw, layout, members, f"{op.kind} at {value.location}", services.store)
    return True


def _call_each(op: Call, value: Value, raw: Any, members: OpGroup, layout: StepLayout,
               token_axis: int, services: Services) -> bool:
    """Plain (not `rowwise`) calls of a group: each member's own function on a private copy of
    its own rows, as `serve_one` runs it, but with the members' rows read once per run of
    adjacent rows, every result checked for NaN and infinity with one answer from the device
    for all, and written once per run of adjacent edited rows.

    Reading, checking and writing back cost two thirds of a call's host time request by request
    (`tap_cost.py --op call`), and each request's check waited for the device. A member whose
    function raises, or whose result is not finite, fails alone with nothing written; a result
    of another shape, dtype or device is written (or refused) on its own. `False` (the view
    mode, where each function gets the engine's own rows, or a read that fails) leaves the
    members to `serve_one`."""
    store = services.store
    mode = op.reads or services.reads  # one program: every member's op has the same fields
    if mode == "view":
        return False
    if store.may_have_failed or not _served_at_every_step(value, members):
        live = [want for want in members if not passed_over(want, value, store.failed)]
    else:  # the usual step: every member is served, asked once for all
        live = list(members)
    live.sort(key=_slab_order)
    try:
        with torch.inference_mode(False):  # private copies that count their in-place edits
            copies = private_copies([
                piece for run, whole in _read_runs(value, raw, live, layout)
                for piece in whole.split([len(want.span) for want in run], token_axis)])
    except Exception:
        return False
    edits: list[tuple[Want, torch.Tensor, str]] = []
    for want, copy in zip(live, copies, strict=True):
        mine = cast(Call, want.op)  # the request's own function (unpickled per request)
        try:
            lent = lend(copy, "copy" if mode == "copy" else "lease", owned=True)
            length = want.step.prompt_length
            edited = lent.written(mine.run_user_code(
                lent.value, CallContext(value.location, want.span, length, (length,))))
        except Exception as error:  # the user's function: its request fails alone
            _fail(want, value, error, store)
            continue
        if edited is None:
            continue  # untouched: nothing is written
        what = "the function" if edited is lent.value else "the function's result"
        if (edited.shape, edited.dtype, edited.device) == (copy.shape, copy.dtype, copy.device):
            edits.append((want, edited, what))
        else:  # refused, or converted as it is written, by the one-request path
            _write_one(want, value, raw, edited, what, layout, store)
    _write_checked(edits, value, raw, layout, token_axis, store)
    return True


#: torch's multi-tensor clone, where this torch has it (looked up once, not at every step).
_CLONE_ALL: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]] | None = getattr(
    torch, "_foreach_clone", None)


def private_copies(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of each piece in memory of its own (a function handed one cannot reach another
    request's rows through its storage), made by one multi-tensor kernel where a `clone` each
    would launch one a request. `_foreach_clone` allocates them in C++, faster than an
    `empty_like` each and `_foreach_copy_`, and several times faster than a `clone` each
    (`benchmarks/gpu/private_copies.py`). A torch without that op (it is
    recent) makes them as before."""
    if not pieces:
        return []
    if _CLONE_ALL is not None:
        return list(_CLONE_ALL(pieces))
    copies = [torch.empty_like(piece) for piece in pieces]
    torch._foreach_copy_(copies, pieces)
    return copies


def _read_runs(value: Value, raw: Any, wants: list[Want], layout: StepLayout
               ) -> list[tuple[list[Want], torch.Tensor]]:
    """The value over each run of adjacent requests among `wants` (in slab order), one read a
    run."""
    runs = _adjacent(wants)
    return [(run, value.read(narrow(raw, Span(run[0].span.start, run[-1].span.stop), layout),
                             run[0].step)) for run in runs]


#: A want's place in the slab (its rows' first), as a C-level getter: sorting dozens of wants
#: a step.
_slab_order = attrgetter("span.start")


def _adjacent(wants: list[Want]) -> list[list[Want]]:
    """`wants` (in slab order) cut into runs whose rows follow on from each other."""
    runs: list[list[Want]] = []
    for want in wants:
        if runs and runs[-1][-1].span.stop == want.span.start:
            runs[-1].append(want)
        else:
            runs.append([want])
    return runs


def _write_checked(edits: list[tuple[Want, torch.Tensor, str]], value: Value, raw: Any,
                   layout: StepLayout, token_axis: int, store: SaveStore) -> None:
    """Write the edits that are free of NaN and infinity, one write per run of adjacent rows,
    and fail the requests of the others alone. The runs' edits are joined first and checked
    as they are written (`_checked_rows`: each request counted on its own rows, answered on
    the device, each row written only where its request passed), so the host never waits for
    the device here and joins each run once; the store reads the answers later
    (`unread_checks`). On the logits, where `-inf` is allowed, the host reads the answers at
    once."""
    if not edits:
        return
    if value.location == "logits":
        counts = non_finite_each([edited for _, edited, _ in edits], value.location)
        for (want, edited, what), bad in zip(edits, counts, strict=True):
            if bad:
                _fail(want, value, non_finite_error(bad, edited.numel(), what), store)
        edits = [edit for edit, bad in zip(edits, counts, strict=True) if not bad]
    wants = [want for want, _, _ in edits]
    try:
        runs: list[tuple[Span, torch.Tensor, Step]] = []  # each run's rows, its edit, its step
        start = 0
        for run in _adjacent(wants):
            pieces = [edited for _, edited, _ in edits[start:start + len(run)]]
            start += len(run)
            runs.append((Span(run[0].span.start, run[-1].span.stop), pieces[0] if len(
                pieces) == 1 else torch.cat(pieces, token_axis), run[0].step))
        written_rows = checks = None
        if value.location != "logits":
            written_rows, checks = _checked_rows(
                [edited for _, edited, _ in runs],
                [(want, edited.shape[token_axis], edited.numel(), what)
                 for want, edited, what in edits], value, token_axis, _device_of(raw))
        writes = []
        row = 0  # the run's first row among the edits' rows
        for span, edited, step in runs:
            rows = None if written_rows is None else written_rows[row:row + len(span)]
            row += len(span)
            writes.append((span, value.write(narrow(raw, span, layout), edited, step), rows))
    except Exception:  # nothing written yet: each request on its own, with its own error
        for want, edited, what in edits:
            _write_one(want, value, raw, edited, what, layout, store)
        return
    if checks is not None:
        store.check_later(checks)
    _write_runs(writes, raw, layout, wants, f"call at {value.location}", store)


def _checked_rows(edits: list[torch.Tensor], owners: list[tuple[Want, int, int, str]],
                  value: Value, token_axis: int, device: torch.device
                  ) -> tuple[torch.Tensor | None, UnreadChecks | None]:
    """Whether each row of `edits` (joined along `token_axis`; `device`: the engine rows')
    may be written — its request's part is free of NaN and infinity, counted on the device —
    and the counts, for the store to read later and fail whom they refuse
    (`SaveStore.check_later`, once the writes are made). An edit may hold several requests'
    rows (an edit of a run of adjacent rows): `owners` are the requests whose rows the edits
    hold, in order, each with its count of rows, the size of its part and what made it.
    `(None, None)` where the answers are on the host already and every edit passed: there is
    nothing to hold back."""
    counted = non_finite_counts(edits, token_axis, [rows for _, rows, _, _ in owners])
    if counted is None:
        return None, None
    bad, passed_rows = counted
    described = [(want, size, what) for want, _, size, what in owners]
    checks = UnreadChecks([want.program_id for want, _, _ in described], bad,
                          partial(_non_finite_failure, described, value))
    return passed_rows.to(device, non_blocking=True), checks


def _non_finite_failure(described: list[tuple[Want, int, str]], value: Value, index: int,
                        bad: int) -> str:
    """Why the request of `described[index]` (its want, its edit's size and what made it)
    failed, its edit holding `bad` NaN or infinite values."""
    want, size, what = described[index]
    return failure_message(want, value, non_finite_error(bad, size, what))


def _write_one(want: Want, value: Value, raw: Any, edited: torch.Tensor, what: str,
               layout: StepLayout, store: SaveStore) -> None:
    """Check one request's edit and write it into its rows, as `Call.serve` does; a failure
    fails that request only."""
    try:
        refuse_non_finite(edited, what, value.location)
        widen(raw, want.span, layout,
              value.write(narrow(raw, want.span, layout), edited, want.step))
    except Exception as error:
        _fail(want, value, error, store)


def _served_at_every_step(value: Value, members: list[Want]) -> bool:
    """Whether `value` can be served at each member's step. Most values say so once, whatever
    the step; only a step-dependent reason (a callable) is asked member by member."""
    if not callable(value.eproperty.unavailable):
        return value.eproperty.unavailable is None
    return all(value.reason(want.step) is None for want in members)
