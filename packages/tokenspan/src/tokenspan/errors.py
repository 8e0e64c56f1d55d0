"""Errors raised by tokenspan. All are `ValueError`s, so callers that validate input catch them."""

from __future__ import annotations


class SpanError(ValueError):
    """Base class for every error tokenspan raises about rows, spans and layouts."""


class LayoutError(SpanError):
    """A step layout is inconsistent: the message names the offending request and why."""


class SpanShapeError(SpanError):
    """A value written through a span does not fit it; raised before anything is written."""
