"""vLLM's Ray executor on a CPU, for the tests: a local Ray cluster whose slots vLLM can place
its ranks on.

vLLM's CPU platform names no Ray resource for a rank (`CpuPlatform.ray_device_key` is empty), so
its Ray executor refuses to start there ("current platform cpu does not support ray"); the rest
of the executor (`RayExecutorV2`: a placement group, one Ray actor per rank, vLLM's message
queues between them and the engine core) does not depend on the platform. The tests give the
CPU platform the key "GPU", in this process and in every Ray worker process, and the local
cluster one placeholder GPU slot per rank: GPU is the one accelerator resource Ray hands out ids
for on any machine (it then sets `CUDA_VISIBLE_DEVICES` in the actors, which the CPU build of
torch ignores). vLLM's own Ray executor then runs our worker, as it does on GPUs, where none of
this is needed. The engine core must run in the process that called `start_local_cluster`
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): a process of its own would not have the key.
"""

from __future__ import annotations

import ray

#: Ray's shared-memory object store, kept small: the ranks exchange nothing through it.
OBJECT_STORE_BYTES = 128 * 2**20


def give_cpu_a_ray_key() -> None:
    """Let vLLM's Ray executor place CPU ranks on the cluster's placeholder GPU slots."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.ray_device_key = "GPU"


def start_local_cluster(ranks: int) -> None:
    """Start a Ray cluster in this process (ended with it) with a slot for each of `ranks`, and
    the CPU platform's key here and in every worker process Ray starts."""
    from vllm_runner.cli.extract_ray import fit_ray_socket_paths

    fit_ray_socket_paths()  # the test runner's temporary folder is a long path
    ray.init(num_cpus=ranks, num_gpus=ranks, include_dashboard=False,
             object_store_memory=OBJECT_STORE_BYTES,
             runtime_env={"worker_process_setup_hook": "ray_cpu.give_cpu_a_ray_key"})
    give_cpu_a_ray_key()
