"""`Fragments`: which values are pieces, and one visit to such a value.

A visit is one time the engine hands over a value at a location (a forward hook firing). The
runner asks `Fragments.whole` for the whole value once, gives that one whole to every reader
(any number of requests, saves and edits), then calls `back` once to get what the engine should
carry on with. That is at most one collective per visit, however many readers there are: the
gather lives here, not in the readers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

from torch import Tensor

from .errors import UnknownLocationError, WholeShapeError
from .group import Group
from .rules import Rule

__all__ = ["Back", "Entry", "Fragments"]


class Entry(NamedTuple):
    """What is registered for one location: the value's `rule` over the ranks of `group`."""

    rule: Rule
    group: Group


class Back:
    """Hands one visited value back to the engine, rewriting this rank's piece only if needed.

    Made by `Fragments.whole`; call it once, when every reader is done:

    - `back()` (or `back(whole)`): the whole as it now stands. If it was not edited, the engine
      gets back the very object it handed over, bit for bit. If it was edited in place (its
      version counter moved), each rank gets the piece the rule cuts from the edit.
    - `back(replacement)`: a new tensor of the whole's shape replaces the value.

    The new piece has the original piece's dtype and device (a replacement is converted). The
    call runs no collective, so ranks may call it without waiting for each other; they must all
    see the same edit, as user code that runs identically on every rank does.
    """

    def __init__(self, *, location: str, rule: Rule, group: Group, value: object,
                 piece: Tensor, whole: Tensor, reference: Tensor | None) -> None:
        self.location = location
        self.rule = rule
        self.group = group
        self._value = value
        self._piece = piece
        self._whole = whole
        self._reference = reference
        self._shares = rule.shares_storage(group.size)
        # A whole that shares the piece's storage may be an inference tensor, which has no
        # version counter; it needs none, since in-place edits already reach the engine.
        self._version = None if self._shares else whole._version

    def changed(self, value: Tensor | None = None) -> bool:
        """Whether `self(value)` would hand the engine a different object than it gave us."""
        if value is None or value is self._whole:
            return not self._shares and self._whole._version != self._version
        return True

    def __call__(self, value: Tensor | None = None) -> object:
        """What the engine should carry on with: its own value, or one rebuilt from the edit."""
        if value is None:
            value = self._whole
        if not self.changed(value):
            return self._value
        if not isinstance(value, Tensor):
            raise WholeShapeError(
                f"expected a tensor to hand back, got {type(value).__name__}",
                location=self.location, rule=self.rule, shapes={"whole": self._whole.shape},
            )
        if value.shape != self._whole.shape:
            raise WholeShapeError(
                f"the edited whole has shape {tuple(value.shape)}, but this value's whole has "
                f"shape {tuple(self._whole.shape)}",
                location=self.location, rule=self.rule,
                shapes={"whole": self._whole.shape, "edited": value.shape,
                        "piece": self._piece.shape},
            )
        edited = value.to(dtype=self._piece.dtype, device=self._piece.device)
        piece = self.rule.resplit(edited, self.group.rank, self.group.size, piece=self._piece,
                                  reference=self._reference, location=self.location)
        return self.rule.put(self._value, piece)

    def __repr__(self) -> str:
        return f"Back(location={self.location!r}, rule={self.rule!r}, group={self.group!r})"


class Fragments:
    """The values that are pieces: location -> (rule, group).

    A location is any name the caller uses for a value, e.g.
    `"model.layers.3.self_attn.qkv_proj.output"`. Locations not registered here are not pieces
    and need no gathering; `location in fragments` says which are.

    Every rank must make the same calls in the same order: `whole` runs a collective when
    `collectives_per_visit(location)` is 1, which depends only on the rule and the group's size,
    never on the data a rank holds.

    Args:
        entries: initial locations, each mapped to `(rule, group)`.
    """

    def __init__(self, entries: Mapping[str, tuple[Rule, Group]] | None = None) -> None:
        self._entries: dict[str, Entry] = {}
        for location, (rule, group) in (entries or {}).items():
            self.add(location, rule, group)

    def add(self, location: str, rule: Rule, group: Group) -> None:
        """Register the value at `location` as laid out by `rule` over `group`.

        Registering a location twice with a different rule or group is refused: two parts of a
        runner disagreeing about a layout is a bug to surface, not to settle silently.
        """
        if not isinstance(rule, Rule):
            raise TypeError(f"{location}: expected a Rule, got {type(rule).__name__}")
        if not isinstance(group, Group):
            raise TypeError(f"{location}: expected a Group, got {type(group).__name__}")
        known = self._entries.get(location)
        if known is not None and (known.rule != rule or known.group is not group):
            raise ValueError(
                f"{location}: already registered as {known.rule!r} over {known.group!r}; "
                f"refusing {rule!r} over {group!r}"
            )
        self._entries[location] = Entry(rule, group)

    def __contains__(self, location: object) -> bool:
        return location in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __repr__(self) -> str:
        return f"Fragments({len(self)} locations)"

    def entry(self, location: str) -> Entry:
        """The `(rule, group)` registered for `location`; `UnknownLocationError` if none."""
        try:
            return self._entries[location]
        except KeyError:
            raise UnknownLocationError(location, list(self._entries)) from None

    def rule(self, location: str) -> Rule:
        """The rule registered for `location`."""
        return self.entry(location).rule

    def group(self, location: str) -> Group:
        """The group registered for `location`."""
        return self.entry(location).group

    def collectives_per_visit(self, location: str) -> int:
        """How many collectives a visit to `location` runs: 0 or 1, the same on every rank."""
        rule, group = self.entry(location)
        return rule.collectives(group.size)

    def whole(self, location: str, value: object) -> tuple[Tensor, Back]:
        """The whole value at `location` from this rank's `value`, and how to hand it back.

        Runs at most one collective. Call it once per visit and share the whole among all of
        the visit's readers; then call `back` once (see `Back`). The whole is a new tensor made
        outside inference mode (so in-place edits show in its version counter even inside
        `torch.inference_mode()`), except where the rule shares storage (`Replicated`, or any
        rule in a group of one), where it is the engine's own tensor.

        Raises `PieceShapeError`/`GroupSizeError` if the piece does not fit the rule, before any
        collective runs.
        """
        rule, group = self.entry(location)
        piece = rule.take(value, location)
        whole, reference = rule._gather(piece, group, location)
        back = Back(location=location, rule=rule, group=group, value=value, piece=piece,
                    whole=whole, reference=reference)
        return whole, back

    def split(self, location: str, whole: Tensor) -> Tensor:
        """This rank's piece of `whole` at `location`, without any collective.

        For a value that was never gathered (a replacement made from scratch). For `Item`
        rules this is the item's piece. The split of `Partial` puts the whole on rank 0 and
        zeros elsewhere, so the engine's all-reduce restores it exactly.
        """
        rule, group = self.entry(location)
        return rule.split(whole, group.rank, group.size, location=location)
