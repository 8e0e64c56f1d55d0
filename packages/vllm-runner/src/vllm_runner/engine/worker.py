"""Worker classes handed to vLLM as dotted paths (`worker_cls`), and the RPCs the client calls.

The worker builds vLLM's own model runner, then puts the interpretability runner in front of it
(`engine.attach.attach`): V1's adapter or V2's.

The CPU worker lives in `vllm_runner.engine.cpu_worker`: importing vLLM's `cpu_worker` replaces
torch's CUDA events, streams and `pin_memory` with no-ops process-wide, so a GPU worker process
must never import it.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu_worker import Worker as GPUWorker

from vllm_runner.engine.attach import attach
from vllm_runner.engine.heap import HEAP
from vllm_runner.errors import LocationError
from vllm_runner.runtime.door import WorkerDoor
from vllm_runner.saves import shm_files, wire
from vllm_runner.saves.collection import Finished


class WorkerRPC:
    """String-named RPCs the client calls with `collective_rpc` (plain data in and out)."""

    model_runner: Any
    vllm_config: Any

    def interp_resolve(self, patterns: list[str]) -> dict[str, Any]:
        """Canonical locations for each pattern, or the error message that refuses it; and,
        for each location found, why an edit there can never be served (only those where it
        cannot: `edit_refusals`)."""
        runtime = _door(self)
        resolved, errors = {}, {}
        for pattern in patterns:
            try:
                resolved[pattern] = runtime.resolve(pattern)
            except LocationError as error:
                errors[pattern] = str(error)
        refusals = {location: reason for found in resolved.values() for location in found
                    if (reason := runtime.edit_refusal(location)) is not None}
        return {"resolved": resolved, "errors": errors, "edit_refusals": refusals}

    def interp_collect(self, finished: list[Finished], encoded: bool = True,
                       shared_memory: str | None = None) -> dict[str, Any]:
        """Saves and errors of finished requests (`saves.collection.Finished`), by program id.

        As plain data (`wire.encode`) for a client in another process — large ones through
        shared memory where the client sees the same as this worker (`shared_memory`, its
        `shm_files.identity`) and this is the engine's only worker; as the tensors themselves
        (`encoded=False`) for an in-process client, which saves the copies."""
        try:
            if not encoded:
                return dict(_door(self).collect(finished))
            shared = (shared_memory is not None and shared_memory == shm_files.identity()
                      and getattr(self.vllm_config.parallel_config, "world_size", 1) == 1)
            files = wire.SharedFiles() if shared else None
            try:
                collected = _door(self).collect(finished, files.places if files else None)
                return wire.encode(collected, views=results_reach_msgpack(self.vllm_config),
                                   files=files)
            except BaseException:  # no client will open the files
                if files is not None:
                    files.discard()
                raise
        finally:
            HEAP.after_collection()  # what the collected saves held, back to the system

    def interp_support(self) -> dict[str, str | None]:
        """Every value of the model → `None` if available, else the reason. Runs nothing."""
        return _door(self).support()

    def interp_layouts(self) -> dict[str, list[str]]:
        """Every available value's axis names, by location. Runs nothing."""
        return _door(self).layouts()

    def interp_drop(self, program_ids: list[str]) -> None:
        """Free the saves of requests that will never be collected."""
        _door(self).drop(program_ids)

    def interp_forget_cut_step(self) -> None:
        """After a Ctrl-C stopped an in-process engine between a step's forward and its sampling
        (vLLM samples in a second call): forget that step, whose requests are aborted, or vLLM's
        runner refuses every later step ("sample_tokens() must be called after
        execute_model() returns None"). Nothing to do when no step was cut there."""
        if getattr(self.model_runner, "execute_model_state", None) is not None:
            self.model_runner.execute_model_state = None

    def interp_held(self) -> dict[str, int]:
        """What this worker holds for requests not collected yet (`SaveStore.held`)."""
        return _door(self).saves_held()

    def interp_taps(self) -> dict[str, Any]:
        """The canonical locations this worker serves from inside the compiled model
        (`"taps"`), and the tap patterns it refused, with the reasons (`"refused"`)."""
        runtime = _door(self)
        return {"taps": sorted(runtime.taps), "refused": dict(runtime.refused_taps)}

    def interp_saes(self) -> dict[str, Any]:
        """The SAEs this worker loaded (`"loaded"`: where each reads, its architecture and
        sizes) and those it refused, with the reasons (`"refused"`)."""
        return _door(self).saes()

    def interp_load_saes(self, paths: dict[str, Any]) -> dict[str, Any]:
        """Load more SAEs (name -> path and site: `settings.saes_config`) on this worker
        (`LLM.load_saes`); `interp_saes`'s answer after."""
        return _door(self).load_saes(paths)

    def interp_forwards(self) -> dict[str, int]:
        """Forwards run so far, by path (`Runtime.forwards`)."""
        return dict(_door(self).forwards)


def results_reach_msgpack(vllm_config: Any) -> bool:
    """Whether an RPC's result goes from this worker straight to vLLM's msgpack encoder: the
    worker runs in the engine core's process (`UniProcExecutor`), not in a process of its own
    whose results are pickled on the way (`mp`, `ray`; see `wire`)."""
    return vllm_config.parallel_config.distributed_executor_backend == "uni"


class InterpGPUWorker(WorkerRPC, GPUWorker):
    """vLLM's GPU worker with the interpretability runner (V1 or V2: `engine.attach`)."""

    def init_device(self) -> None:
        super().init_device()
        attach(self.model_runner)


def _door(worker: Any) -> WorkerDoor:
    """The runtime of a worker's model runner, as the worker's RPCs may use it."""
    door: WorkerDoor = worker.model_runner.interp
    return door
