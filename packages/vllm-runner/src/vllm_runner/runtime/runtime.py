"""The worker-side runtime: each step's plan, the hooks it needs, serving and collection.

It takes plain data from the engine adapter (`engine.v1_runner`): the step's `StepLayout` and the
programs of the scheduled requests, in step order. It imports nothing from vLLM; the jobs are in
their own modules: `step_plan` (who wants what), `hooks` (where to look), `row_serving` (the ops on
the rows), `store` (what was saved).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from tokenspan import ReadMode, StepLayout
from torch import nn
from tpfragments import Fragments
from vllm_envoys import Value, standardize

from vllm_runner.compiled.graph_steps import GraphStep, GraphSteps
from vllm_runner.compiled.in_graph import InGraphBuffers, InGraphRows, in_graph_ops, in_graph_value
from vllm_runner.compiled.opaque_calls import called_inside_opaque_ops, opaque_reason
from vllm_runner.compiled.repeated_saves import RepeatedSaves
from vllm_runner.compiled.tap_edits import steered_rows
from vllm_runner.compiled.taps import install_taps, serve_taps
from vllm_runner.errors import LocationError
from vllm_runner.ops import Op
from vllm_runner.ops.features import SAE_PATTERN_PREFIX
from vllm_runner.ops.locations import PER_SAMPLED_ROW, resolve, unservable
from vllm_runner.ops.program import Program, ProgramCache, ProgramData
from vllm_runner.ops.wants import ScheduledRequest
from vllm_runner.runtime.door import GraphNeed
from vllm_runner.runtime.hooks import EMBEDDINGS, SAMPLER_HOOK, TOKEN_IDS, Hooks, TokenIdsHook
from vllm_runner.runtime.lens import ModelLens
from vllm_runner.runtime.pattern_edits import edit_refusal, with_pattern_outputs
from vllm_runner.runtime.row_serving import OpGroup, Services, Visits, serve, token_axis_of
from vllm_runner.runtime.saes import LoadedSAEs
from vllm_runner.runtime.sharded import ShardedValues
from vllm_runner.runtime.step_plan import NO_VISITS, plan_step
from vllm_runner.saves.collection import Collected, Finished
from vllm_runner.saves.store import Keep, Places, SaveStore, ToCollect
from vllm_runner.settings import read_mode

logger = logging.getLogger("vllm.interp")


def never_ran(location: str) -> str:
    """Why a program fails whose hook at `location` did not run in a forward it was scheduled
    in: its values would be missing, or its edits not made, without a word (a forward replayed
    from a CUDA graph or run compiled runs no hooks)."""
    return (f"{location}: its hook did not run in a forward this request was part of (vLLM "
            "ran the step compiled or from a CUDA graph, where no hook runs), so its values "
            "would be missing or its edits not made; this is a bug of vllm-runner: please report "
            "it with the engine's settings")


class Runtime:
    """Hooks only what this step's programs name, and runs their ops on their own rows.

    The engine adapters reach it through `door.StepDoor` and the worker's RPCs through
    `door.WorkerDoor`; the rest is its own."""

    def __init__(self, model: nn.Module, hf_config: Any, fragments: Fragments | None = None,
                 rank: int = 0, reads: ReadMode = "lease",
                 device_saves_limit: int | None = None) -> None:
        self.device_saves_limit = device_saves_limit
        self._model = model
        self._hf_config = hf_config
        self.standard = standardize(model, hf_config)
        self.values = self.standard.values()
        self.store = SaveStore()
        #: The SAEs loaded at start-up (`load_saes`), which SAE ops are bound to as decoded.
        self.sae_table = LoadedSAEs()
        self.programs = ProgramCache(lambda ops: with_pattern_outputs(
            self.sae_table.bind(ops), self.locations_of, self.values))
        self.lens = ModelLens(self.standard)
        # Under tensor parallelism every rank runs every op (edits must reach every piece), but
        # only rank 0 keeps saves: the client collects from rank 0.
        self.services = Services(self.store, self.lens, read_mode(reads), keeps_saves=rank == 0)
        self.sharded = ShardedValues(model, fragments or Fragments())
        self.services.patterns.tensor_parallel = bool(len(self.sharded.fragments))
        #: Tap patterns refused at start-up, with the reason (`install_taps`).
        self.refused_taps: dict[str, str] = {}
        self._logged_untapped: set[str] = set()  # locations `needs_module_tree` logged
        self.hooks = Hooks(self.values, self._visit)
        self._token_ids = TokenIdsHook(self.values[EMBEDDINGS].module, self.services)
        #: Tapped values whose `ProjectOut`s, `Add`s and `Save`s run inside the compiled model
        #: (`in_graph`).
        self.in_graph: dict[str, InGraphRows] = {}
        self._buffers = InGraphBuffers(model, hf_config)
        self._shard_keys: dict[str, tuple[str | None, ...] | None] = {}
        self._resolved: dict[str, list[str]] = {}
        #: Whether vLLM compiled the model: the adapters then run a step with programs
        #: uncompiled (set by `runtime_loading.load_runtime`).
        self.compiled = False
        #: Forwards run so far, by how: vLLM's compiled path with no program, the compiled
        #: path serving programs through their taps, or the plain module tree.
        #: `in_graph`: the compiled path, with every program's work inside the graph (steering
        #: and saves from buffers, no tap's Python).
        self.forwards = {"compiled": 0, "taps": 0, "in_graph": 0, "eager": 0, "tap_breaks": 0,
                         "tap_breaks_joined": 0}
        self._tokens = self._sampled = NO_VISITS
        self._visited: set[str] = set()  # token-row locations whose hook ran this forward
        self._guard_logits = False
        self._edited_in_step = False  # a scheduled request's program edits (`program`)
        self._served_in_graph = False  # this step's programs were served from buffers
        self._saves_in_graph: list[tuple[str, list[OpGroup]]] = []  # taken after the forward
        self._graph_step: GraphStep | None = None  # a step planned by `graph_steps`
        self._graph_steps = GraphSteps(self.in_graph, self.locations_of, self.values)
        self._repeated_saves = RepeatedSaves()  # the graph steps' saves
        self._in_graph_known: dict[tuple[str, str], bool] = {}  # (digest, location)
        # Programs checked against their prompt (at their first step), by program id.
        self._checked: dict[str, Program] = {}

    def resolve(self, pattern: str) -> list[str]:
        """Canonical locations of a pattern (cached); `LocationError` if it names nothing."""
        found = self._resolved.get(pattern)
        if found is None:
            found = self._resolved[pattern] = (
                self.sae_table.resolve(pattern) if pattern.startswith(SAE_PATTERN_PREFIX)
                else resolve(pattern, self.values, len(self.standard.layers)))
        return found

    def load_saes(self, paths: dict[str, Any]) -> dict[str, Any]:
        """Load SAEs (name -> path and site: `settings.saes_config`) on the model's device
        (`runtime.saes`), at start-up or later (`LLM.load_saes`): those that fail a check are
        refused by name. Returns `saes()`."""
        device = next(self._model.parameters()).device
        self.sae_table.load(paths, self.values, self.resolve, self._hf_config, device)
        return self.saes()

    def saes(self) -> dict[str, Any]:
        """The SAEs loaded (`"loaded"`, as plain data) and refused (`"refused"`, the reasons)."""
        return {"loaded": self.sae_table.describe(), "refused": dict(self.sae_table.refused)}

    def locations_of(self, op: Op) -> list[str]:
        """The canonical locations an op acts at."""
        return [location for pattern in op.patterns() for location in self.resolve(pattern)]

    def install_taps(self, patterns: Sequence[str], rows: int = 0, slots: int = 0,
                     in_graph: Sequence[str] = ()) -> dict[str, str]:
        """Serve the locations `patterns` name from inside the compiled model (`taps`); called
        once, before vLLM compiles it. Returns the patterns refused, with the reasons
        (`tap_locations`): the engine still starts (a program there runs uncompiled), and
        `LLM` reports them. At the taps `in_graph` names (also among `patterns`), `ProjectOut`s,
        `Add`s and `Save`s run inside the graph (`in_graph`), with buffers for `rows` rows (the
        most one forward runs) and `slots` steered or ablating requests (the most one step
        holds)."""
        # Only compiled forwards skip what an opaque op calls (an eager one runs it all).
        opaque = called_inside_opaque_ops(self._model) if self.compiled else {}

        def untappable(location: str) -> str | None:
            op_name = opaque.get(id(self.values[location].module))
            return None if op_name is None else opaque_reason(location, op_name)

        locations, refused = tap_locations(patterns, self.resolve, self.support(), untappable)
        graph_locations = []
        for pattern in in_graph:
            try:
                found = [] if pattern in refused else self.resolve(pattern)
            except LocationError as error:
                refused[pattern] = str(error)
                continue
            for location in found:
                if (reason := self._not_in_graph(location)) is not None:
                    refused[pattern] = reason
                elif location not in graph_locations:
                    graph_locations.append(location)
        if graph_locations and rows and slots:
            # Filled in place: `_graph_steps` plans from this very mapping.
            self.in_graph.update(self._buffers.buffers(
                [self.values[location] for location in graph_locations], rows, slots))
            if self.in_graph:
                logger.info("vllm-runner: %d taps serve ProjectOut, Add and Save inside the "
                            "graph, with %.1f MiB of buffers", len(self.in_graph),
                            len(self.in_graph) * self._buffers.bytes_per_value(rows, slots)
                            / 2**20)
        install_taps([self.values[location] for location in locations], self.in_graph)
        self.hooks.tapped = frozenset(locations)
        self.refused_taps = refused
        return refused

    def _not_in_graph(self, location: str) -> str | None:
        """Why `ProjectOut`, `Add` and `Save` at `location` cannot run inside the graph, or
        `None`."""
        value = self.values[location]
        if not in_graph_value(value):
            return (f"{location} ({' '.join(value.eproperty.layout)}) is not a residual-width "
                    "value read as it sits: graph taps serve layer_input, layer_output, "
                    "attention_output, mlp_output and the like; tap it in taps= instead")
        try:
            whole = self.sharded.keys(value) is None
        except NotImplementedError:
            whole = False
        if not whole:
            return (f"{location} is split across tensor-parallel ranks here: graph taps serve "
                    "values whole on every rank; tap it in taps= instead")
        if not self._buffers.width:
            return f"{location}: the model's config names no hidden_size to size buffers by"
        return None

    @property
    def taps(self) -> frozenset[str]:
        """The locations served from inside the compiled model, declared at start-up (they get
        no ordinary hook: `Hooks.tapped`)."""
        return self.hooks.tapped

    def wants_tap(self, location: str) -> bool:
        """Whether a request of this step waits at the tapped `location`."""
        return bool(self._tokens.wants.get(location))

    def locations_waited_at(self) -> list[str]:
        """The locations a request of this step waits at (`wants_tap` of each): where a full
        graph broken at the taps must stop (`compiled.replays`)."""
        return [location for location, groups in self._tokens.wants.items() if groups]

    def serve_tap(self, location: str, raw: Any) -> None:
        """One visit of a tap (`taps`): served as a hook's would be."""
        self._visit(location, self.values[location], raw)

    def needs_module_tree(self, programs: Sequence[Program]) -> bool:
        """Whether a step running `programs` must run the plain module tree: one of them acts
        at a location inside the model that no tap serves (the sampled-row values are read
        after the model, on any path). On a compiled engine, each such location is logged
        once, with the way to keep its steps compiled."""
        taps = self.taps
        untapped = {location for _, location in self._acting_at(programs)
                    if location not in taps and location not in PER_SAMPLED_ROW}
        if any(program.reads_token_ids for program in programs):
            untapped.add(TOKEN_IDS)  # read where the module tree embeds them
        if self.compiled and (new := untapped - self._logged_untapped):
            self._logged_untapped |= new
            logger.info("vllm-runner: programs act at %s, which no tap serves: their steps run "
                        "the model uncompiled; start the engine with LLM(taps=[...]) naming "
                        "them to keep those steps compiled", ", ".join(sorted(new)))
        return bool(untapped)

    def graph_need(self, data: Sequence[ProgramData]) -> GraphNeed:
        """What a compiled step running the programs `data` (as they travel, before the step
        decodes them) needs of its CUDA graph, asked once a step: the plain module tree where
        one acts where no tap serves (`needs_module_tree`; also one that does not decode or
        resolve, whose failure is reported there), no full graph where one needs a tap's
        Python (`needs_tap_python`), else the engine's own choice."""
        try:
            programs = [self.programs.get(one) for one in _one_per_digest(data)]
            if self.needs_module_tree(programs):
                return GraphNeed.MODULE_TREE
        except Exception:
            return GraphNeed.MODULE_TREE
        try:
            return GraphNeed.PIECES if self.needs_tap_python(programs) else GraphNeed.ANY
        except Exception:
            return GraphNeed.PIECES

    def support(self) -> dict[str, str | None]:
        """Every value of the model → `None` if available, else the reason."""
        return self.standard.support()

    def layouts(self) -> dict[str, list[str]]:
        """Every available value's axis names, by location (a client checks shapes with them)."""
        return {location: list(self.values[location].eproperty.layout)
                for location, reason in self.support().items() if reason is None}

    # ------------------------------------------------------------------ programs

    def program(self, data: ProgramData, prompt_length: int) -> Program | None:
        """A scheduled request's program, decoded at its first step and checked against its
        prompt; `None` once it has failed (a failed program stops where it failed: nothing more
        is written for it, nor read after that step — a `Call` refused on the device is known
        at the next read of its answers, and the program's reads in between still run:
        `unread_checks`)."""
        program_id = data["program_id"]
        checked = self._checked.get(program_id)  # every later step: no more lookups
        known = checked if checked is not None else self.programs.known(program_id)
        if known is not None and known.edits:
            # Running still, even if its program failed: its edits may have left non-finite
            # values behind (see `keep_logits_finite`).
            self._edited_in_step = True
        elif known is None and self.edits(data):  # its first step: decoded here
            self._edited_in_step = True
        if self.store.failed(program_id):
            return None
        if checked is not None:
            return checked
        try:
            program = self.programs.get(data)
        except Exception as error:
            self.store.fail(program_id, f"the program does not decode: "
                                        f"{type(error).__name__}: {error}")
            return None
        self._checked[program_id] = program
        if (problem := program.before_the_prompt(prompt_length)
                or self._never_served(program, prompt_length)) is not None:
            self.store.fail(program_id, problem)
            return None
        return program

    def edit_refusal(self, location: str) -> str | None:
        """Why an edit at canonical `location` can never be served on this engine, or `None`
        (`pattern_edits.edit_refusal`)."""
        return edit_refusal(self.values[location], self.values, bool(len(self.sharded.fragments)))

    def _never_served(self, program: Program, prompt_length: int) -> str | None:
        """Why an op of `program` can never be served as written on a prompt of
        `prompt_length` tokens, or `None`: `locations.unservable` (an edit at a value that takes
        none, ...; a client refuses those before sending, checked here for every client), or an
        edit's per-position tensor without a row for a position its `positions=` names
        (`EditOp.position_misfit`)."""
        ops = [op for op in program.ops if not op.added_by_the_worker]
        try:
            acting_at = [self.locations_of(op) for op in ops]
        except LocationError:
            return None  # refused where the location is served (`never_ran`)
        refusals = {location: reason for locations in acting_at for location in locations
                    if (reason := self.edit_refusal(location)) is not None}
        if (found := unservable(ops, acting_at, refusals)) is not None:
            return found[1]
        for op, locations in zip(ops, acting_at, strict=True):
            for location in locations:
                value = self.values[location]
                problem = op.position_misfit(prompt_length, location, value.eproperty.layout,
                                             token_axis_of(value))
                if problem is not None:
                    return problem
        return None

    def note_edits(self) -> None:
        """Mark this step as running a program that edits, as `program` does for each request
        it finds (for a step whose requests were found at an earlier step:
        `repeated_schedule`)."""
        self._edited_in_step = True

    def edits(self, data: ProgramData) -> bool:
        """Whether a program may change the engine's values (see `Program.edits`); one that
        does not decode is counted as editing, to be safe."""
        try:
            return self.programs.get(data).edits
        except Exception:
            return True

    # ------------------------------------------------------------------ per step

    @property
    def any_failed(self) -> bool:
        """Whether some program failed and was not collected yet (`SaveStore.any_failed`)."""
        return self.store.any_failed

    def saves_held(self) -> dict[str, int]:
        """What the store holds for requests not collected yet (`SaveStore.held`)."""
        return self.store.held()

    def _count_forward(self, compiled: bool, programs: bool) -> None:
        """Count one real forward (`forwards`), as `begin_step` plans it: by whether it runs
        vLLM's compiled path and, if it does, whether its programs are served by the taps'
        Python or inside the graph alone."""
        in_graph = self._served_in_graph and not self._tokens.wants
        self.forwards["eager" if not compiled else "compiled" if not programs else
                      "in_graph" if in_graph else "taps"] += 1

    def count_tap_break(self, joined: bool) -> None:
        """Count one forward that replayed a full CUDA graph broken at the taps (one of the
        `taps` forwards: `engine.v2_tap_graphs`), and whether it ran graph segments joined around
        the taps its step did not need (`compiled.replays`)."""
        self.forwards["tap_breaks"] += 1
        self.forwards["tap_breaks_joined"] += int(joined)

    def needs_tap_python(self, programs: Sequence[Program]) -> bool:
        """Whether a step running `programs` has work at a tap that runs in the tap's Python
        (a full CUDA graph would replay its kernels without it): any op there but the
        `ProjectOut`s, `Add`s and `Save`s the graph serves (`in_graph`)."""
        taps = self.taps
        return any(location in taps and not self._in_graph(program, location)
                   for program, location in self._acting_at(programs))

    def _acting_at(self, programs: Sequence[Program]) -> Iterator[tuple[Program, str]]:
        """Each distinct program of `programs` with each location one of its ops acts at; once
        per program, not per request (a step's requests mostly share a few programs)."""
        for program in {program.digest: program for program in programs}.values():
            for op in program.ops:
                for location in self.locations_of(op):
                    yield program, location

    @property
    def every_program_acts(self) -> bool:
        """Whether every program acts at every step of its request: no program that acts on
        the prompt only was decoded yet, so the adapters need not ask each request's program
        (`acts_at`) at each step."""
        return not self.programs.seen_prompt_only

    def acts_at(self, data: ProgramData, prompt_length: int, first_position: int) -> bool:
        """Whether a request running `data` may act at a step whose rows start at
        `first_position`: `Program.acts_at`, the rule of `step_plan.acting`, for the adapters'
        choice of the step's graph before its rows are known (a program that does not decode:
        yes)."""
        if first_position < prompt_length or self.every_program_acts:
            return True  # no lookup: most steps of most requests end here or hold no program
        try:
            return self.programs.get(data).acts_at(prompt_length, first_position)
        except Exception:
            return True

    def _in_graph(self, program: Program, location: str) -> bool:
        """Whether all of `program`'s ops at `location` run inside the graph (cached)."""
        key = (program.digest, location)
        known = self._in_graph_known.get(key)
        if known is None:
            rows = self.in_graph.get(location)
            known = self._in_graph_known[key] = rows is not None and in_graph_ops(
                [op for op in program.ops if location in self.locations_of(op)],
                rows.width) is not None
        return known

    def begin_step(self, layout: StepLayout, requests: Sequence[ScheduledRequest],
                   compiled_forward: bool | None = None) -> None:
        """Plan the step and hook what its programs want (nothing, for a step without any).
        `compiled_forward`: whether the engine's forward runs vLLM's compiled path, counted in
        `forwards` by what runs (`None`: a step planned outside an engine's forward, not
        counted)."""
        with_programs = bool(requests)
        if failed := set(self.store.spill(self.device_saves_limit)):  # the last step's are made
            # Their saves are gone: this step serves them nothing (steering included).
            requests = [request for request in requests
                        if request.program.program_id not in failed]
        if self.in_graph and requests and self._plan_in_graph(layout, requests):
            self._tokens = self._sampled = NO_VISITS
            self._served_in_graph = True
            locations: list[str] = []
        else:
            plan = plan_step(layout, requests, self.locations_of)
            self._tokens, self._sampled = plan.tokens, plan.sampled
            self._served_in_graph = bool(self.in_graph) and self._serve_in_graph(plan.tokens)
            locations = plan.locations()
        # A step with edits gets the sampler's hook whatever its programs read: see
        # `keep_logits_finite`.
        self._guard_logits, self._edited_in_step = self._edited_in_step, False
        self.hooks.sync([*locations, *((SAMPLER_HOOK,) if self._guard_logits else ())])
        self._token_ids.sync(self.programs.seen_token_filters and any(
            request.program.reads_token_ids for request in requests))
        if self.taps:
            serve_taps(self)
        if compiled_forward is not None:
            self._count_forward(compiled_forward, with_programs)

    def end_step(self) -> None:
        """Fail the programs that waited at a hook that never ran, then forget the step's token
        rows (hooks stay installed while programs keep wanting them); the sampled rows wait for
        the runner's `compute_logits`, which follows the forward."""
        for location, groups in self._tokens.wants.items():
            if location not in self._visited:
                for want in (want for members in groups for want in members):
                    self.store.fail(want.program_id, never_ran(location))
        if self.taps:
            serve_taps(None)
        self._take_saves_in_graph()
        self._visited.clear()
        self._tokens = NO_VISITS
        self.services.skipped.clear()
        self.services.patterns.end_step()
        self.services.token_ids = None

    def _plan_in_graph(self, layout: StepLayout, requests: Sequence[ScheduledRequest]) -> bool:
        """Serve the step from the graph taps' buffers alone, planned per program
        (`graph_steps`), if every program of it runs inside the graph; whether it was."""
        step = self._graph_steps.plan(layout, requests)
        if step is None:
            return False
        try:
            for filled in step.steering:
                filled.table.write(filled.vectors, filled.index)
        except Exception:  # the general plan serves it then, failing only whom it must
            logger.exception("vllm-runner: a step could not be served in the graph")
            for filled in step.steering:
                filled.table.clear()
            return False
        self._graph_step = step
        return True

    def _serve_in_graph(self, tokens: Visits) -> bool:
        """Fill the steering buffers of each tap whose waiting programs can all be served in
        the graph (`in_graph`) and take those locations off the taps' Python (their saves are
        taken after the forward); whether any was."""
        served = False
        for location, rows in self.in_graph.items():
            groups = tokens.wants.get(location)
            if not groups or not all(self._group_in_graph(members, location)
                                     for members in groups):
                continue
            try:
                for table, kind in rows.edit_tables():
                    if found := steered_rows(self.values[location], groups, self.store.failed,
                                             table.vectors, kind):
                        table.fill(found)
            except Exception:  # the tap's Python serves them then, failing only whom it must
                logger.exception("vllm-runner: %s could not be served in the graph", location)
                rows.clear()
                continue
            self._saves_in_graph.append((location, groups))
            del tokens.wants[location]
            served = True
        return served

    def _group_in_graph(self, members: OpGroup, location: str) -> bool:
        """Whether the graph serves a group's op at `location`: its members run one program
        (one digest, `step_plan`), so the first answers for all."""
        if not members:
            return True
        program = self.programs.known(members[0].program_id)
        return program is not None and self._in_graph(program, location)

    def _take_saves_in_graph(self) -> None:
        """After the forward: the saving requests' rows from the rings (on rank 0, which keeps
        saves), and no more steering."""
        for location, groups in self._saves_in_graph:
            rows = self.in_graph[location]
            if self.services.keeps_saves:
                rows.saves.take(groups, self.store.failed_so_far, self.values[location],
                                self.store)
            rows.clear()
        self._saves_in_graph.clear()
        step, self._graph_step = self._graph_step, None
        if step is not None:
            if self.services.keeps_saves:
                self._repeated_saves.keep(step.saves, step.layout, self.store)
            for filled in step.steering:
                filled.table.clear()

    def _visit(self, location: str, value: Value, raw: Any) -> None:
        """Serve the step's requests at one hook visit; a sharded value is made whole first."""
        if location == SAMPLER_HOOK:
            self._visit_sampled(raw)
            return
        tokens = self._tokens
        if not tokens.wants.get(location):
            return
        self._visited.add(location)
        if location not in self._shard_keys:
            self._shard_keys[location] = self.sharded.keys(value)
        shard_keys = self._shard_keys[location]
        if shard_keys is None:
            serve(value, raw, tokens, self.services)
        else:
            self.sharded.visit(value, shard_keys, raw,
                               lambda whole: serve(value, whole, tokens, self.services))

    def _visit_sampled(self, logits: Any) -> None:
        """The logits the sampler is about to use: edits first (`logits`), then reads of the
        edited logits (`next_token_probs`). Only the first `compute_logits` after a forward is
        the sampler's; later ones (prompt logprobs) and a `Lens` inside the forward are not."""
        if self.lens.active:
            return
        visits, self._sampled = self._sampled, NO_VISITS
        logits_edits, probability_reads = PER_SAMPLED_ROW
        if visits.wants.get(logits_edits):
            self._serve_sampled(self.values[logits_edits], logits, visits)
        if self._guard_logits:
            self._guard_logits = False
            keep_logits_finite(logits)
        if visits.wants.get(probability_reads):
            self._serve_sampled(self.values[probability_reads], logits, visits)

    def _serve_sampled(self, value: Value, logits: Any, visits: Visits) -> None:
        rows = int(logits.shape[0]) if isinstance(logits, torch.Tensor) else -1
        if rows == len(visits.layout):
            serve(value, logits, visits, self.services)
            return
        for want in (want for members in visits.wants[value.location] for want in members):
            self.store.fail(want.program_id, f"{value.location}: the sampler got {rows} rows "
                                             f"for {len(visits.layout)} requests (speculative "
                                             "decoding is not supported with logits ops)")

    # ------------------------------------------------------------------ collection

    def collect(self, finished: Sequence[Finished], into: Places | None = None
                ) -> dict[str, Collected]:
        """Finished requests' saves, trimmed to their final output, filtered by their ops, on
        the host (or `into` files for a client in another process: `SaveStore.collect`), and
        their errors; all at once, so saves on a GPU cross to the host in a few large copies.
        Each request is forgotten afterwards."""
        saved = self.store.collect([
            ToCollect(request["program_id"], request["computed"],
                      self._filters(request["program_id"], request["prompt_length"]))
            for request in finished], into)
        collected: dict[str, Collected] = {}
        for request in finished:
            program_id = request["program_id"]
            collected[program_id] = {"saved": saved[program_id],
                                     "error": self.store.error(program_id)}
            self._forget(program_id)
        return collected

    def _filters(self, program_id: str, prompt_length: int) -> dict[str, Keep]:
        """Per saved name, which positions the program's ops keep."""
        program = self.programs.known(program_id)
        filters: dict[str, Keep] = {}
        for op in program.ops if program is not None else ():
            keep = op.position_filter(prompt_length)
            for location in self.locations_of(op):
                for name in op.saved_names(location):
                    filters[name] = keep
        return filters

    def drop(self, program_ids: Sequence[str]) -> None:
        """Forget requests that will never be collected: their saves, errors and programs."""
        self.store.drop(list(program_ids))
        for program_id in program_ids:
            self._forget(program_id)

    def _forget(self, program_id: str) -> None:
        self.programs.forget(program_id)
        self._checked.pop(program_id, None)
        self.services.keys.forget(program_id)
        self.services.patterns.forget(program_id)


def _one_per_digest(data: Sequence[ProgramData]) -> list[ProgramData]:
    """One of each program among `data`: requests running one program (one digest) act at the
    same locations, so a step's checks need only one of them (a step holds many)."""
    return list({one["digest"]: one for one in data}.values())


def tap_locations(patterns: Sequence[str], resolve_pattern: Callable[[str], list[str]],
                  support: dict[str, str | None],
                  untappable: Callable[[str], str | None] = lambda location: None,
                  ) -> tuple[list[str], dict[str, str]]:
    """The canonical locations `patterns` tap, in order and once each, and the patterns
    refused with the reason: one that names nothing, a value this model never serves, a
    sampled-row value (read after the model, on every path: it needs no tap), or one where
    `untappable` says why no tap can serve it on this engine."""
    locations: list[str] = []
    refused: dict[str, str] = {}
    for pattern in patterns:
        try:
            found = resolve_pattern(pattern)
        except LocationError as error:
            refused[pattern] = str(error)
            continue
        for location in found:
            if location in PER_SAMPLED_ROW:
                refused[pattern] = (f"{location} is read after the model, outside its compiled "
                                    "part, on every path: it needs no tap")
            elif (reason := support.get(location)) is not None:
                refused[pattern] = f"{location} is never available on this model: {reason}"
            elif (reason := untappable(location)) is not None:
                refused[pattern] = reason
            elif location not in locations:
                locations.append(location)
    return locations, refused


def keep_logits_finite(logits: Any) -> None:
    """Replace NaN and `+inf` in the sampler's logits (in place) after a step with edits.

    An edit can make a request's later values non-finite with nothing to refuse where it is
    made (a finite `Scale` by 1e30 overflows the next layers; a `Call` in view mode has written
    already). vLLM's V2 sampler then picks an out-of-range token on the GPU, and the next step's
    embedding lookup fails a device-side assert that stops the engine for every request (vLLM
    0.33 on a GPU). Finite logits are unchanged (other requests' rows are untouched),
    and `-inf` stays: it bans a token."""
    if isinstance(logits, torch.Tensor) and logits.is_floating_point():
        torch.nan_to_num_(logits, nan=0.0, posinf=torch.finfo(logits.dtype).max,
                          neginf=float("-inf"))
