"""The V2 runner's adapter without a GPU: its layout from V2's `InputBatch`, its bookkeeping
of programs and KV blocks, and its CUDA-graph choice on a compiled engine, on fakes shaped like
vLLM's objects (V2's own `BatchExecutionDescriptor`); and that the methods it overrides still
exist on the V2 runner of the installed vLLM (CI's CPU wheel ships it)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import (
    BatchExecutionDescriptor,
    CudaGraphManager,
    ModelCudaGraphManager,
)
from vllm_runner import ops
from vllm_runner.engine import v2_runner as vllm_v2_runner
from vllm_runner.engine.repeated_schedule import RepeatedSchedule
from vllm_runner.engine.v2_runner import RunnerV2Mixin, StepGraph, scheduled_step, step_graph
from vllm_runner.engine.v2_tap_graphs import TapBrokenGraphs
from vllm_runner.ops import op_from_data
from vllm_runner.ops.program import EXTRA_ARGS_KEY, Program
from vllm_runner.runtime.door import GraphNeed
from vllm_runner.runtime.step_plan import NO_ROWS

OVERRIDDEN = ("load_model", "initialize_kv_cache", "add_requests", "finish_requests",
              "update_requests", "prepare_inputs", "execute_model")


class FakeRuntime:
    """What the adapter asks of the runtime, recorded."""

    def __init__(self, editing: bool = False, compiled: bool = False,
                 module_tree: bool = False, tap_python: bool = False) -> None:
        self.editing = editing
        self.compiled = compiled
        self.module_tree, self.tap_python = module_tree, tap_python
        self.steps: list[tuple] = []
        self.ended = 0
        self.forwards = {"compiled": 0, "taps": 0, "in_graph": 0, "eager": 0, "tap_breaks": 0,
                         "tap_breaks_joined": 0}
        self.any_failed = False

    def note_edits(self) -> None:
        pass


    def count_tap_break(self, joined: bool) -> None:
        self.forwards["tap_breaks"] += 1
        self.forwards["tap_breaks_joined"] += int(joined)

    def locations_waited_at(self) -> list[str]:
        return ["layers.0.layer_output"]  # where the default program saves

    def program(self, data, prompt_length):
        return Program(data["program_id"], "digest", tuple(
            op_from_data(op) for op in data["ops"]) or (ops.Save("layers.0.layer_output"),))

    every_program_acts = False  # as after a prompt-only program: each request is asked

    def acts_at(self, data, prompt_length, first_position) -> bool:
        return first_position < prompt_length or not self.program(data, 0).prompt_only

    def edits(self, data) -> bool:
        return self.editing

    def begin_step(self, layout, requests, compiled_forward=None) -> None:
        self.steps.append((layout, requests))
        if compiled_forward is not None:
            self.forwards["eager" if not compiled_forward else "taps" if requests
                          else "compiled"] += 1

    def end_step(self) -> None:
        self.ended += 1

    def graph_need(self, programs) -> GraphNeed:
        return (GraphNeed.MODULE_TREE if self.module_tree else
                GraphNeed.PIECES if self.tap_python else GraphNeed.ANY)


def batch(req_ids, counts, firsts, padded=None):
    """An `InputBatch` as V2 builds it: its own order, offsets and host first positions."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return SimpleNamespace(req_ids=list(req_ids), num_reqs=len(req_ids),
                           query_start_loc_np=offsets,
                           num_computed_tokens_np=np.asarray(firsts, dtype=np.int32),
                           num_tokens_after_padding=padded or int(offsets[-1]))


def data(program_id, *program: ops.Op):
    return {"program_id": program_id, "digest": "digest", "ops": [op.to_data() for op in program]}


def test_the_layout_follows_v2s_own_order_offsets_and_host_positions() -> None:
    """V2 orders a step itself (decodes first, then by query length): rows belong to requests
    in `req_ids` order, whatever order the requests arrived in."""
    programs = {"b": (data("pb"), 5), "c": (data("pc"), 40)}
    step = batch(["a", "b", "c"], [1, 1, 16], [7, 5, 16], padded=24)
    layout, scheduled = scheduled_step(FakeRuntime(), programs, step)  # type: ignore[arg-type]
    assert [request.request_id for request in scheduled] == ["b", "c"]
    assert [request.prompt_length for request in scheduled] == [5, 40]
    assert list(layout.keys) == ["a", "b", "c"]
    assert (layout["b"].start, layout["b"].stop, layout["b"].first_position) == (1, 2, 5)
    assert (layout["c"].start, layout["c"].stop, layout["c"].first_position) == (2, 18, 16)
    assert layout.padded_total == 24


def test_a_step_without_programs_builds_no_layout() -> None:
    layout, scheduled = scheduled_step(FakeRuntime(), {}, batch(["a"], [3], [0]))  # type: ignore[arg-type]
    assert layout is NO_ROWS and scheduled == []


def test_a_request_whose_program_acts_on_its_prompt_only_is_left_out_past_its_prompt() -> None:
    """`Save(..., positions=(-1,))` has nothing to do at a generated token's step: the request
    is not scheduled there (its step runs as if it had no program), but is on its prompt's."""
    last = data("pl", ops.Save("layers.0.layer_output", positions=(-1,)))
    programs = {"a": (last, 5), "b": (data("pb"), 5), "c": (last, 20)}
    layout, scheduled = scheduled_step(FakeRuntime(), programs,  # type: ignore[arg-type]
                                       batch(["a", "b", "c"], [1, 1, 8], [5, 7, 8]))
    assert [request.request_id for request in scheduled] == ["b", "c"]
    assert layout["c"].first_position == 8
    alone = {"a": programs["a"]}
    assert scheduled_step(FakeRuntime(), alone, batch(["a"], [1], [6])) == (  # type: ignore[arg-type]
        NO_ROWS, [])


def test_the_graph_is_chosen_for_the_programs_that_act_at_the_step() -> None:
    """`acting_programs` reads each scheduled request's computed tokens from the scheduler's
    output (new and running requests); a request it has none for counts as acting."""
    last = data("pl", ops.Save("layers.0.layer_output", positions=(-1,)))
    every = data("pe")
    programs = {"new": (last, 4), "past": (last, 4), "prompt": (last, 9), "plain": (every, 4),
                "unknown": (last, 4)}
    output = SimpleNamespace(
        num_scheduled_tokens={name: 1 for name in [*programs, "none"]},
        scheduled_new_reqs=[SimpleNamespace(req_id="new", num_computed_tokens=4)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["past", "prompt", "plain"],
                                              num_computed_tokens=[6, 8, 6]))
    found = vllm_v2_runner.acting_programs(FakeRuntime(), programs, output)  # type: ignore[arg-type]
    # "prompt", "plain" and "unknown"; "new" and "past" are past their prompts
    assert [program["program_id"] for program in found] == ["pl", "pe", "pl"]
    assert vllm_v2_runner.computed_tokens(SimpleNamespace()) == {}


def test_where_every_program_acts_at_every_step_no_request_is_asked() -> None:
    """Before any prompt-only program was decoded, the step's programs are every scheduled
    request's, in the scheduler's order, without its computed tokens (none are given here)."""
    runtime = FakeRuntime()
    runtime.every_program_acts = True
    runtime.acts_at = None  # never asked
    programs = {"a": (data("pa"), 4), "b": (data("pb"), 9)}
    output = SimpleNamespace(num_scheduled_tokens={"b": 1, "none": 2, "a": 1})
    found = vllm_v2_runner.acting_programs(runtime, programs, output)  # type: ignore[arg-type]
    assert [program["program_id"] for program in found] == ["pb", "pa"]


def test_the_scheduler_output_of_the_installed_vllm_names_the_computed_tokens() -> None:
    """The fields `computed_tokens` reads, on the installed vLLM's own classes."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

    assert "num_computed_tokens" in NewRequestData.__dataclass_fields__
    assert {"req_ids", "num_computed_tokens"} <= set(CachedRequestData.__dataclass_fields__)


class V2Stub:
    """The V2 runner's methods the mixin wraps, recording the order of calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def add_requests(self, scheduler_output) -> None:
        self.calls.append("add")

    def initialize_kv_cache(self, kv_cache_config, is_profiling=False) -> None:
        """V2 makes its graph manager here, for profiling and again for real."""
        self.calls.append("kv cache")
        self.cudagraph_manager = object.__new__(ModelCudaGraphManager)
        self.cudagraph_manager.cudagraph_mode = self.cudagraph_mode

    def finish_requests(self, scheduler_output) -> None:
        self.calls.append("finish")

    def update_requests(self, scheduler_output) -> None:
        self.calls.append("update")

    def prepare_inputs(self, *args, **kwargs):
        self.calls.append("prepare")
        return args[0]

    def execute_model(self, scheduler_output, dummy_run=False):
        """V2's order: its requests added, the graph dispatched, inputs prepared, the model
        called (unless a full graph replays)."""
        self.calls.append("execute")
        if dummy_run:
            return None
        manager = getattr(self, "cudagraph_manager", None)
        chosen = manager and manager.dispatch(3, 3, 1, num_active_loras=0, max_query_len=1)
        self.prepare_inputs(scheduler_output)
        if chosen is not None and chosen.cg_mode != CUDAGraphMode.FULL:
            self._interp_before_forward(None, ())
        elif chosen is not None and hasattr(manager, "run_fullgraph"):
            manager.run_fullgraph(chosen)
        return chosen


class Runner(RunnerV2Mixin, V2Stub):
    pass


def runner(editing: bool, **runtime: bool) -> Runner:
    from vllm_runner.engine.kv_blocks import WrittenBlocks

    made = Runner()
    made.interp = FakeRuntime(editing, **runtime)  # type: ignore[assignment]
    made.interp_compiles = made.interp.compiled  # type: ignore[attr-defined]
    made.interp_written, made.interp_editing = WrittenBlocks(), set()
    made.interp_programs, made.interp_in_step, made.interp_module_tree = {}, False, False
    made.interp_repeated = RepeatedSchedule()
    zeroed: list[list[int]] = []
    made._interp_zero_blocks = lambda ids: (zeroed.append(ids), made.calls.append("zero"))  # type: ignore[method-assign]
    made.zeroed = zeroed  # type: ignore[attr-defined]
    return made


def new_request(req_id, blocks, program_id=None, prompt_len=4):
    extra = {EXTRA_ARGS_KEY: data(program_id)} if program_id else None
    return SimpleNamespace(req_id=req_id, block_ids=(blocks,), prompt_len=prompt_len,
                           sampling_params=SimpleNamespace(extra_args=extra))


def scheduler_output(new=(), cached=(), finished=(), preempted=()):
    return SimpleNamespace(
        scheduled_new_reqs=list(new), finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              new_block_ids=[b for _, b in cached]))


def test_programs_are_kept_from_when_v2_adds_a_request_until_it_finishes_or_yields() -> None:
    made = runner(editing=False)
    made.add_requests(scheduler_output(new=[new_request("a", [1], "pa"),
                                            new_request("b", [2])]))
    assert made.interp_programs == {"a": (data("pa"), 4)}
    made.finish_requests(scheduler_output(preempted=["a"]))
    assert made.interp_programs == {}
    made.add_requests(scheduler_output(new=[new_request("a", [3], "pa", prompt_len=4)]))
    assert "a" in made.interp_programs  # resumed: V2 adds it again with its sampling params


def test_blocks_an_editing_request_held_are_zeroed_before_v2s_update_when_reused() -> None:
    made = runner(editing=True)
    step = scheduler_output(new=[new_request("a", [1, 2], "pa")])
    made.add_requests(step)
    made.update_requests(step)
    assert made.zeroed == []  # fresh blocks: nothing to zero
    step = scheduler_output(cached=[("a", ([5],))])
    made.update_requests(step)  # a running editing request's new block is remembered too
    made.finish_requests(scheduler_output(finished=["a"]))
    made.calls.clear()
    made.update_requests(scheduler_output(new=[new_request("b", [2, 9])],
                                          cached=[("c", ([5],)), ("d", None)]))
    assert made.zeroed == [[2, 5]]  # 2 and 5 were written by "a"; 9 never was
    assert made.calls == ["zero", "update"]  # before V2's update, which copies prefix blocks


def test_the_step_ends_only_after_a_real_batch_was_prepared() -> None:
    made = runner(editing=False)
    step = batch(["a"], [2], [0])
    made.execute_model(step, dummy_run=True)
    assert made.interp.ended == 0 and made.interp.steps == []  # type: ignore[attr-defined]
    made.execute_model(step)
    assert made.interp.ended == 1 and len(made.interp.steps) == 1  # type: ignore[attr-defined]
    # Counted once, as eager: this engine does not compile.
    assert made.interp.forwards == {"compiled": 0, "taps": 0, "in_graph": 0, "eager": 1,  # type: ignore[attr-defined]
                                    "tap_breaks": 0, "tap_breaks_joined": 0}


def test_the_v2_runner_of_the_installed_vllm_has_every_method_the_adapter_wraps() -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    missing = [name for name in (*OVERRIDDEN, "_init_kv_zero_meta")
               if not callable(getattr(GPUModelRunner, name, None))]
    assert missing == []


def descriptor(mode: CUDAGraphMode, tokens: int = 4, requests: int | None = 4,
               uniform: int | None = 1) -> BatchExecutionDescriptor:
    return BatchExecutionDescriptor(cg_mode=mode, num_tokens=tokens, num_reqs=requests,
                                    uniform_token_count=uniform, max_query_len=uniform)


FULL, PIECES = descriptor(CUDAGraphMode.FULL), descriptor(CUDAGraphMode.PIECEWISE, requests=None,
                                                          uniform=None)
NONE = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=3, num_reqs=3)


@pytest.mark.parametrize(("programs", "needs", "chosen", "again", "broken", "expected"), [
    ([], "module tree", FULL, FULL, True, StepGraph(FULL)),  # no program: V2's choice, untouched
    (["p"], "", FULL, FULL, True, StepGraph(FULL)),  # served inside the graph: it replays
    # hooks elsewhere: no graph, no compiled forward
    (["p"], "module tree", FULL, PIECES, True, StepGraph(NONE, module_tree=True)),
    (["p"], "module tree", PIECES, PIECES, False, StepGraph(NONE, module_tree=True)),
    # a tap's Python: the full graph broken at the taps where there is one
    (["p"], "tap python", FULL, PIECES, True, StepGraph(FULL, tap_breaks=True)),
    (["p"], "tap python", FULL, PIECES, False, StepGraph(PIECES)),  # else between the pieces
    (["p"], "tap python", PIECES, FULL, True, StepGraph(PIECES)),
    (["p"], "tap python", FULL, FULL, False, StepGraph(NONE)),  # no piecewise graph: none
    (["p"], "module tree", NONE, NONE, False, StepGraph(NONE, module_tree=True)),
    (["p"], "tap python", NONE, FULL, True, StepGraph(NONE)),
])
def test_a_compiled_step_keeps_v2s_graph_unless_its_programs_need_the_module_tree_or_a_taps_python(
        programs, needs, chosen, again, broken, expected) -> None:
    runtime = FakeRuntime(compiled=True, module_tree=needs == "module tree",
                          tap_python=needs == "tap python")
    picked = step_graph(runtime, programs, chosen, 3, 3,  # type: ignore[arg-type]
                        lambda: again, lambda descriptor: broken and descriptor == chosen)
    assert picked == expected


class FakeGraphs:
    """V2's CUDA-graph manager, choosing a full graph for uniform decodes (as V2 does)."""

    def __init__(self) -> None:
        self.asked: list[tuple] = []

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras,
                 max_query_len=None, num_ubatches=1):
        self.asked.append((uniform_token_count, max_query_len))
        return FULL if uniform_token_count is not None and max_query_len is not None else PIECES


class BrokenFakeGraphs(FakeGraphs, TapBrokenGraphs):
    """The same, holding V2's full graph for `FULL` and one broken at the taps
    (`engine.v2_tap_graphs`), each recording its replays."""

    def __init__(self) -> None:
        super().__init__()
        self.replayed: list[str] = []
        self.graphs = {FULL: SimpleNamespace(replay=lambda: self.replayed.append("v2"))}
        # A broken replay asks the runtime where the step waits (`compiled.replays`).
        self.interp_broken = {FULL: SimpleNamespace(
            replay_for=lambda waited_at: self.replayed.append(
                "broken" if list(waited_at) == ["layers.0.layer_output"] else "broken, elsewhere")
            is None)}  # "joined" (`compiled.replays`)
        self.interp_break_at_taps, self.interp_replayed = False, lambda joined: None
        self.interp_waited_at = lambda: ()


@pytest.mark.parametrize(("needs", "graphs", "mode", "skipped", "counted", "broken"), [
    ("module tree", FakeGraphs, CUDAGraphMode.NONE, True, "eager", None),
    ("tap python", FakeGraphs, CUDAGraphMode.PIECEWISE, False, "taps", None),
    ("", FakeGraphs, CUDAGraphMode.FULL, False, "taps", None),
    ("tap python", BrokenFakeGraphs, CUDAGraphMode.FULL, False, "taps", True),
    ("", BrokenFakeGraphs, CUDAGraphMode.FULL, False, "taps", False),
    ("module tree", BrokenFakeGraphs, CUDAGraphMode.NONE, True, "eager", False),
])
def test_a_compiled_step_with_programs_runs_the_graph_its_programs_allow(
        monkeypatch: pytest.MonkeyPatch, needs: str, graphs: type, mode: CUDAGraphMode,
        skipped: bool, counted: str, broken: bool | None) -> None:
    """Through the mixin: V2's dispatch is asked through `step_graph` during the step only, a
    step that needs the module tree skips vLLM's compiled forward as the model is called, a
    step that needs a tap's Python replays the full graph broken at the taps where one was
    captured, and the forward is counted by what it runs."""
    context = SimpleNamespace(skip_compiled=False)
    monkeypatch.setattr(vllm_v2_runner, "get_forward_context", lambda: context)
    made = runner(editing=False, compiled=True, module_tree=needs == "module tree",
                  tap_python=needs == "tap python")
    manager = made.cudagraph_manager = graphs()  # type: ignore[attr-defined]
    made.add_requests(scheduler_output(new=[new_request("a", [1], "pa")]))
    step = batch(["a"], [1], [4])
    step.num_scheduled_tokens = {"a": 1}
    assert made.execute_model(step).cg_mode == mode
    assert context.skip_compiled is skipped
    assert made.interp.forwards[counted] == 1  # type: ignore[attr-defined]
    assert made.interp.forwards["tap_breaks"] == int(bool(broken))  # type: ignore[attr-defined]
    assert made.interp.forwards["tap_breaks_joined"] == int(  # type: ignore[attr-defined]
        bool(broken))
    if broken is not None:  # which graph the full-graph step replayed
        assert manager.replayed == (["broken"] if broken else ["v2"] if mode == FULL.cg_mode
                                    else [])
    assert "dispatch" not in vars(manager)  # V2's own method again after the step
    assert getattr(manager, "interp_break_at_taps", False) is False  # and its own graphs
    assert made.interp_module_tree is False


def test_v2s_graph_dispatch_still_takes_what_the_adapter_passes() -> None:
    """`step_graph` asks again with `uniform_token_count` positional and `max_query_len` by
    name, as `execute_model` does; and V2's descriptor has the fields it replaces."""
    names = list(inspect.signature(CudaGraphManager.dispatch).parameters)
    assert names[1:4] == ["num_reqs", "num_tokens", "uniform_token_count"]
    assert "max_query_len" in names
    fields = BatchExecutionDescriptor.__dataclass_fields__
    assert {"cg_mode", "num_tokens", "num_reqs", "uniform_token_count", "max_query_len"} <= set(
        fields)


@pytest.mark.parametrize(("compiled", "taps", "mode", "breaks"), [
    (True, {"layers.0.layer_output"}, CUDAGraphMode.FULL_AND_PIECEWISE, True),
    (True, {"layers.0.layer_output"}, CUDAGraphMode.FULL_DECODE_ONLY, True),
    (True, {"layers.0.layer_output"}, CUDAGraphMode.PIECEWISE, False),  # no full graph
    (True, set(), CUDAGraphMode.FULL_AND_PIECEWISE, False),  # no tap: nothing to break at
    (False, {"layers.0.layer_output"}, CUDAGraphMode.FULL, False),  # not compiled: no tap op
])
def test_v2s_graph_manager_captures_broken_full_graphs_where_taps_serve_a_compiled_engine(
        compiled: bool, taps: set[str], mode: CUDAGraphMode, breaks: bool) -> None:
    made = runner(editing=False, compiled=compiled)
    made.interp.taps = taps  # type: ignore[attr-defined]
    made.cudagraph_mode = mode  # type: ignore[attr-defined]
    made.initialize_kv_cache(None, is_profiling=True)
    assert isinstance(made.cudagraph_manager, TapBrokenGraphs) is breaks  # type: ignore[attr-defined]
    assert isinstance(made.cudagraph_manager, ModelCudaGraphManager)  # type: ignore[attr-defined]


def test_the_broken_captures_are_left_out_where_the_setting_says_so(monkeypatch) -> None:
    """`VLLM_INTERP_BREAK_AT_TAPS=0`: V2's own graphs only (steps with a tap's Python run the
    piecewise graphs); any value but 0 or 1 is refused, naming the setting."""
    monkeypatch.setenv("VLLM_INTERP_BREAK_AT_TAPS", "0")
    made = runner(editing=False, compiled=True)
    made.interp.taps = {"layers.0.layer_output"}  # type: ignore[attr-defined]
    made.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE  # type: ignore[attr-defined]
    made.initialize_kv_cache(None, is_profiling=True)
    assert not isinstance(made.cudagraph_manager, TapBrokenGraphs)  # type: ignore[attr-defined]
    monkeypatch.setenv("VLLM_INTERP_BREAK_AT_TAPS", "no")
    with pytest.raises(ValueError, match="VLLM_INTERP_BREAK_AT_TAPS='no' must be 1"):
        made.initialize_kv_cache(None, is_profiling=True)
