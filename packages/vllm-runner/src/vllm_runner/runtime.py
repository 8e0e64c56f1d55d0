"""The worker-side runtime: each step's layout, which requests want which values, the hooks.

Checked against vLLM 0.32's V1 model runner (`GPUModelRunner`, which `CPUModelRunner`
subclasses): the step's request order is `input_batch.req_ids[:num_reqs]` after the runner's own
state update, request i owns rows `query_start_loc.np[i]:[i+1]`, and its first row's absolute
position is `positions[query_start_loc[i]]`.
"""

from __future__ import annotations

import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tokenspan import ReadMode, Span, StepLayout, narrow, widen
from torch import nn
from tpfragments import Fragments
from vllm_envoys import HookArgs, Step, Value, standardize

from vllm_runner.edits import (
    before_the_prompt,
    edit,
    only_kept_rows,
    position_filter,
    refuse_non_finite,
    same_on_every_row,
)
from vllm_runner.groups import cuts, pieces, reading_plan, runs
from vllm_runner.locations import resolve
from vllm_runner.program import READ_ONLY_OPS, program_of
from vllm_runner.settings import read_mode
from vllm_runner.sharded import ShardedValues
from vllm_runner.store import SaveStore

# Values whose rows are the sampled rows (one per request, its last row this step), not the
# step's tokens, served in this order by one hook on the logits processor.
PER_SAMPLED_ROW = ("logits", "next_token_probs")
SAMPLER_HOOK = "logits"
# Ops a group of requests can share one read (and write) for: the same on every row.
TOGETHER = ("save", "add", "set", "scale", "zero", "project_out")


def _hooked_at(location: str) -> str:
    """The location whose hook serves `location` (one hook serves every sampled-row value, so
    reads always follow edits)."""
    return SAMPLER_HOOK if location in PER_SAMPLED_ROW else location


@dataclass(frozen=True)
class CallContext:
    """What a `Call` function learns about the rows it is given."""

    location: str
    positions: torch.Tensor
    prompt_length: int


@dataclass(frozen=True)
class Want:
    """One request waiting for one value this step."""

    key: str
    span: Span
    step: Step
    op: dict[str, Any]


class Group(list):
    """The wants of one op of one program this step (requests running the same program), and
    `plan`: how a save reads them, made at the group's first visit — a group saving every
    layer visits as many locations as there are layers, with the same rows."""

    __slots__ = ("plan",)

    def __init__(self) -> None:
        super().__init__()
        self.plan: list[tuple[Span, list[int], list[int], list[tuple[str, int]]]] | None = None


@dataclass(frozen=True)
class Visits:
    """The rows of one kind of visit this step (tokens, or sampled rows) and who waits there:
    per location, groups of wants, one group per op of one program (`groups.py`)."""

    layout: StepLayout | None
    wants: dict[str, list[Group]]


NOTHING = Visits(None, {})


def _rows(raw: Any) -> int:
    return int(raw.shape[0]) if isinstance(raw, torch.Tensor) else -1


class Runtime:
    """Hooks only what this step's programs name, and runs their ops on their own rows."""

    def __init__(self, model: nn.Module, hf_config: Any, fragments: Fragments | None = None,
                 rank: int = 0, reads: ReadMode = "lease",
                 device_saves_limit: int | None = None) -> None:
        self.reads = read_mode(reads)
        self.device_saves_limit = device_saves_limit
        self.standard = standardize(model, hf_config)
        # Under tensor parallelism every rank runs every op (edits must reach every piece), but
        # only rank 0 keeps saves: the client collects from rank 0.
        self.sharded = ShardedValues(model, fragments or Fragments())
        self.keeps_saves = rank == 0
        self.values = self.standard.values()
        self.store = SaveStore()
        self._resolved: dict[str, list[str]] = {}
        self._hooks: dict[str, Any] = {}
        self._tokens = self._sampled = NOTHING
        self._in_lens = False
        # Within one forward: a skipped layer's input rows, per (request key, layer input).
        self._skipped: dict[tuple[str, str], torch.Tensor] = {}
        # Unpickled `Call` functions per request key (unpickled once, not every step).
        self._functions: dict[str, dict[int, Any]] = {}
        # Requests whose programs were checked against their prompt (at their first step).
        self._checked: set[str] = set()

    def resolve(self, pattern: str) -> list[str]:
        """Canonical locations of a pattern (cached); `LocationError` if it names nothing."""
        found = self._resolved.get(pattern)
        if found is None:
            found = resolve(pattern, self.values, len(self.standard.layers))
            self._resolved[pattern] = found
        return found

    def _locations_of(self, op: dict[str, Any]) -> list[str]:
        """Where an op acts: its location, or for `skip` the layer's input and output."""
        if op["op"] == "skip":
            layer = op["location"]
            return self.resolve(f"{layer}.layer_input") + self.resolve(f"{layer}.layer_output")
        return self.resolve(op["location"])

    # ------------------------------------------------------------------ per step

    def begin_step(self, runner: Any, positions: torch.Tensor) -> None:
        """Read the step's layout from the runner and hook what its programs want."""
        self.store.spill(self.device_saves_limit)  # the last step's saves are all made
        batch = runner.input_batch
        count = batch.num_reqs
        programs = []
        for request_id in batch.req_ids[:count]:
            state = runner.requests.get(request_id)
            params = getattr(state, "sampling_params", None)
            program = program_of(params.extra_args if params is not None else None)
            # A failed program stops where it failed: nothing more is read or written for it.
            if program is not None and not self.store.failed(program["key"]):
                programs.append((request_id, state, program))
        if not programs:
            self._tokens = self._sampled = NOTHING
            self._sync_hooks()
            return
        request_ids = batch.req_ids[:count]
        offsets = runner.query_start_loc.np[: count + 1]
        firsts = positions.index_select(0, torch.as_tensor(offsets[:-1], dtype=torch.long,
                                                           device=positions.device)).tolist()
        layout = StepLayout.from_offsets(request_ids, offsets, firsts,
                                         padded_total=int(positions.shape[0]))
        # The logits have one row per request, its last row this step (no speculative decoding).
        lasts = [first + int(end - start) - 1
                 for first, start, end in zip(firsts, offsets[:-1], offsets[1:], strict=True)]
        sampled = StepLayout.from_counts(request_ids, [1] * count, lasts)
        tokens: dict[str, list[Group]] = defaultdict(list)
        rows: dict[str, list[Group]] = defaultdict(list)
        token_groups: dict[tuple[str, int], Group] = {}
        sampled_groups: dict[tuple[str, int], Group] = {}
        for request_id, state, program in programs:
            key = program["key"]
            span = layout[request_id]
            prompt_length = len(state.prompt_token_ids)
            if key not in self._checked:
                self._checked.add(key)
                if (problem := before_the_prompt(program["ops"], prompt_length)) is not None:
                    self.store.fail(key, problem)
                    continue
            step = Step(span.first_position, len(span), prompt_length)
            last = sampled[request_id]
            # A chunk that ends before the prompt does is not sampled: its logits are dropped.
            is_sampled = last.first_position >= prompt_length - 1
            last_step = Step(last.first_position, 1, prompt_length)
            digest = program.get("digest") or key
            for index, op in enumerate(program["ops"]):
                self._join(token_groups, tokens, (digest, index), Want(key, span, step, op),
                           sampled=False)
                if is_sampled:
                    self._join(sampled_groups, rows, (digest, index),
                               Want(key, last, last_step, op), sampled=True)
        self._tokens = Visits(layout, dict(tokens))
        self._sampled = Visits(sampled, dict(rows))
        self._sync_hooks()

    def _join(self, groups: dict[tuple[str, int], Group], wants: dict[str, list[Group]],
              group: tuple[str, int], want: Want, sampled: bool) -> None:
        """Add `want` to its group: requests running the same program (the same digest) share
        one list per op, registered at the op's locations once, so a step's bookkeeping grows
        with its requests plus its programs' locations, not their product; the group is then
        served with one read or one edit (`groups.py`). Within a program, ops at one location
        keep their order."""
        members = groups.get(group)
        if members is None:
            members = groups[group] = Group()
            for location in self._locations_of(want.op):
                if (location in PER_SAMPLED_ROW) == sampled:
                    wants[location].append(members)
        members.append(want)

    def end_step(self) -> None:
        """Forget the step's token rows (hooks stay installed while programs keep wanting them);
        the sampled rows wait for the runner's `compute_logits`, which follows the forward."""
        self._tokens = NOTHING
        self._skipped.clear()

    # ------------------------------------------------------------------ hooks

    def _sync_hooks(self) -> None:
        """Install hooks for wanted values, remove the rest: unwanted places cost nothing."""
        # An ordered dict, never a set: hooks on one module fire in installation order, and
        # under tensor parallelism every rank must run its gathers in the same order (a set's
        # order follows string hashes, which differ between processes).
        wanted = dict.fromkeys(_hooked_at(loc)
                               for loc in (*self._tokens.wants, *self._sampled.wants))
        for location in [loc for loc in self._hooks if loc not in wanted]:
            self._hooks.pop(location).remove()
        for location in wanted:
            if location not in self._hooks:
                self._hooks[location] = self._install(self.values[location])

    def _install(self, value: Value) -> Any:
        location = value.location
        shard_keys = self.sharded.keys(value)
        if value.side == "input":
            def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                self._visit(location, value, HookArgs(args, kwargs), shard_keys)
            return value.module.register_forward_pre_hook(pre_hook, with_kwargs=True)

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self._visit(location, value, output, shard_keys)
        return value.module.register_forward_hook(hook)

    def _visit(self, location: str, value: Value, raw: Any,
               shard_keys: tuple[str | None, ...] | None) -> None:
        """Serve the step's requests at one hook visit; a sharded value is made whole first."""
        if location == SAMPLER_HOOK:
            self._visit_sampled(raw)
            return
        if not self._tokens.wants.get(location):
            return
        if shard_keys is None:
            self._serve(location, value, raw, self._tokens)
        else:
            self.sharded.visit(value, shard_keys, raw,
                               lambda whole: self._serve(location, value, whole, self._tokens))

    def _visit_sampled(self, logits: Any) -> None:
        """The logits the sampler is about to use: edits first (`logits`), then reads of the
        edited logits (`next_token_probs`). Only the first `compute_logits` after a forward is
        the sampler's; later ones (prompt logprobs) and a `Lens` inside the forward are not."""
        if self._in_lens:
            return
        visits, self._sampled = self._sampled, NOTHING
        for location in PER_SAMPLED_ROW:
            if visits.wants.get(location):
                self._serve(location, self.values[location], logits, visits)

    def _serve(self, location: str, value: Value, raw: Any, visits: Visits) -> None:
        """Run every waiting request's op on its own rows; edits are written into the engine's
        tensors in place (tokenspan.widen), only on the request's rows."""
        layout = visits.layout
        groups = visits.wants[location]
        if location in PER_SAMPLED_ROW and _rows(raw) != len(layout):
            for want in (want for members in groups for want in members):
                self.store.fail(want.key, f"{location}: the sampler got {_rows(raw)} rows for "
                                          f"{len(layout)} requests (speculative decoding is not "
                                          "supported with logits ops)")
            return
        token_axis = _token_axis(value)
        for members in groups:
            if len(members) > 1 and self._serve_together(value, raw, members, layout,
                                                         token_axis):
                continue
            for want in members:
                self._serve_one(want, value, raw, layout, token_axis)

    def _serve_one(self, want: Want, value: Value, raw: Any, layout: StepLayout,
                   token_axis: int | None) -> None:
        """Run one request's op on its own rows."""
        location = value.location
        if value.reason(want.step) is not None or self.store.failed(want.key):
            return  # e.g. the pattern outside a whole-prompt step; a program failed earlier
        try:
            rows = narrow(raw, want.span, layout)
            kind = want.op["op"]
            if kind == "call":
                # Lent in the op's read mode by `_call`, not copied here first.
                self._call(want, value, raw, rows, location, layout)
                return
            if kind == "save" and not self.keeps_saves:
                return  # a rank other than 0 under tensor parallelism: nothing to copy
            current = value.read(rows, want.step)
            if kind == "lens":
                self._lens(want, current, location)
            elif kind == "save":
                self.store.save(want.key, location, want.span.first_position, current,
                                token_axis)
            elif kind == "skip":
                layer = want.op["location"]
                if location.endswith(".layer_input"):
                    self._skipped[(want.key, layer)] = current
                else:
                    replacement = self._skipped.pop((want.key, layer))
                    widen(raw, want.span, layout, value.write(rows, replacement, want.step))
            else:
                edited = only_kept_rows(want.op, want.step.prompt_length,
                                        want.span.first_position, current,
                                        edit(want.op, current, value.eproperty.layout),
                                        token_axis)
                refuse_non_finite(edited, f"the {kind}", location)
                widen(raw, want.span, layout, value.write(rows, edited, want.step))
        except Exception as error:  # one request's failure must not stop the engine
            where = _user_frames(error) if want.op["op"] == "call" else ""
            self.store.fail(want.key, f"{want.op['op']} at {location}: "
                                      f"{type(error).__name__}: {error}{where}")

    def _serve_together(self, value: Value, raw: Any, members: Group, layout: StepLayout,
                        token_axis: int | None) -> bool:
        """Serve a group of requests running the same save or edit with one read (and one
        write) per run of adjacent rows instead of one per request; `False` leaves them to
        `_serve_one`, which also gives each request its own error if something fails.

        Per-request reads cost more than the copies themselves once a step holds dozens of
        requests (on a GPU the step is a few milliseconds). Only for values read row by row
        (`Codec.rowwise`) and ops that treat every row alike (no `positions` or `steps`)."""
        op = members[0].op
        kind = op["op"]
        if (token_axis is None or not value.eproperty.codec.rowwise
                or kind not in TOGETHER or position_filter(op, 0) is not None
                or (self.store.any_failed and any(self.store.failed(want.key)
                                                  for want in members))
                or not _served_at_every_step(value, members)):
            return False
        if kind == "save" and not self.keeps_saves:
            return True
        step = members[0].step  # rowwise values serve every step alike
        if kind == "save":
            plan = self._reading_plan(members, layout)
            try:
                reads = [value.read(narrow(raw, run, layout), step) for run, *_ in plan]
            except Exception:
                return False
            for (_, sizes, chosen, owners), whole in zip(plan, reads, strict=True):
                self.store.save_rows(value.location, token_axis, owners,
                                     pieces(whole, sizes, chosen, token_axis))
            return True
        writes = []
        try:
            for run, _ in runs(members):
                rows = narrow(raw, run, layout)
                current = value.read(rows, step)
                if not same_on_every_row(op, current, token_axis):
                    return False
                edited = edit(op, current, value.eproperty.layout)
                refuse_non_finite(edited, f"the {kind}", value.location)
                writes.append((run, value.write(rows, edited, step)))
        except Exception:
            return False  # nothing written yet: served one by one, each with its own error
        try:
            for run, new_rows in writes:
                widen(raw, run, layout, new_rows)
        except Exception as error:
            for want in members:
                self.store.fail(want.key, f"{kind} at {value.location}: "
                                          f"{type(error).__name__}: {error}")
        return True

    def _reading_plan(self, members: Group, layout: StepLayout) -> list[
            tuple[Span, list[int], list[int], list[tuple[str, int]]]]:
        """Where to read a group's value this step and how to cut it: per read, the run of
        rows, the cuts (`groups.cuts`) and each piece's owner (key, first position); made at
        the group's first visit and kept with it."""
        if members.plan is None:
            members.plan = []
            for run, inside in reading_plan(members, layout.total):
                sizes, chosen = cuts(run, inside)
                owners = [(want.key, want.span.first_position) for want in inside]
                members.plan.append((run, sizes, chosen, owners))
        return members.plan

    def _lens(self, want: Want, current: torch.Tensor, location: str) -> None:
        """Top-k next-token probabilities of a residual value, through the model's own final
        norm and `compute_logits` (which applies its unembedding, scale and soft-cap)."""
        model = self.standard.module
        norm = model.get_submodule(self.standard.family.norm)
        self._in_lens = True
        try:
            logits = model.compute_logits(norm(current[0]))
        finally:
            self._in_lens = False
        probabilities, tokens = logits.float().softmax(-1).topk(want.op["top_k"], dim=-1)
        if not self.keeps_saves:
            return
        first = want.span.first_position
        self.store.save(want.key, f"{location}.lens_tokens", first, tokens.unsqueeze(0), 1)
        self.store.save(want.key, f"{location}.lens_probs", first, probabilities.unsqueeze(0), 1)

    def _call(self, want: Want, value: Value, raw: Any, rows: Any, location: str,
              layout: StepLayout) -> None:
        """Lend the value to user code in the op's read mode and write back what it changed."""
        import pickle

        mode = want.op.get("reads") or self.reads
        lent = value.view(rows, want.step) if mode == "view" else None
        version = None  # a view needs no write-back; a copy is written back only if replaced
        if lent is None and mode == "copy":
            lent = value.read(rows, want.step)
        elif lent is None:
            # A copy made outside inference mode keeps a version counter, so in-place edits show.
            with torch.inference_mode(False):
                lent = value.read(rows, want.step)
            version = lent._version
        fn = self._functions.get(want.key, {}).get(id(want.op))
        if fn is None:
            fn = pickle.loads(want.op["fn"])
            self._functions.setdefault(want.key, {})[id(want.op)] = fn
        context = CallContext(location, want.span.positions(), want.step.prompt_length)
        result = fn(lent, context)
        if result is not None and result is not lent:
            edited = result
        elif version is not None and lent._version != version:
            edited = lent
        else:
            if version is None and mode == "view":  # its writes landed already: say so
                refuse_non_finite(lent, "the function (in view mode: its writes landed)",
                                  location)
            return  # untouched: nothing is written
        refuse_non_finite(edited, "the function" if edited is lent else "the function's result",
                          location)
        widen(raw, want.span, layout, value.write(rows, edited, want.step))

    # ------------------------------------------------------------------ collection

    def collect(self, requests: list[dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
        """Finished requests' saves (each request: `key`, `computed`, `prompt_length`, `ops`),
        trimmed to their final output, filtered by their ops, on the host; all at once, so
        saves on a GPU cross to the host in a few large copies."""
        return self.store.collect([
            (request["key"], request["computed"],
             self._filters(request["ops"], request["prompt_length"]))
            for request in requests])

    def _filters(self, ops: list[dict[str, Any]],
                 prompt_length: int) -> dict[str, Callable[[int], bool] | None]:
        """Per saved location, which positions a request's `save` and `lens` ops keep."""
        filters = {}
        for op in ops:
            if op["op"] not in READ_ONLY_OPS:
                continue
            keep = position_filter(op, prompt_length)
            for location in self.resolve(op["location"]):
                if op["op"] == "save":
                    filters[location] = keep
                else:
                    filters[f"{location}.lens_tokens"] = filters[f"{location}.lens_probs"] = keep
        return filters

    def drop(self, keys: list[str]) -> None:
        """Forget requests that will never be collected: their saves, errors and functions."""
        self.store.drop(keys)
        for key in keys:
            self._functions.pop(key, None)
            self._checked.discard(key)

    def error(self, key: str) -> str | None:
        """Why a request's program failed, or `None`; forgets the request's functions too."""
        self._functions.pop(key, None)
        self._checked.discard(key)
        return self.store.error(key)


def _user_frames(error: BaseException) -> str:
    """The traceback lines of a `Call` function's failure below our call into it (the user's
    own code, with its file and line), as text for the request's error."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [index for index, frame in enumerate(frames)
            if frame.filename == __file__ and frame.name == "_call"]
    user = frames[ours[-1] + 1:] if ours else frames
    if not user:
        return ""
    return "\n" + "".join(traceback.format_list(user)).rstrip()


def _served_at_every_step(value: Value, members: list[Want]) -> bool:
    """Whether `value` can be served at each member's step. Most values say so once, whatever
    the step; only a step-dependent reason (a callable) is asked member by member."""
    if not callable(value.eproperty.unavailable):
        return value.eproperty.unavailable is None
    return all(value.reason(want.step) is None for want in members)


def _token_axis(value: Value) -> int | None:
    layout = value.eproperty.layout
    return layout.index("tokens") if "tokens" in layout else None
