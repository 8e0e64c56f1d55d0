"""Collecting finished requests' saves from the workers: one sequence for `LLM`, `AsyncLLM`
and the server (`server.state`).

A finished request is named to the workers by its program id and how many of its positions
belong to its final output (`saves.collection.Finished`); they answer with its saves and its
error. A client in the engine core's process takes the tensors as they are; one in another
process takes plain data (`saves.wire`), large saves through shared memory where it can open
the worker's files (`settings.shared_saves_memory`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_runner.saves import wire
from vllm_runner.saves.collection import Finished, finished_request
from vllm_runner.settings import shared_saves_memory

#: The workers' RPC that collects (`engine.worker.WorkerRPC.interp_collect`).
COLLECT_RPC = "interp_collect"


def finished_output(output: Any, program_id: str) -> Finished:
    """A finished vLLM `RequestOutput` as the workers collect it: its prompt and its first
    sample's tokens (each sample with a program is a request of its own)."""
    generated = len(output.outputs[0].token_ids) if output.outputs else 0
    return finished_request(program_id, len(output.prompt_token_ids or ()), generated)


def collect_arguments(finished: Sequence[Finished], in_process: bool) -> tuple[Any, ...]:
    """The collecting RPC's arguments for a client in the engine core's process or not."""
    return (list(finished), not in_process, None if in_process else shared_saves_memory())


def collected_from(data: Any, in_process: bool) -> dict[str, dict[str, Any]]:
    """The workers' answer, by program id (each `saves.collection.Collected`: its saves and
    its error), as the client reads it."""
    return data if in_process else wire.decode(data)


async def collect_async(engine: Any, finished: Sequence[Finished]
                        ) -> dict[str, dict[str, Any]]:
    """Collect through an asyncio engine (vLLM's `AsyncLLM`), whose core runs in another
    process."""
    (data, *_) = await engine.collective_rpc(COLLECT_RPC,
                                             args=collect_arguments(finished, False))
    return collected_from(data, False)
