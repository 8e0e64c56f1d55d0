"""Record real steps of vLLM's V2 model runner as a test fixture (issue [J]; run on a GPU).

    python3 benchmarks/gpu/record_v2_steps.py MODEL_DIR OUT.json

An in-process engine on a random 2-layer Llama (`check-vllm-0.33.py models DIR` makes one),
small enough that prompts are chunked and requests are preempted, with prefix caching on and
prompts sharing a prefix. For every real step it keeps what the scheduler handed over, what
V2's `prepare_inputs` built (its order, offsets, host first positions) and, as the oracle, the
device positions at each request's first row and the rows of the sampler's logits. The
adapter's unit tests replay these steps (tests/test_vllm_v2_recorded.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
if importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None:
    # A release with both runners (0.33): ask for V2. From 0.34 V2 is the only one, and vLLM
    # warns about the variable.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")

import vllm
from vllm import LLM, SamplingParams
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2ModelRunner

steps: list[dict] = []


def _blocks(groups):
    return [list(group) for group in groups] if groups else None


class Recorder:
    """Put in front of V2's runner class: records each real step."""

    def execute_model(self, scheduler_output, *args, **kwargs):
        so = scheduler_output
        self._step = None if kwargs.get("dummy_run") else {
            "new": [{"req_id": n.req_id, "prompt_len": int(n.prompt_len),
                     "num_computed_tokens": int(n.num_computed_tokens),
                     "prefill_len": len(n.prefill_token_ids or []),
                     "block_ids": _blocks(n.block_ids),
                     "extra_args": n.sampling_params.extra_args if n.sampling_params else None}
                    for n in so.scheduled_new_reqs],
            "cached": {"req_ids": list(so.scheduled_cached_reqs.req_ids),
                       "num_computed_tokens": list(so.scheduled_cached_reqs.num_computed_tokens),
                       "new_block_ids": [_blocks(b) for b in
                                         so.scheduled_cached_reqs.new_block_ids]},
            "num_scheduled_tokens": dict(so.num_scheduled_tokens),
            "finished": sorted(so.finished_req_ids),
            "preempted": sorted(so.preempted_req_ids or ()),
            "logits_rows": []}
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            if self._step is not None and "batch" in self._step:
                steps.append(self._step)

    def prepare_inputs(self, *args, **kwargs):
        batch = super().prepare_inputs(*args, **kwargs)
        count = batch.num_reqs
        offsets = batch.query_start_loc_np[: count + 1].tolist()
        self._step["batch"] = {
            "req_ids": list(batch.req_ids[:count]), "num_reqs": count,
            "num_tokens": int(batch.num_tokens),
            "num_tokens_after_padding": int(batch.num_tokens_after_padding),
            "query_start_loc_np": offsets,
            "num_computed_tokens_np": batch.num_computed_tokens_np[:count].tolist(),
            # The oracle (a device read, for the fixture only): each request's first position.
            "device_first_positions": batch.positions[offsets[:-1]].tolist()}
        return batch


def main(model: str, out: str) -> None:
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, max_num_seqs=6,
              max_num_batched_tokens=64, block_size=16, num_gpu_blocks_override=20,
              enable_prefix_caching=True, gpu_memory_utilization=0.3, max_model_len=256)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    if not isinstance(runner, V2ModelRunner):
        raise SystemExit(f"not V2: {type(runner)}")
    runner.__class__ = type("RecordedV2", (Recorder, type(runner)), {})
    model_module = runner.get_model()

    def on_logits(module, args, output):
        step = getattr(runner, "_step", None)  # the step whose sampler (or prompt logprobs) ran
        if step is not None:
            step["logits_rows"].append(int(output.shape[0]))

    model_module.logits_processor.register_forward_hook(on_logits)
    shared = list(range(1, 40))
    prompts = [[5, 6, 7], [*shared, 50, 51], [*shared, 60], list(range(100, 230)),
               list(range(300, 310)), list(range(400, 470))]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                             extra_args={"recorded": i})
              for i in range(len(prompts))]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    with open(out, "w") as handle:
        json.dump({"vllm": vllm.__version__,
                   # On: the host schedules a step ahead of the device (run-ahead steps).
                   "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
                   "runner": f"{V2ModelRunner.__module__}.{V2ModelRunner.__name__}",
                   "prompts": prompts, "steps": steps}, handle)
    preempted = sum(bool(step["preempted"]) for step in steps)
    reordered = sum(step["batch"]["req_ids"] != list(step["num_scheduled_tokens"])
                    for step in steps)
    agree = all(step["batch"]["num_computed_tokens_np"] == step["batch"]["device_first_positions"]
                for step in steps)
    print(f"RESULT steps={len(steps)} preempted_steps={preempted} reordered_steps={reordered} "
          f"host_first_positions_equal_device={agree}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
