"""Calls into the workers never wait forever on a dead engine (issue [H] item 4): stand-ins for
vLLM's in-process and multiprocess clients — one that answers, one whose engine is known dead,
one that dies while a call waits, one that never answers."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_runner.engine import rpc as engine_rpc
from vllm_runner.errors import EngineDied


class Engine:
    """A `vllm.LLM` stand-in whose `collective_rpc` takes `delay` seconds (or forever)."""

    def __init__(self, multiprocess: bool, dead: bool = False, delay: float | None = 0.0):
        resources = SimpleNamespace(engine_dead=dead) if multiprocess else None
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(resources=resources))
        self.delay = delay
        self.calls = 0

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls += 1
        if self.delay is None:
            threading.Event().wait()  # the engine never answers
        time.sleep(self.delay)
        return [(method, args)]


def test_an_answering_engine_answers_in_process_and_across_processes() -> None:
    for multiprocess in (False, True):
        assert engine_rpc.call(Engine(multiprocess), "m", (1,)) == [("m", (1,))]


def test_a_dead_engine_is_refused_at_once() -> None:
    engine = Engine(multiprocess=True, dead=True)
    with pytest.raises(EngineDied, match=r"has exited.*start a new LLM"):
        engine_rpc.call(engine, "interp_drop")
    assert engine.calls == 0


def test_an_engine_dying_during_a_call_ends_the_wait() -> None:
    engine = Engine(multiprocess=True, delay=None)
    threading.Timer(0.2, lambda: setattr(engine.llm_engine.engine_core.resources,
                                         "engine_dead", True)).start()
    started = time.monotonic()
    with pytest.raises(EngineDied, match="has exited"):
        engine_rpc.call(engine, "interp_collect")
    assert time.monotonic() - started < 2


def test_an_engine_found_dead_by_the_call_itself_is_engine_died() -> None:
    """The engine dies after the check before the call, and vLLM's own client raises its
    error as it sends (seen in CI: a Ctrl-C's next call got vLLM's `EngineDeadError`): the
    caller still gets `EngineDied`, with vLLM's error as the cause."""
    engine = Engine(multiprocess=True)

    def dies_as_it_sends(method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        engine.llm_engine.engine_core.resources.engine_dead = True
        raise RuntimeError("EngineCore encountered an issue")

    engine.collective_rpc = dies_as_it_sends  # type: ignore[method-assign]
    with pytest.raises(EngineDied, match="has exited") as died:
        engine_rpc.call(engine, "interp_resolve")
    assert isinstance(died.value.__cause__, RuntimeError)


def test_an_engine_that_never_answers_times_out() -> None:
    started = time.monotonic()
    with pytest.raises(EngineDied, match=r"did not answer interp_drop within 0\.3 s"):
        engine_rpc.call(Engine(multiprocess=True, delay=None), "interp_drop", timeout=0.3)
    assert time.monotonic() - started < 2
