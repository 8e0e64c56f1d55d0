"""The save store on its own: chunks put in position order with the last write winning, trimmed
and filtered; collected tensors own their memory; saves on a device cross to the host in batches
that give every tensor back unchanged (run here on the host, treating its tensors as a device's)."""

from __future__ import annotations

import pytest
import torch
from vllm_runner import store as store_module
from vllm_runner.store import SaveStore


def test_rows_come_back_in_position_order_with_the_last_write_winning() -> None:
    store = SaveStore()
    rows = torch.arange(8.0).reshape(1, 8, 1)
    store.save("k", "a", 0, rows[:, :5], 1)
    store.save("k", "a", 5, rows[:, 5:], 1)
    store.save("k", "a", 3, -rows[:, 3:5], 1)  # a recomputed step (preemption) rewrites 3 and 4
    (saved,) = store.collect([("k", 7, {"a": None})]).values()
    assert saved["a"].flatten().tolist() == [0, 1, 2, -3, -4, 5, 6]  # position 7: ran ahead
    (kept,) = SaveStore().collect([("k", 7, {})]).values()
    assert kept == {}  # nothing saved, nothing collected


def test_collected_rows_own_their_memory_and_filters_apply() -> None:
    store = SaveStore()
    step = torch.randn(1, 6, 4)  # one read shared by two requests
    store.save("first", "a", 0, step[:, :3], 1)
    store.save("second", "a", 10, step[:, 3:], 1)
    found = store.collect([("first", 3, {"a": None}), ("second", 13, {"a": lambda p: p > 10})])
    assert torch.equal(found["first"]["a"], step[:, :3])
    assert torch.equal(found["second"]["a"], step[:, 4:])
    for saved in found.values():
        assert saved["a"].untyped_storage().nbytes() == saved["a"].numel() * 4


# 64 bytes: tensors over the staging buffer cross alone, window by window; 256: batches of a few
# tensors of mixed dtypes; 2**20: all in one batch.
@pytest.mark.parametrize("staging_bytes", [64, 256, 2**20])
def test_saves_on_a_device_cross_in_batches_unchanged(monkeypatch, staging_bytes) -> None:
    monkeypatch.setattr(store_module, "_on_a_device", lambda rows: True)
    monkeypatch.setattr(store_module, "STAGING_BYTES", staging_bytes)
    values = {"a": torch.randn(1, 5, 8), "b": torch.randn(8, 5).t().unsqueeze(0),  # strided
              "c": torch.randint(0, 9, (1, 5, 3)), "d": torch.randn(1, 5, 2).bfloat16()}
    store = SaveStore()
    for key in ("x", "y"):
        for location, value in values.items():
            store.save(key, location, 0, value, 1)
    found = store.collect([("x", 5, dict.fromkeys(values)), ("y", 5, dict.fromkeys(values))])
    for saved in found.values():
        for location, value in values.items():
            assert saved[location].dtype == value.dtype
            assert torch.equal(saved[location], value), location
            assert saved[location].untyped_storage().data_ptr() != value.data_ptr()
            own = saved[location].numel() * saved[location].element_size()
            assert saved[location].untyped_storage().nbytes() == own
