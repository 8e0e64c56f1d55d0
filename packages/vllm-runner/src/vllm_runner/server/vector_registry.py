"""The server's named vectors (`PUT/GET/DELETE /v1/interp/vectors/{name}`), kept on its disk as
one safetensors file each, so a restart keeps them; requests name them as `{"name": ...}`."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
MAX_VECTOR_BYTES = 64 << 20


class VectorRegistry:
    """Named tensors in a folder, read once and then served from memory."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._loaded: dict[str, torch.Tensor] = {}

    @staticmethod
    def check_name(name: str) -> str | None:
        """Why `name` cannot name a vector, or `None` (names are file names: no paths)."""
        if NAME.fullmatch(name) is None or name.endswith(".tmp"):
            return (f"{name!r}: a name is 1-128 letters, digits, '_', '.' or '-', starting "
                    "with a letter or digit")
        return None

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.safetensors"

    def get(self, name: str) -> torch.Tensor | None:
        """The vector registered as `name`, or `None`."""
        if name in self._loaded:
            return self._loaded[name]
        if self.check_name(name) is not None or not self._path(name).is_file():
            return None
        tensor = load_file(str(self._path(name)))["vector"]
        self._loaded[name] = tensor
        return tensor

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Register (or replace) `name`; written to a new file first, so a crash mid-write never
        leaves a broken vector behind."""
        self.folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        os.close(handle)
        try:
            save_file({"vector": tensor.detach().cpu().contiguous()}, temporary)
            os.replace(temporary, self._path(name))
        finally:
            Path(temporary).unlink(missing_ok=True)
        self._loaded[name] = tensor.detach().cpu().contiguous()

    def delete(self, name: str) -> bool:
        """Forget `name`; whether it was registered."""
        self._loaded.pop(name, None)
        if self.check_name(name) is not None or not self._path(name).is_file():
            return False
        self._path(name).unlink()
        return True

    def names(self) -> list[str]:
        """Every registered name."""
        if not self.folder.is_dir():
            return []
        return sorted(path.name.removesuffix(".safetensors")
                      for path in self.folder.glob("*.safetensors"))
