"""Where an extraction lives: a folder at any fsspec URL (a local path, `file://`, `s3://`,
`gs://`, ...), whose shards and manifest are each written whole or not at all.

On a local disk a file is written beside its final name (`<name>.partial`) and renamed into
place, which is atomic; an object store's single upload is already atomic (an object appears
whole, or not at all, when its upload completes; s3fs's multipart uploads too), so there the
object is written under its final key. Either way a process killed mid-write leaves no shard a
reader could take for a whole one. Writing to another store needs its fsspec implementation
installed (s3fs for `s3://`, gcsfs for `gs://`) and its credentials in the usual places
(`AWS_*` variables, `~/.aws`, ...); `AWS_ENDPOINT_URL` points s3fs at an S3-compatible
server.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MANIFEST = "manifest.json"
SHARD_NAME = re.compile(r"^shard-(\d{5,})\.safetensors$")


def shard_name(index: int) -> str:
    """The file of shard `index` (its prompts: `[index * shard_size, (index + 1) * shard_size)`)."""
    return f"shard-{index:05d}.safetensors"


class ExtractionStore:
    """An extraction's folder at `url`, read and written through fsspec."""

    def __init__(self, url: str | Path) -> None:
        import fsspec

        self.url = str(url)
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (
            self.fs.protocol,)
        #: Whether files can be renamed into place (a local disk) rather than uploaded whole.
        self.renames = bool({"file", "local"} & set(protocols))

    def __repr__(self) -> str:
        return f"ExtractionStore({self.url!r})"

    def path(self, name: str) -> str:
        """The store's path of the file `name` in the folder."""
        return f"{self.root.rstrip('/')}/{name}"

    def is_file(self) -> bool:
        """Whether the URL names a file rather than a folder."""
        return bool(self.fs.isfile(self.root))

    def names(self) -> set[str]:
        """The names of the files in the folder (none if it does not exist yet)."""
        self.fs.invalidate_cache()  # another process may have written since the last listing
        try:
            listed = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return set()
        return {str(path).rstrip("/").rsplit("/", 1)[-1] for path in listed}

    def shard_indices(self) -> set[int]:
        """The indices of the shards written whole (temporary `.partial` files are not)."""
        return {int(found.group(1)) for name in self.names()
                if (found := SHARD_NAME.match(name))}

    def has(self, name: str) -> bool:
        """Whether the folder holds the file `name` (asked of the store, not of a cached
        listing: another replica may have written it)."""
        self.fs.invalidate_cache(self.path(name))
        return bool(self.fs.exists(self.path(name)))

    def read_manifest(self) -> dict[str, Any] | None:
        """The folder's manifest, or `None` if it has none yet."""
        try:
            data = self.fs.cat_file(self.path(MANIFEST))
        except FileNotFoundError:
            return None
        manifest: dict[str, Any] = json.loads(data)
        return manifest

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        """Replace the manifest, whole."""
        self.write(MANIFEST, json.dumps(manifest, indent=2).encode())

    def write_shard(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                    before_rename: Callable[[], None] = lambda: None) -> None:
        """Write a shard's tensors (safetensors, with `metadata`), whole."""
        from safetensors.torch import save

        self.write(name, save(tensors, metadata=metadata), before_rename)

    def read_shard(self, name: str) -> dict[str, torch.Tensor]:
        """A shard's tensors."""
        from safetensors.torch import load

        loaded: dict[str, torch.Tensor] = load(self.fs.cat_file(self.path(name)))
        return loaded

    def write(self, name: str, data: bytes, before_rename: Callable[[], None] = lambda: None
              ) -> None:
        """Write the file `name`, whole or not at all (see the module); `before_rename` runs
        between writing a local file and renaming it into place (tests die there)."""
        if not self.renames:
            self.fs.pipe_file(self.path(name), data)
            return
        self.fs.makedirs(self.root, exist_ok=True)
        staging = self.path(f"{name}.partial")
        self.fs.pipe_file(staging, data)
        before_rename()
        self.fs.mv(staging, self.path(name))
