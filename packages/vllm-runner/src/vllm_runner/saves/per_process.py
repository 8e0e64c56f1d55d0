"""One object per process, made at its first use: worker threads and bookkeeping that a forked
child must not share with its parent (it inherits the parent's objects, but none of its threads,
and any lock a parent's thread held at the fork stays held in the child forever)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PerProcess(Generic[T]):
    """`make()`'s result for the calling process: made once per process, even when several
    threads ask at the same time."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._made: dict[int, T] = {}  # by process id
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._unlock)

    def _unlock(self) -> None:
        self._lock = threading.Lock()

    def get(self) -> T:
        """This process's object, made now if it has none."""
        made = self._made.get(os.getpid())
        if made is None:
            with self._lock:
                made = self._made.get(os.getpid())
                if made is None:
                    made = self._made[os.getpid()] = self._make()
        return made

    def current(self) -> T | None:
        """This process's object, or `None` if it has not made one."""
        return self._made.get(os.getpid())

    def forget(self) -> None:
        """Let this process's next `get` make a new object (a benchmark changing its size)."""
        self._made.pop(os.getpid(), None)
