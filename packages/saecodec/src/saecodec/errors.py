"""The one error a load raises, naming the file and, where there is one, the key at fault."""

from __future__ import annotations

from pathlib import Path


class SAEFormatError(ValueError):
    """An SAE's files are missing, unreadable or say something this package does not load."""

    def __init__(self, path: Path | str, problem: str, key: str | None = None) -> None:
        where = f"{path}" if key is None else f"{path} [{key}]"
        super().__init__(f"{where}: {problem}")
        self.path = Path(path)
        self.key = key
