"""Errors raised by vllm-envoys; each says what to do next."""

from __future__ import annotations


class EnvoyError(Exception):
    """Base class for vllm-envoys errors."""


class Unavailable(EnvoyError, RuntimeError):
    """A value cannot be served here (a decode step, a gated MLP, ...); the message says why."""

    def __init__(self, location: str, reason: str) -> None:
        super().__init__(f"{location} is unavailable: {reason}")
        self.location = location
        self.reason = reason


class ReadOnly(EnvoyError, AttributeError):
    """A derived value (an attention pattern, next-token probabilities) was written to."""


class ValueShapeError(EnvoyError, ValueError):
    """A written value does not have the shape that was read; nothing was written."""


class UnknownFamily(EnvoyError, LookupError):
    """No family module covers a model's `model_type`."""


class UnknownValue(EnvoyError, LookupError):
    """A location names no value of the standardized model."""
