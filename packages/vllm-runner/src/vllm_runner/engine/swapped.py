"""One method of one vLLM object replaced for the length of a block: how both engine adapters
change a CUDA-graph dispatch for a single step without touching vLLM's classes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def swapped(owner: Any, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """Within the block, `owner.name` is `replacement`; after it, what it was (the class's
    method again, or the instance's own attribute if it had one)."""
    own = vars(owner).get(name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if own is None:
            delattr(owner, name)
        else:
            setattr(owner, name, own)
