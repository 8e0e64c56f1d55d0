"""The errors tpfragments raises, each naming the location, the rule and the shapes involved.

A wrong shape under tensor parallelism is easy to get and hard to see: the collective may even
succeed and hand back a tensor of plausible size holding the wrong numbers. So every check that
can fail says where (the location), under which layout (the rule) and what it saw (the shapes),
in one line a user can act on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "FragmentError",
    "GroupSizeError",
    "PieceShapeError",
    "UnknownLocationError",
    "UnsupportedLayerError",
    "WholeShapeError",
]

UNNAMED = "<unnamed value>"


def _format_shape(shape: Sequence[int] | None) -> str:
    if shape is None:
        return "none"
    return str(tuple(int(n) for n in shape))


class FragmentError(ValueError):
    """A value, its rule and its group do not fit together.

    Attributes:
        location: where the value was met (`None` when the caller gave no name).
        rule: the rule the value was checked against (its `repr` is in the message).
        shapes: the shapes involved, by role (e.g. `{"piece": (4, 6), "whole": (4, 12)}`).
    """

    def __init__(
        self,
        problem: str,
        *,
        location: str | None,
        rule: object,
        shapes: Mapping[str, Sequence[int] | None] | None = None,
    ) -> None:
        self.problem = problem
        self.location = location
        self.rule = rule
        self.shapes = {role: None if s is None else tuple(int(n) for n in s)
                       for role, s in (shapes or {}).items()}
        shown = ", ".join(f"{role} {_format_shape(s)}" for role, s in self.shapes.items())
        message = f"{location or UNNAMED}: {problem} [rule {rule!r}"
        message += f"; {shown}]" if shown else "]"
        super().__init__(message)


class PieceShapeError(FragmentError):
    """A rank's piece does not have a shape its rule allows (wrong rank, width or dtype)."""


class WholeShapeError(FragmentError):
    """A whole handed back (an edit or a replacement) does not have the shape the rule expects."""


class GroupSizeError(FragmentError):
    """The group's size does not divide the sharded dimension (or its units, e.g. heads)."""


class UnknownLocationError(LookupError):
    """A location was asked for that no rule was registered under."""

    def __init__(self, location: str, known: Sequence[str]) -> None:
        self.location = location
        self.known = tuple(known)
        preview = ", ".join(sorted(self.known)[:8])
        more = f" (and {len(self.known) - 8} more)" if len(self.known) > 8 else ""
        super().__init__(
            f"{location}: no rule is registered for this location; "
            f"known locations: {preview or 'none'}{more}"
        )

    def __str__(self) -> str:
        # LookupError would quote the message like a dict key; keep it readable.
        return str(self.args[0])


class UnsupportedLayerError(TypeError):
    """The vLLM adapter met a tensor-parallel layer whose layout it has not been checked against.

    Guessing a layout would hand users wrong numbers without a word, so the adapter refuses.
    """
