"""Errors raised by vllm-runner; each names the bad input and what to do instead."""

from __future__ import annotations


class InterpError(Exception):
    """Base class for vllm-runner errors."""


class LocationError(InterpError, ValueError):
    """A location names no value of the model; the message lists the closest valid ones."""


class SAEsRefused(InterpError, ValueError):
    """SAEs the engine's workers refused at start-up (files that do not load, a site that maps
    to no location the model serves, a width not the model's); `refused` maps each name to the
    reason."""

    def __init__(self, message: str, refused: dict[str, str]) -> None:
        super().__init__(message)
        self.refused = refused

    def __reduce__(self) -> tuple[type[SAEsRefused], tuple[str, dict[str, str]]]:
        """Both arguments again when unpickled (another process may receive it)."""
        return type(self), (str(self), self.refused)


class TapsRefused(LocationError):
    """Tap patterns the engine's workers refused at start-up; `refused` maps each pattern to
    the reason, so a caller can start again without them."""

    def __init__(self, message: str, refused: dict[str, str]) -> None:
        super().__init__(message)
        self.refused = refused

    def __reduce__(self) -> tuple[type[TapsRefused], tuple[str, dict[str, str]]]:
        """Both arguments again when unpickled (another process may receive it)."""
        return type(self), (str(self), self.refused)


class UnsupportedEngine(InterpError, RuntimeError):
    """The engine runs in a way the runner has not been checked against (e.g. the V2 runner)."""


class InterventionError(InterpError, RuntimeError):
    """A request's program failed in the worker (raised by `llm.trace`; `generate` returns the
    message in `outputs[i].error` instead, so one request's failure never hides the others)."""


class EngineStartError(InterpError, RuntimeError):
    """vLLM's engine could not start (e.g. for lack of memory); the message says what to change."""


class EngineDied(InterpError, RuntimeError):
    """vLLM's engine process has exited (e.g. Ctrl-C in a terminal reaches it too) or stopped
    answering; this `LLM` cannot be used any more: start a new one."""


def saves_lost(how: str, error: BaseException, advice: str) -> str:
    """Why a request's saves are gone when moving them out of the worker failed (`how`: where
    they were going): the cause, `advice` for the user, and where to turn if it does not fit;
    one wording for the store's moves and collections and the wire's encoding."""
    return (f"its saves could not be {how} ({type(error).__name__}: {error}); {advice}; if "
            "not, please report it with the engine's log")


def after_earlier(earlier: str | None, why: str) -> str:
    """A request's error once `why` happened too: after the error its program met before, if
    any, so neither is lost."""
    return why if earlier is None else f"{earlier}; then {why}"
