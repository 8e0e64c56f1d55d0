"""The engine adapter for vLLM's V2 model runner (`vllm.v1.worker.gpu.model_runner`).

The second adapter beside `engine.v1_runner`, and like it the only code that reads this runner's
private state. Read in vLLM 0.32 (the CPU wheel, which ships the module but cannot run it: V2
needs Triton's GPU backend) and 0.33; see docs/vllm-runner-internals.md for what was run where.

V2 keeps no `SamplingParams` per request, so each request's program is kept here when V2 adds
it (`add_requests`: new requests and ones resumed after preemption, which V2 re-adds with their
`sampling_params`) and forgotten when it finishes or is preempted (`finish_requests`). V2 has
no `_model_forward`: `prepare_inputs` — called for real batches only, never for profiling,
dummy or capture runs — hands over the step's `InputBatch`, whose plain host fields give the
layout: the step's own request order `req_ids` (uniform decodes first, then by query length),
row offsets `query_start_loc_np`, and first positions `num_computed_tokens_np`, read on the host
so that V2's run-ahead (async scheduling) is not stalled by a device read; `execute_model`
brackets the forward. The sampler's `compute_logits` runs later, in `sample_tokens`, where the
runtime's logits hook serves the sampled rows as under V1.

Where vLLM compiles the model (`enforce_eager=False`), the step's CUDA-graph choice is V2's own
(`cudagraph_manager.dispatch`, asked once per real step inside `execute_model`, after
`add_requests`) except for steps with programs: none where a program acts at a location no tap
serves — and the forward context's `skip_compiled`, the switch vLLM uses for encoder inputs, is
set as the model is called, so the plain module tree and its hooks run — and, where a tap's
Python must run, V2's full graph replayed from a second capture broken at the taps
(`engine.v2_tap_graphs`; the piecewise graphs, whose pieces the taps run between, where none was
captured). The same rules as the V1 adapter's, at V2's own decision points, except the broken
full graphs, which V1 does not have: its steps with a tap's Python run the piecewise graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from tokenspan import StepLayout
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context

from vllm_runner.engine.kv_blocks import WrittenBlocks, blocks_of, handed_out_blocks, zero_blocks
from vllm_runner.engine.repeated_schedule import RepeatedSchedule
from vllm_runner.engine.runtime_loading import load_runtime
from vllm_runner.engine.swapped import swapped
from vllm_runner.engine.v2_tap_graphs import break_at_taps, has_broken, tap_breaks_for
from vllm_runner.ops.program import ProgramData, program_data
from vllm_runner.ops.wants import ScheduledRequest
from vllm_runner.runtime.door import EngineDoor, GraphNeed, StepDoor
from vllm_runner.runtime.step_plan import NO_ROWS, acting
from vllm_runner.settings import breaks_at_taps

#: A running request's program and its prompt's length, kept from when V2 added it.
Kept = tuple[ProgramData, int]


def scheduled_step(runtime: StepDoor, programs: Mapping[str, Kept], batch: Any,
                   repeated: RepeatedSchedule | None = None
                   ) -> tuple[StepLayout, list[ScheduledRequest]]:
    """This step's layout from V2's `InputBatch` (plain host attributes only) and its requests
    that run a program, in the step's order (the last step's list where `repeated` has it); no
    layout is built for a step without programs."""
    if not programs:  # no running request has a program: nothing to look up per request
        return NO_ROWS, []
    count = int(batch.num_reqs)
    request_ids = list(batch.req_ids[:count])
    kept_of = programs.get
    each_kept: list[Any] = [kept_of(request_id) for request_id in request_ids]

    def find() -> list[ScheduledRequest]:
        found = []
        program_of = runtime.program  # per request per step: kept lean
        for request_id, kept in zip(request_ids, each_kept, strict=True):
            if kept is not None and (program := program_of(*kept)) is not None:
                found.append(ScheduledRequest(request_id, program, kept[1]))
        return found

    scheduled = (find() if repeated is None
                 else repeated.requests(runtime, request_ids, each_kept, find))
    if not scheduled:
        return NO_ROWS, scheduled
    layout = StepLayout.from_offsets(request_ids, batch.query_start_loc_np[: count + 1],
                                     batch.num_computed_tokens_np[:count],
                                     padded_total=int(batch.num_tokens_after_padding))
    scheduled = acting(layout, scheduled)
    return (layout, scheduled) if scheduled else (NO_ROWS, scheduled)


@dataclasses.dataclass(frozen=True)
class StepGraph:
    """What a compiled step runs: V2's descriptor, whether the plain module tree runs (no
    compiled forward: hooks), and whether a full graph is replayed broken at the taps."""

    descriptor: Any
    module_tree: bool = False
    tap_breaks: bool = False


def step_graph(runtime: StepDoor, programs: list[ProgramData], chosen: Any, num_tokens: int,
               num_reqs: int, redispatch: Any, broken: Any = lambda descriptor: False
               ) -> StepGraph:
    """What a compiled step with `programs` runs, from V2's own choice `chosen`: V2's choice
    where the graph serves every program (or none runs); no graph where one acts at a location
    no tap serves (the module tree runs); where a tap's Python must run in a full graph, that
    graph broken at the taps if it was captured so (`broken(chosen)`), else V2's choice for the
    batch as if it held a prefill (`redispatch()`, which rules out the full decode graphs: the
    taps run between the piecewise graphs' pieces), or no graph if that too is full (a plain
    full graph replays the taps' kernels without their Python)."""
    if not programs:
        return StepGraph(chosen)
    need = runtime.graph_need(programs)
    if need is GraphNeed.MODULE_TREE:  # also where V2 picked no graph: still compiled
        return StepGraph(chosen if chosen.cg_mode == CUDAGraphMode.NONE
                         else _no_graph(chosen, num_tokens, num_reqs), module_tree=True)
    if chosen.cg_mode != CUDAGraphMode.FULL or need is GraphNeed.ANY:
        return StepGraph(chosen)
    if broken(chosen):
        return StepGraph(chosen, tap_breaks=True)
    pieces = redispatch()
    return StepGraph(pieces if pieces.cg_mode != CUDAGraphMode.FULL
                     else _no_graph(chosen, num_tokens, num_reqs))


def acting_programs(runtime: StepDoor, programs: Mapping[str, Kept], scheduler_output: Any
                    ) -> list[ProgramData]:
    """The programs of the step's scheduled requests that may act at this step
    (`Runtime.acts_at`), each request's rows starting at the computed tokens the scheduler
    gives it (a request it gives none for counts as acting)."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    if not programs or not scheduled:
        return []
    every = runtime.every_program_acts  # then no request's rows are looked up
    firsts = {} if every else computed_tokens(scheduler_output)
    acts_at = runtime.acts_at
    return [kept[0] for request_id in scheduled
            if (kept := programs.get(request_id)) is not None
            and (every or acts_at(kept[0], kept[1], firsts.get(request_id, 0)))]


def computed_tokens(scheduler_output: Any) -> dict[str, int]:
    """Each scheduled request's computed tokens before this step, as the scheduler hands them
    over (new requests' and running ones'); empty where a release names them otherwise."""
    try:
        found = {new.req_id: int(new.num_computed_tokens)
                 for new in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        found.update(zip(cached.req_ids, map(int, cached.num_computed_tokens), strict=True))
    except (AttributeError, TypeError, ValueError):
        return {}
    return found


def _no_graph(chosen: Any, num_tokens: int, num_reqs: int) -> Any:
    """The descriptor V2 itself builds for a step it runs without a CUDA graph (`need_eager`)."""
    return dataclasses.replace(chosen, cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens,
                               num_reqs=num_reqs, uniform_token_count=None, max_query_len=None)


class RunnerV2Mixin:
    """Put in front of vLLM's V2 model runner class by `engine.attach.attach`."""

    interp: EngineDoor
    interp_compiles: bool  # whether vLLM compiled the model (`runtime_loading.compiles`)
    interp_written: WrittenBlocks
    interp_editing: set[str]
    interp_programs: dict[str, Kept]
    interp_repeated: RepeatedSchedule
    interp_in_step: bool
    interp_module_tree: bool  # this step runs the plain module tree (`step_graph`)

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        result = super().load_model(*args, **kwargs)  # type: ignore[misc]
        load_runtime(self)
        self.interp_programs = {}  # V2 keeps no SamplingParams: the programs are kept here
        self.interp_repeated = RepeatedSchedule()
        self.interp_in_step = self.interp_module_tree = False
        if self.interp_compiles:
            self.get_model().register_forward_pre_hook(  # type: ignore[attr-defined]
                self._interp_before_forward)
        return result

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> Any:
        """V2's own (which makes its CUDA-graph manager, for profiling and again for real),
        then, where taps serve a compiled engine with full graphs, that manager also captures
        its full graphs broken at the taps (`engine.v2_tap_graphs`)."""
        breaks = breaks_at_taps()  # read first: a bad value stops the start before V2's work
        result = super().initialize_kv_cache(*args, **kwargs)  # type: ignore[misc]
        manager: Any = getattr(self, "cudagraph_manager", None)
        if (breaks and manager is not None and self.interp_compiles and self.interp.taps
                and manager.cudagraph_mode.has_full_cudagraphs()):
            break_at_taps(manager)
        return result

    def _interp_before_forward(self, *_: Any) -> None:
        """As V2 calls the model (no full graph): a step that must run the plain module tree
        skips vLLM's compiled forward (`skip_compiled`), so its hooks run."""
        if self.interp_module_tree:
            get_forward_context().skip_compiled = True

    def add_requests(self, scheduler_output: Any) -> None:
        """V2's own, then keep each added request's program (a request re-added after
        preemption or for streamed input brings its `sampling_params` again)."""
        super().add_requests(scheduler_output)  # type: ignore[misc]
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            data = program_data(params.extra_args if params is not None else None)
            if data is None:
                self.interp_programs.pop(new.req_id, None)
                continue
            self.interp_programs[new.req_id] = (data, int(new.prompt_len))
            if self.interp.edits(data):
                self.interp_editing.add(new.req_id)

    def finish_requests(self, scheduler_output: Any) -> None:
        """V2's own, then forget finished and preempted requests' programs (a preempted one
        comes back through `add_requests`)."""
        super().finish_requests(scheduler_output)  # type: ignore[misc]
        gone = set(scheduler_output.finished_req_ids) | set(
            scheduler_output.preempted_req_ids or ())
        for request_id in gone:
            self.interp_programs.pop(request_id, None)
        self.interp_editing.difference_update(scheduler_output.finished_req_ids)

    def update_requests(self, scheduler_output: Any) -> None:
        """Zero the blocks handed out this step that an editing request held (`kv_blocks`) —
        before V2's own update, which copies prefix blocks into fresh ones (copy-on-write) — then
        remember the blocks handed to editing requests now."""
        new_requests = scheduler_output.scheduled_new_reqs
        cached = scheduler_output.scheduled_cached_reqs
        if self.interp_written and (
                reused := self.interp_written.reused(handed_out_blocks(scheduler_output))):
            self._interp_zero_blocks(reused)
        super().update_requests(scheduler_output)  # type: ignore[misc]
        if self.interp_editing:
            for new in new_requests:
                if new.req_id in self.interp_editing:
                    self.interp_written.held_by_editing(blocks_of(new.block_ids))
            for request_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
                if request_id in self.interp_editing:
                    self.interp_written.held_by_editing(blocks_of(ids))

    def _interp_zero_blocks(self, block_ids: list[int]) -> None:
        """Zero KV-cache blocks in every attention layer with V2's own kernel (built on first
        use: vLLM builds it only for caches that always need it), else along each cache's
        blocks axis."""
        runner: Any = self
        if getattr(runner, "kv_block_zeroer", None) is None and hasattr(runner,
                                                                       "_init_kv_zero_meta"):
            runner._init_kv_zero_meta()
        zeroer = getattr(runner, "kv_block_zeroer", None)
        if zeroer is not None:
            zeroer.zero_block_ids(block_ids)
            return
        zero_blocks(list(runner.kv_caches), runner.kv_cache_config.num_blocks, block_ids)

    def prepare_inputs(self, *args: Any, **kwargs: Any) -> Any:
        """V2's inputs of one real batch, then the step's plan (its signature differs between
        releases: everything passes through)."""
        batch = super().prepare_inputs(*args, **kwargs)  # type: ignore[misc]
        layout, scheduled = scheduled_step(self.interp, self.interp_programs, batch,
                                           self.interp_repeated)
        self.interp.begin_step(layout, scheduled, compiled_forward=self.interp_compiles
                               and not self.interp_module_tree)
        self.interp_in_step = True
        return batch

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        """One step of V2, its CUDA graph chosen by `step_graph` on a compiled engine; the
        step's token rows are forgotten when it ends (the sampled rows wait for
        `sample_tokens`)."""
        try:
            with self._interp_graph_choice(scheduler_output):
                return super().execute_model(  # type: ignore[misc]
                    scheduler_output, *args, **kwargs)
        finally:
            self.interp_module_tree = False
            if self.interp_in_step:
                self.interp_in_step = False
                self.interp.end_step()

    @contextlib.contextmanager
    def _interp_graph_choice(self, scheduler_output: Any) -> Iterator[None]:
        """Within the block, V2's CUDA-graph dispatch for this step goes through `step_graph`
        (on a compiled engine whose runtime knows it; a test tells it otherwise on purpose).
        Dummy, profiling and capture runs schedule no request, so they keep V2's choice."""
        manager: Any = getattr(self, "cudagraph_manager", None)
        if manager is None or not self.interp.compiled:
            yield
            return
        dispatch = manager.dispatch

        with tap_breaks_for(manager, self.interp.count_tap_break,
                            self.interp.locations_waited_at) as mark_tap_breaks:
            def interp_dispatch(num_reqs: int, num_tokens: int, uniform_token_count: int | None,
                                *args: Any, **kwargs: Any) -> Any:
                chosen = dispatch(num_reqs, num_tokens, uniform_token_count, *args, **kwargs)
                programs = acting_programs(self.interp, self.interp_programs, scheduler_output)
                graph = step_graph(
                    self.interp, programs, chosen, num_tokens, num_reqs,
                    lambda: dispatch(num_reqs, num_tokens, None, *args,
                                     **{**kwargs, "max_query_len": None}),
                    lambda descriptor: has_broken(manager, descriptor))
                self.interp_module_tree = graph.module_tree
                mark_tap_breaks(graph.tap_breaks)
                return graph.descriptor

            with swapped(manager, "dispatch", interp_dispatch):
                yield
