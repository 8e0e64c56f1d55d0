"""The V2 runner's adapter without a GPU: its layout from V2's `InputBatch` and its bookkeeping
of programs and KV blocks, on fakes shaped like vLLM's objects; and that the methods it
overrides still exist on the V2 runner of the installed vLLM (CI's CPU wheel ships it)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from vllm_runner.program import EXTRA_ARGS_KEY, Program
from vllm_runner.step_plan import NO_ROWS
from vllm_runner.vllm_v2_runner import RunnerV2Mixin, scheduled_step

OVERRIDDEN = ("load_model", "add_requests", "finish_requests", "update_requests",
              "prepare_inputs", "execute_model")


class FakeRuntime:
    """What the adapter asks of the runtime, recorded."""

    def __init__(self, editing: bool = False) -> None:
        self.editing = editing
        self.steps: list[tuple] = []
        self.ended = 0
        self.forwards = {"compiled": 0, "taps": 0, "in_graph": 0, "eager": 0}

    def count_forward(self, compiled: bool, programs: bool) -> None:
        self.forwards["eager" if not compiled else "taps" if programs else "compiled"] += 1

    def program(self, data, prompt_length):
        return Program(data["program_id"], "digest", ())

    def edits(self, data) -> bool:
        return self.editing

    def begin_step(self, layout, requests) -> None:
        self.steps.append((layout, requests))

    def end_step(self) -> None:
        self.ended += 1


def batch(req_ids, counts, firsts, padded=None):
    """An `InputBatch` as V2 builds it: its own order, offsets and host first positions."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return SimpleNamespace(req_ids=list(req_ids), num_reqs=len(req_ids),
                           query_start_loc_np=offsets,
                           num_computed_tokens_np=np.asarray(firsts, dtype=np.int32),
                           num_tokens_after_padding=padded or int(offsets[-1]))


def data(program_id):
    return {"program_id": program_id, "digest": "digest", "ops": []}


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


class V2Stub:
    """The V2 runner's methods the mixin wraps, recording the order of calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def add_requests(self, scheduler_output) -> None:
        self.calls.append("add")

    def finish_requests(self, scheduler_output) -> None:
        self.calls.append("finish")

    def update_requests(self, scheduler_output) -> None:
        self.calls.append("update")

    def prepare_inputs(self, *args, **kwargs):
        self.calls.append("prepare")
        return args[0]

    def execute_model(self, scheduler_output, dummy_run=False):
        self.calls.append("execute")
        if not dummy_run:
            self.prepare_inputs(scheduler_output)


class Runner(RunnerV2Mixin, V2Stub):
    pass


def runner(editing: bool) -> Runner:
    from vllm_runner.kv_blocks import WrittenBlocks

    made = Runner()
    made.interp = FakeRuntime(editing)  # type: ignore[assignment]
    made.interp_written, made.interp_editing = WrittenBlocks(), set()
    made.interp_programs, made.interp_in_step = {}, False
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
    # Counted once, as eager: the V2 adapter runs no compiled forward.
    assert made.interp.forwards == {"compiled": 0, "taps": 0, "in_graph": 0, "eager": 1}  # type: ignore[attr-defined]


def test_the_v2_runner_of_the_installed_vllm_has_every_method_the_adapter_wraps() -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    missing = [name for name in (*OVERRIDDEN, "_init_kv_zero_meta")
               if not callable(getattr(GPUModelRunner, name, None))]
    assert missing == []
