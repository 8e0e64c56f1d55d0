"""Saves kept once a step per group (`saves.recorded`): whatever the steps' schedule, the joined
reads that failed at a location, the spills and the requests collected together or alone, what a
request collects equals its rows saved one by one (`SaveStore.save`, the store's first path)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from parts import cat_on_one_device, on_a_device
from tokenspan import StepLayout
from vllm_runner.saves import host_copies
from vllm_runner.saves import recorded as recorded_saves
from vllm_runner.saves.store import SaveStore

REQUESTS = "xyz"
LOCATIONS = ("a", "b")
WIDTH = 2


@st.composite
def schedules(draw):
    """Steps of requests x, y, z saving at locations a and b: each step schedules some of them
    (in a drawn order, with an unsaving request "w" somewhere among them), each going on from its
    last position or recomputed from an earlier one (preemption), 1-3 rows; per location whether
    the group's joined read fails there (its members' rows are then saved one by one); whether
    the store spills after the step."""
    positions = dict.fromkeys(REQUESTS, 0)
    steps = []
    for _ in range(draw(st.integers(1, 8))):
        keys = draw(st.lists(st.sampled_from(REQUESTS), min_size=1, max_size=3, unique=True))
        firsts, counts = [], []
        for key in keys:
            first = positions[key]
            if first and draw(st.integers(0, 5)) == 0:
                first = draw(st.integers(0, first))
            count = draw(st.integers(1, 3))
            firsts.append(first)
            counts.append(count)
            positions[key] = first + count
        unsaving = draw(st.integers(0, len(keys)))  # where "w"'s rows are in the slab
        failed = {location: draw(st.integers(0, 4)) == 0 for location in LOCATIONS}
        steps.append((keys, firsts, counts, unsaving, failed, draw(st.booleans())))
    computed = {key: draw(st.integers(0, max(positions[key], 1))) for key in REQUESTS}
    return steps, computed


def step_value(step: int, total: int, location: str) -> torch.Tensor:
    """A value `[1, total, WIDTH]` whose every element says its step, row and location."""
    rows = torch.arange(total, dtype=torch.float32).reshape(1, total, 1) * 10
    return rows + torch.arange(WIDTH).reshape(1, 1, WIDTH) + 1000 * step + (
        0.5 if location == "b" else 0.0)


@settings(deadline=None, max_examples=150)
@given(schedules(), st.booleans(), st.sampled_from([0, 4, 1000]), st.booleans())
# Found by CI: x's step 3 saved position 1 one by one (both joined reads failed), then step 4
# recomputed it through the record x's step 2 began; the record's older chunk must not win.
@example(([(["x"], [0], [1], 0, {"a": True, "b": True}, False),
           (["y"], [0], [1], 0, {"a": True, "b": True}, False),
           (["x"], [0], [1], 0, {"a": False, "b": True}, False),
           (["x"], [1], [1], 0, {"a": True, "b": True}, False),
           (["x"], [1], [1], 0, {"a": False, "b": True}, False),
           (["y"], [0], [1], 0, {"a": True, "b": True}, False),
           (["x"], [2], [1], 0, {"a": True, "b": True}, False)],
          {"x": 2, "y": 0, "z": 0}), False, 0, False)
def test_recorded_rows_are_collected_as_if_saved_one_by_one(schedule, on_device, join_at_most,
                                                            together) -> None:
    steps, computed = schedule
    expected_store, store = SaveStore(), SaveStore()
    op = object()  # the group's op: the same at every step
    device = on_a_device if on_device else (lambda tensor: tensor)
    with pytest.MonkeyPatch.context() as patch:  # hypothesis: no function-scoped fixtures
        patch.setattr(host_copies, "STAGING_BYTES", 256)
        patch.setattr(torch, "cat", cat_on_one_device)
        patch.setattr(recorded_saves, "JOIN_AT_MOST", join_at_most)
        for step, (keys, firsts, counts, unsaving, failed, spill) in enumerate(steps):
            slab_keys = [*keys[:unsaving], "w", *keys[unsaving:]]
            slab_firsts = [*firsts[:unsaving], 0, *firsts[unsaving:]]
            slab_counts = [*counts[:unsaving], 2, *counts[unsaving:]]
            layout = StepLayout.from_counts(slab_keys, slab_counts, slab_firsts)
            plan = [(read, [(str(key), layout[key].first_position) for key in read.keys])
                    for read in layout.select(keys).reads()]
            group = None
            for location in LOCATIONS:
                value = step_value(step, layout.total, location)
                for key in keys:
                    span = layout[key]
                    expected_store.save(key, location, span.first_position,
                                        value[:, span.start:span.stop].clone(), 1)
                if failed[location]:  # `row_serving.serve_one`: each member's own save
                    for key in keys:
                        span = layout[key]
                        store.save(key, location, span.first_position,
                                   device(value[:, span.start:span.stop].clone()), 1)
                    continue
                reads = [device(value[:, read.span.start:read.span.stop].clone())
                         for read, _ in plan]
                if group is None:
                    group = store.start_record(plan, 1, op)
                store.record(group, location, reads)
            del group  # as the step's `OpGroup` is
            if spill:
                store.spill(0)
                assert store.device_bytes == 0
        wanted = dict.fromkeys(LOCATIONS)
        requests = [(key, computed[key], wanted) for key in REQUESTS]
        expected = expected_store.collect(requests)
        found = (store.collect(requests) if together
                 else {key: store.collect([request])[key]
                       for key, request in zip(REQUESTS, requests, strict=True)})
    for key in REQUESTS:
        assert found.get(key, {}).keys() == expected.get(key, {}).keys()
        for location, rows in expected.get(key, {}).items():
            assert type(found[key][location]) is torch.Tensor  # on the host
            assert torch.equal(found[key][location], rows), (key, location)
    assert store.device_bytes == 0  # every record let go with its last request
    assert store.held() == {"requests": 0, "bytes": 0}


def test_a_record_is_freed_with_its_last_request_and_counts_its_device_bytes() -> None:
    store = SaveStore()
    layout = StepLayout.from_counts(["x", "y"], [2, 3], [0, 0])
    plan = [(read, [(str(key), 0) for key in read.keys]) for read in layout.select().reads()]
    group = store.start_record(plan, 1, "op")
    value = on_a_device(torch.ones(1, 5, WIDTH))
    store.record(group, "a", [value])
    store.record(group, "b", [value])
    del group
    assert store.device_bytes == 2 * value.numel() * 4
    assert store.held() == {"requests": 2, "bytes": 2 * 5 * WIDTH * 4}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "cat", cat_on_one_device)
        store.collect([("x", 2, dict.fromkeys(LOCATIONS))])
        assert store.device_bytes == 2 * value.numel() * 4  # y's rows are in the same reads
        store.drop(["y"])
    assert store.device_bytes == 0
    assert store.held() == {"requests": 0, "bytes": 0}
