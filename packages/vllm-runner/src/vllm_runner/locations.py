"""The location grammar: `layers.<i>.<value>` with `<i>` an int, `*` or `a:b`, the host named
(`layers.3.self_attn.attention_queries`) or omitted when the value name is unique
(`layers.3.attention_queries`), and model values (`token_embeddings`, `logits`,
`next_token_probs`). Patterns expand to canonical locations, which are the keys of `saved`."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from vllm_runner.errors import LocationError


def _layer_indices(selector: str, layers: int, pattern: str) -> list[int]:
    if selector == "*":
        return list(range(layers))
    if ":" in selector:
        start, _, stop = selector.partition(":")
        try:
            return list(range(layers))[slice(int(start) if start else None,
                                             int(stop) if stop else None)]
        except ValueError:
            raise LocationError(f"{pattern!r}: bad layer range {selector!r}") from None
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


def resolve(pattern: str, canonical: Iterable[str], layers: int) -> list[str]:
    """The canonical locations `pattern` names; `LocationError` with close names if none."""
    known = list(canonical)
    if pattern in known:
        return [pattern]
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


def refuse_edits_that_cannot_be_served(programs: Iterable[Iterable[Any]],
                                       answer: dict[str, Any]) -> None:
    """Raise `LocationError` for the first editing op of `programs` that names a location an
    edit can never be served at, with the reason (`answer`: the workers' `interp_resolve` for
    every pattern of the programs); before anything runs."""
    refusals = answer.get("edit_refusals") or {}
    if not refusals:
        return
    for ops in programs:
        for op in ops:
            if not op.edits or op.kind == "skip":
                continue
            for pattern in op.patterns():
                for location in answer["resolved"].get(pattern, ()):
                    if location in refusals:
                        raise LocationError(f"{type(op).__name__}({pattern!r}): "
                                            f"{refusals[location]}")
