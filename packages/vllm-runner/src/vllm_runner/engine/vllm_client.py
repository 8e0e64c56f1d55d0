"""The engine adapter on the client side: what `LLM` reads of vLLM's offline `LLM` beyond its
public methods. Checked against vLLM 0.26 and 0.32 (see `compat.CHECKED_VLLM`)."""

from __future__ import annotations

from typing import Any


def next_request_number(engine: Any) -> int:
    """The number vLLM's `LLM` gives the next request it adds: it names requests from its
    counter, in order (`str(number)`)."""
    return int(engine.request_counter.counter)


def request_ids_since(engine: Any, first: int) -> list[str]:
    """The ids of every request added since `next_request_number` was `first`."""
    return [str(number) for number in range(first, next_request_number(engine))]


def abort(engine: Any, request_ids: list[str]) -> None:
    """Abort requests, finished or not (vLLM ignores ids it no longer knows)."""
    engine.llm_engine.abort_request(request_ids)


def runs_in_process(engine: Any) -> bool:
    """Whether the worker that keeps the saves runs in this process (vLLM's in-process engine
    core with its single-process executor), so results need no serialization."""
    executor = getattr(engine.llm_engine, "model_executor", None)  # in-process only
    return type(executor).__name__ == "UniProcExecutor"
