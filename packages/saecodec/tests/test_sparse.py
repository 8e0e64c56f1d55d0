"""`SparseFeatures`: what it keeps equals the dense features it came from, on disk and back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from saecodec import SAEFormatError, SparseFeatures
from safetensors.torch import save_file


def features(seed: int, shape: tuple[int, ...], density: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    dense = torch.rand(shape, generator=generator)
    return dense * (torch.rand(shape, generator=generator) < density)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(0, 6), width=st.integers(1, 30),
       density=st.floats(0.0, 1.0))
def test_all_non_zero_features_come_back_exactly(seed: int, tokens: int, width: int,
                                                 density: float) -> None:
    dense = features(seed, (1, tokens, width), density)
    sparse = SparseFeatures.from_dense(dense)
    assert torch.equal(sparse.to_dense(), dense)
    assert sparse.values.numel() == int((dense != 0).sum())
    for row in range(tokens):
        indices, values = sparse.row(row)
        assert torch.equal(indices, dense[0, row].nonzero().flatten())
        assert torch.equal(values, dense[0, row][indices])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), top_k=st.integers(1, 12))
def test_top_k_keeps_each_rows_largest_features(seed: int, top_k: int) -> None:
    dense = features(seed, (5, 10), 0.7)
    kept = SparseFeatures.from_dense(dense, top_k=top_k).to_dense()
    for row in range(5):
        ranked = dense[row].sort(descending=True).values
        assert int((kept[row] != 0).sum()) == min(top_k, int((dense[row] != 0).sum()))
        assert torch.equal(kept[row].sort(descending=True).values[:top_k],
                           ranked[:top_k] * (ranked[:top_k] != 0))


def test_saved_features_load_back_and_a_foreign_file_is_refused(tmp_path: Path) -> None:
    dense = features(1, (2, 3, 16), 0.3)
    SparseFeatures.from_dense(dense).save(tmp_path / "f.safetensors")
    loaded = SparseFeatures.load(tmp_path / "f.safetensors")
    assert loaded.shape == (2, 3, 16) and torch.equal(loaded.to_dense(), dense)
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(SAEFormatError, match="no saecodec metadata"):
        SparseFeatures.load(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(SAEFormatError, match="readable safetensors"):
        SparseFeatures.load(tmp_path / "junk.safetensors")


def test_a_sparse_layout_is_far_smaller_than_the_dense_one(tmp_path: Path) -> None:
    dense = SparseFeatures.from_dense(features(2, (64, 16384), 0.004), top_k=64)
    dense.save(tmp_path / "f.safetensors")
    assert (tmp_path / "f.safetensors").stat().st_size < 64 * 16384 * 4 / 50
