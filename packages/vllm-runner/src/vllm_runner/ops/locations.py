"""The location grammar: `layers.<i>.<value>` with `<i>` an int, `*` or `a:b`, the host named
(`layers.3.self_attn.attention_queries`) or omitted when the value name is unique
(`layers.3.attention_queries`), and model values (`token_embeddings`, `logits`,
`next_token_probs`). Patterns expand to canonical locations, which are the keys of `saved`."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from vllm_runner.errors import LocationError
from vllm_runner.ops import Call, ClampFeatures, EditOp, Features, Op, Probe, SteerFeatures

#: Values whose rows are the sampled rows (one per request, its last row this step), not the
#: step's tokens, served in this order by one hook on the logits processor.
PER_SAMPLED_ROW = ("logits", "next_token_probs")


def _layer_indices(selector: str, layers: int, pattern: str) -> list[int]:
    if selector == "*":
        return list(range(layers))
    if ":" in selector:
        start, _, stop = selector.partition(":")
        try:
            bounds = [int(bound) if bound else None for bound in (start, stop)]
        except ValueError:
            raise LocationError(f"{pattern!r}: bad layer range {selector!r}") from None
        # A bound past the model is a mistake (another model's depth), not a wish for fewer
        # layers: Python's slice would drop the layers that are not there without a word.
        if any(bound is not None and not -layers <= bound <= layers for bound in bounds):
            raise LocationError(f"{pattern!r}: the layer range {selector!r} reaches past the "
                                f"model (it has {layers} layers: 0..{layers - 1}; a range "
                                "start:stop leaves stop out)")
        indices = list(range(layers))[slice(*bounds)]
        if not indices:
            raise LocationError(f"{pattern!r}: the layer range {selector!r} names no layer "
                                f"(the model has {layers} layers: 0..{layers - 1})")
        return indices
    try:
        index = int(selector)
    except ValueError:
        raise LocationError(
            f"{pattern!r}: the layer must be an integer, '*' or 'a:b', not {selector!r}"
        ) from None
    if not -layers <= index < layers:
        raise LocationError(f"{pattern!r}: layer {index} does not exist (the model has "
                            f"{layers} layers: 0..{layers - 1})")
    return [index % layers]


#: The longest location pattern compared with the model's names for a hint (a request's
#: pattern of ten million characters took 2.7 s of the server's event loop to refuse).
LONGEST_PATTERN = 200


def resolve(pattern: str, canonical: Iterable[str], layers: int) -> list[str]:
    """The canonical locations `pattern` names; `LocationError` with close names if none."""
    known = list(canonical)
    if pattern in known:
        return [pattern]
    if len(pattern) > LONGEST_PATTERN:  # no name is this long: not worth comparing to each
        raise LocationError(f"{pattern[:60]!r}… ({len(pattern):,} characters) is not a "
                            "location of this model: locations are short names, e.g. "
                            "layers.0.layer_output")
    parts = pattern.split(".")
    found: list[str] = []
    if len(parts) >= 3 and parts[0] == "layers":
        tail = ".".join(parts[2:])
        for index in _layer_indices(parts[1], layers, pattern):
            prefix = f"layers.{index}."
            matches = [loc for loc in known if loc.startswith(prefix)
                       and (loc[len(prefix):] == tail or loc.endswith("." + tail))]
            if len(matches) > 1:
                raise LocationError(f"{pattern!r} is ambiguous: {', '.join(matches)}")
            found += matches
    if found:
        return found
    probe = pattern.replace("*", "0").replace(":", "")
    close = difflib.get_close_matches(probe, known, n=3, cutoff=0.5)
    hint = f"; closest: {', '.join(close)}" if close else ""
    raise LocationError(f"{pattern!r} is not a location of this model{hint}")


def checked_resolution(answer: dict[str, Any] | None) -> dict[str, Any]:
    """The workers' `interp_resolve` answer (`None`: no patterns were asked, an empty one),
    with `LocationError` raised for the patterns it refused, naming the closest locations."""
    if answer is None:
        return {"resolved": {}, "errors": {}, "edit_refusals": {}}
    if answer["errors"]:
        raise LocationError("; ".join(answer["errors"].values()))
    return answer


def unservable(ops: Sequence[Op], acting_at: Sequence[Sequence[str]],
               edit_refusals: Mapping[str, str]) -> tuple[int, str] | None:
    """The first op of one program that can never be served as written, with why, or `None`:
    an edit (`EditOp`) at a location no edit can be served at (`edit_refusals`: location →
    reason, from the workers' `interp_resolve`), a `tokens=` filter at a sampled-row value, or
    a result name two ops would both save under (one would overwrite the other).
    `acting_at[i]` are the canonical locations op `i` acts at."""
    named: dict[str, int] = {}
    for index, (op, locations) in enumerate(zip(ops, acting_at, strict=True)):
        for location in locations:
            if isinstance(op, (EditOp, SteerFeatures, ClampFeatures)) \
                    and location in edit_refusals:
                return index, f"{type(op).__name__} at {location}: {edit_refusals[location]}"
            if getattr(op, "tokens", None) is not None and location in PER_SAMPLED_ROW:
                return index, (f"{type(op).__name__} at {location}: tokens= is not taken at a "
                               "value of one row per sampled position; filter it with "
                               "positions= or steps=")
            if isinstance(op, (Probe, Call, Features)):
                for name in op.saved_names(location):
                    if name in named:
                        return index, (f"{type(op).__name__} at {location} saves {name!r}, as "
                                       f"op {named[name]} of the program does: give each a name "
                                       "of its own (name= or saves=; one Features per SAE)")
                    named[name] = index
    return None


def refuse_what_cannot_be_served(programs: Iterable[Sequence[Op]],
                                 answer: dict[str, Any]) -> None:
    """Raise `LocationError` for the first op of `programs` that can never be served
    (`unservable`), naming it and why; `answer` is the workers' `interp_resolve` for every
    pattern of the programs. Before anything runs."""
    refusals = answer.get("edit_refusals") or {}
    resolved = answer["resolved"]
    for ops in programs:
        acting_at = [[location for pattern in op.patterns() for location in resolved[pattern]]
                     for op in ops]
        found = unservable(ops, acting_at, refusals)
        if found is not None:
            raise LocationError(found[1])
