"""Each token's active features, compact: what leaves a worker instead of `[tokens, d_sae]`.

Row by row (one row a token, in the order of the dense tensor's leading axes) as compressed
sparse rows: `offsets [rows + 1]` into `indices` (the feature numbers, increasing within a row)
and `values`. A row keeps all its non-zero features, or its `top_k` largest. One safetensors file
holds it, with `d_sae` and the leading shape in its metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from saecodec.errors import SAEFormatError

_META = "saecodec.sparse"


@dataclass(frozen=True, eq=False)
class SparseFeatures:
    """Features of `shape[:-1]` tokens over `d_sae` (the dense shape is `shape`), by row."""

    offsets: torch.Tensor  # [rows + 1], int64
    indices: torch.Tensor  # [nnz], int64, increasing within a row
    values: torch.Tensor  # [nnz]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        rows = 1
        for size in self.shape[:-1]:
            rows *= size
        if tuple(self.offsets.shape) != (rows + 1,):
            raise ValueError(f"offsets has {self.offsets.numel()} entries; {rows} rows need "
                             f"{rows + 1}")
        if self.indices.shape != self.values.shape or self.indices.dim() != 1:
            raise ValueError("indices and values must be two vectors of one length")

    @property
    def d_sae(self) -> int:
        """How many features each row is over."""
        return self.shape[-1]

    @classmethod
    def from_dense(cls, features: torch.Tensor, top_k: int | None = None) -> SparseFeatures:
        """The non-zero features of each row of `features` (`[..., d_sae]`), or only its
        `top_k` largest (ties broken by `torch.topk`; zeros among them are dropped)."""
        if features.dim() < 1:
            raise ValueError("features need at least one axis (the features)")
        d_sae = features.shape[-1]
        rows = features.reshape(-1, d_sae)
        if top_k is not None:
            if not top_k > 0:
                raise ValueError(f"top_k must be at least 1, not {top_k}")
            top = rows.topk(min(top_k, d_sae), dim=-1)
            rows = torch.zeros_like(rows).scatter(-1, top.indices, top.values)
        row, column = rows.nonzero(as_tuple=True)
        counts = torch.bincount(row, minlength=rows.shape[0])
        offsets = torch.zeros(rows.shape[0] + 1, dtype=torch.long, device=rows.device)
        offsets[1:] = counts.cumsum(0)
        return cls(offsets, column.long(), rows[row, column], tuple(features.shape))

    def to_dense(self) -> torch.Tensor:
        """The dense `[..., d_sae]` tensor (zeros where no feature was kept)."""
        rows = self.offsets.numel() - 1
        dense = torch.zeros(rows, self.d_sae, dtype=self.values.dtype,
                            device=self.values.device)
        row = torch.repeat_interleave(torch.arange(rows, device=self.offsets.device),
                                      self.offsets.diff())
        dense[row, self.indices] = self.values
        return dense.reshape(self.shape)

    def row(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `index`'s feature numbers and values."""
        start, stop = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.indices[start:stop], self.values[start:stop]

    def save(self, path: str | Path) -> None:
        """One safetensors file (`load` reads it back)."""
        from safetensors.torch import save_file  # files only: the package computes with torch

        save_file({"offsets": self.offsets.contiguous(), "indices": self.indices.contiguous(),
                   "values": self.values.contiguous()}, str(path),
                  metadata={_META: json.dumps({"shape": list(self.shape)})})

    @classmethod
    def load(cls, path: str | Path) -> SparseFeatures:
        """What `save` wrote to `path`; a file it did not write is refused by name."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:  # read once: names and all
                metadata = handle.metadata() or {}
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        except Exception as error:
            raise SAEFormatError(path, f"is not a readable safetensors file ({error})") from None
        if _META not in metadata:
            raise SAEFormatError(path, "holds no sparse features (no saecodec metadata)", _META)
        missing = [name for name in ("offsets", "indices", "values") if name not in tensors]
        if missing:
            raise SAEFormatError(path, "has no tensor " + ", ".join(missing), missing[0])
        shape = tuple(int(size) for size in json.loads(metadata[_META])["shape"])
        return cls(tensors["offsets"], tensors["indices"], tensors["values"], shape)
