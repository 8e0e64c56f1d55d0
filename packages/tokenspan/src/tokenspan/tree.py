"""Walking nested values (tuples, lists, dicts of tensors and other leaves) by path.

Modules hand out tensors, `(hidden, residual)` tuples, named tuples and dicts. tokenspan's
operations apply to every per-token tensor inside such a value and must leave everything else
alone, so they all walk values the same way; paths name the place in error messages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

from tokenspan.errors import SpanShapeError

Path = tuple[Any, ...]

# Leaves compared by value when checking that a non-per-token part was left unchanged.
_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes)


def describe_path(path: Path) -> str:
    """`value[0]['k']`-style text naming a place inside a nested value."""
    return "value" + "".join(f"[{step!r}]" for step in path)


def _rebuild_sequence(
    original: tuple[Any, ...] | list[Any], items: list[Any]
) -> tuple[Any, ...] | list[Any]:
    if isinstance(original, list):
        return items if type(original) is list else type(original)(items)
    if hasattr(original, "_fields"):  # a named tuple
        return type(original)(*items)
    return tuple(items) if type(original) is tuple else type(original)(items)


def _rebuild_mapping(original: Mapping[Any, Any], items: dict[Any, Any]) -> Mapping[Any, Any]:
    if type(original) is dict:
        return items
    # Mapping itself declares no constructor; concrete mappings (dict subclasses, OrderedDict,
    # MappingProxyType) take a dict of items, and the others fall back to a plain dict.
    rebuild = cast("Callable[[dict[Any, Any]], Mapping[Any, Any]]", type(original))
    try:
        return rebuild(items)
    except TypeError:
        return items


def map_leaves(fn: Callable[[Path, Any], Any], value: Any, path: Path = ()) -> Any:
    """Rebuild `value` with every leaf replaced by `fn(path, leaf)`; containers keep their type."""
    if isinstance(value, (tuple, list)):
        return _rebuild_sequence(
            value, [map_leaves(fn, item, (*path, i)) for i, item in enumerate(value)]
        )
    if isinstance(value, Mapping):
        return _rebuild_mapping(value, {k: map_leaves(fn, v, (*path, k)) for k, v in value.items()})
    return fn(path, value)


def iter_leaves(value: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every `(path, leaf)` of a nested value, in container order."""
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from iter_leaves(item, (*path, i))
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from iter_leaves(v, (*path, k))
    else:
        yield path, value


def zip_leaves(part: Any, whole: Any, path: Path = ()) -> Iterator[tuple[Path, Any, Any]]:
    """Pair the leaves of two values of the same structure; `SpanShapeError` where they differ.

    Tuples and lists pair with each other (code that rebuilds a module's output often changes
    one into the other); mappings must have the same keys.
    """
    if isinstance(whole, (tuple, list)):
        if not isinstance(part, (tuple, list)) or len(part) != len(whole):
            raise SpanShapeError(
                f"at {describe_path(path)}: expected a sequence of {len(whole)} items like the "
                f"original, got {_describe(part)}"
            )
        for i, (p, w) in enumerate(zip(part, whole, strict=True)):
            yield from zip_leaves(p, w, (*path, i))
    elif isinstance(whole, Mapping):
        if not isinstance(part, Mapping) or set(part) != set(whole):
            raise SpanShapeError(
                f"at {describe_path(path)}: expected a mapping with keys {sorted(map(str, whole))}"
                f" like the original, got {_describe(part)}"
            )
        for k, w in whole.items():
            yield from zip_leaves(part[k], w, (*path, k))
    else:
        yield path, part, whole


def same_leaf(a: Any, b: Any) -> bool:
    """Whether a leaf that is not per-token was left as it was (identity, or equal plain value)."""
    if a is b:
        return True
    return isinstance(a, _PLAIN_LEAVES) and type(a) is type(b) and a == b


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} items"
    if isinstance(value, Mapping):
        return f"a mapping with keys {sorted(map(str, value))}"
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__} of shape {tuple(shape)}" if shape is not None else repr(value)
