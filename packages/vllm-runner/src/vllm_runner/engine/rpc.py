"""Calls into the engine's workers (`collective_rpc`) that never wait forever on a dead engine.

vLLM's multiprocess client waits for a utility call's answer with no timeout, and an engine
process that dies after the call was sent never answers: Ctrl-C in a terminal sends SIGINT to
the whole process group, so the engine processes stop with the script, and a cleanup call after
the `KeyboardInterrupt` blocked for over ten minutes. So a call runs in a helper thread while
this one watches the client's `engine_dead` flag (set by vLLM's process monitor) and a
deadline. In-process engines run the call here: it cannot outlive its engine.

Reads vLLM's `LLM.llm_engine.engine_core` (the core client) and its `resources.engine_dead`
(read in vLLM 0.32's source and run there; not yet run against 0.26's multiprocess client).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from vllm_runner.errors import EngineDied

#: How long a call may take before the engine counts as stopped: long enough for collecting
#: gigabytes of saves, short enough that nobody waits on a dead engine for long.
DEFAULT_TIMEOUT_S = 300.0
#: Cleanup after an interrupt: the engine either answers at once or is going away.
CLEANUP_TIMEOUT_S = 5.0
_POLL_S = 0.05


def _resources(engine: Any) -> Any:
    """The multiprocess client's shared state, or `None` for an in-process engine."""
    client = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
    return getattr(client, "resources", None)


def is_dead(engine: Any) -> bool:
    """Whether vLLM has seen the engine's process exit."""
    resources = _resources(engine)
    return bool(getattr(resources, "engine_dead", False))


def call(engine: Any, method: str, args: tuple[Any, ...] = (),
         timeout: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """`engine.collective_rpc(method, args=args)` (`engine` is a `vllm.LLM`), raising
    `EngineDied` at once if the engine's process has exited, or once it has not answered
    within `timeout` seconds, instead of waiting forever."""
    resources = _resources(engine)
    if resources is None:
        return engine.collective_rpc(method, args=args)
    if resources.engine_dead:
        raise EngineDied(_dead(method))
    outcome: dict[str, Any] = {}
    finished = threading.Event()

    def run() -> None:
        try:
            outcome["result"] = engine.collective_rpc(method, args=args)
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error
        finally:
            finished.set()

    threading.Thread(target=run, name=f"vllm-interp {method}", daemon=True).start()
    deadline = time.monotonic() + timeout
    while not finished.wait(_POLL_S):  # a short wait: Ctrl-C still reaches this thread
        if resources.engine_dead:
            raise EngineDied(_dead(method))
        if time.monotonic() > deadline:
            raise EngineDied(f"vLLM's engine did not answer {method} within {timeout:g} s; it "
                             "is stopped or stuck (a Ctrl-C in a terminal stops its processes "
                             "too): start a new LLM")
    if "error" in outcome:
        if resources.engine_dead:  # it died while the call was on its way (vLLM's own error)
            raise EngineDied(_dead(method)) from outcome["error"]
        raise outcome["error"]
    return outcome["result"]


def _dead(method: str) -> str:
    return (f"vLLM's engine process has exited, so {method} cannot run (a Ctrl-C in a terminal "
            "stops the engine's processes too); start a new LLM")
