"""The save store on its own: chunks put in position order with the last write winning, trimmed
and filtered; collected tensors own their memory; saves on a device cross to the host in batches
that give every tensor back unchanged, and past a limit move there between steps without changing
what is collected (run here on the host, treating its tensors as a device's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from parts import cat_on_one_device, on_a_device
from vllm_runner.saves import host_copies
from vllm_runner.saves import store as store_module
from vllm_runner.saves.arena import SaveArena
from vllm_runner.saves.store import SaveStore
from vllm_runner.settings import device_saves_limit


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


@pytest.mark.parametrize(("keep", "positions"), [
    (lambda p: p == 12, [12]),  # a probe's one row
    (lambda p: p >= 11, [11, 12]),  # a run without gaps
    (lambda p: p != 11, [10, 12]),  # a gap: the rows gathered by index
])
def test_filtered_rows_without_gaps_are_taken_without_an_index(monkeypatch, keep,
                                                               positions) -> None:
    gathered = []
    index_select = torch.Tensor.index_select

    def counted(rows, *arguments):
        gathered.append(arguments)
        return index_select(rows, *arguments)

    # On a GPU an index is a host-to-device copy that waits for the device, for every request
    # and location collected: a run without gaps needs none.
    monkeypatch.setattr(torch.Tensor, "index_select", counted)
    store = SaveStore()
    step = torch.randn(1, 3, 4)
    store.save("k", "a", 10, step, 1)
    (saved,) = store.collect([("k", 13, {"a": keep})]).values()
    assert torch.equal(saved["a"], step[:, [position - 10 for position in positions]])
    assert saved["a"].untyped_storage().nbytes() == saved["a"].numel() * 4  # its own memory
    assert len(gathered) == (0 if positions == list(range(positions[0], positions[-1] + 1))
                             else 1)


# 64 bytes: tensors over the staging buffer cross alone, window by window; 256: batches of a few
# tensors of mixed dtypes, each launched into one half of the buffer while the batch before it
# is written out from the other (a batch staged into the half still being written out fails
# here); 2**20: all in one batch. Three landing threads (any batch over 16 bytes split between
# them) or one. Under inference mode, as vLLM's runners call us: the host tensors made there are
# inference tensors, which the landing threads (outside that thread-local mode unless they enter
# it) may not write into — the H100's spill run failed so on 2026-12-06.
@pytest.mark.parametrize("staging_bytes", [64, 256, 2**20])
@pytest.mark.parametrize("landing_threads", [1, 3])
@pytest.mark.parametrize("inference", [False, True], ids=["normal", "inference-mode"])
def test_saves_on_a_device_cross_in_batches_unchanged(monkeypatch, staging_bytes,
                                                      landing_threads, inference) -> None:
    monkeypatch.setattr(host_copies, "on_a_device", lambda rows: True)
    monkeypatch.setattr(host_copies, "STAGING_BYTES", staging_bytes)
    monkeypatch.setattr(host_copies, "LANDING_THREADS", landing_threads)
    monkeypatch.setattr(host_copies, "PARALLEL_BYTES", 16)
    values = {"a": torch.randn(1, 5, 8), "b": torch.randn(8, 5).t().unsqueeze(0),  # strided
              "c": torch.randint(0, 9, (1, 5, 3)), "d": torch.randn(1, 5, 2).bfloat16()}
    store = SaveStore()
    with torch.inference_mode(inference):
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


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from([torch.float32, torch.bfloat16,
                                                               torch.int64, torch.uint8])),
                max_size=6),
       st.integers(1, 5), st.sampled_from([4, 16, 64]))
# A share of the bytes smaller than one element (8 bytes over 5 threads: 2 each) once made the
# cutting loop forever, growing its lists until the OOM killer took the test's worker.
@example(sizes=[(1, torch.int64)], threads=5, parallel_bytes=4)
def test_landing_over_threads_copies_every_byte_once(sizes, threads, parallel_bytes) -> None:
    sources = [torch.randint(0, 100, (size,)).to(dtype) for size, dtype in sizes]
    destinations = [torch.full_like(source, -1) for source in sources]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(host_copies, "LANDING_THREADS", threads)
        patch.setattr(host_copies, "PARALLEL_BYTES", parallel_bytes)
        host_copies.land(list(zip(destinations, sources, strict=True)))
    for destination, source in zip(destinations, sources, strict=True):
        assert torch.equal(destination, source)


@pytest.fixture
def one_device_per_cat(monkeypatch):
    monkeypatch.setattr(torch, "cat", cat_on_one_device)


def _fill(store: SaveStore, rows: torch.Tensor, pattern: torch.Tensor, later: bool) -> None:
    """Saves of two requests as steps make them, on a device: chunked prefill, a pattern saved
    whole at every step, an empty value (a `Lens` of no tokens) and (`later`) decode rows and a
    recomputation from position 0 (preemption)."""
    if not later:
        store.save("x", "a", 0, on_a_device(rows[:, :3]), 1)
        store.save("x", "a", 3, on_a_device(rows[:, 3:5]), 1)
        store.save("x", "e", 0, on_a_device(rows[:, :5, :0]), 1)
        store.save_rows("a", 1, [("y", 0)], [on_a_device(rows[:, :2] * 10)])
        store.save("x", "p", 0, on_a_device(pattern), None)
        store.save("z", "e", 0, on_a_device(rows[:, :5, :0]), 1)  # only empty values
        return
    store.save("x", "a", 5, on_a_device(rows[:, 5:7]), 1)
    store.save("x", "a", 0, on_a_device(-rows[:, :2]), 1)  # recomputed after a preemption
    store.save("x", "e", 5, on_a_device(rows[:, 5:7, :0]), 1)
    store.save_rows("a", 1, [("y", 2)], [on_a_device(rows[:, 2:3] * 10)])
    store.save("x", "p", 0, on_a_device(2 * pattern), None)
    store.save("z", "e", 5, on_a_device(rows[:, 5:7, :0]), 1)


def test_spilled_saves_are_collected_unchanged(monkeypatch, one_device_per_cat) -> None:
    monkeypatch.setattr(host_copies, "STAGING_BYTES", 64)  # a few tensors per batch
    rows, pattern = torch.randn(1, 8, 4), torch.randn(2, 3, 3)
    store = SaveStore()
    _fill(store, rows, pattern, later=False)
    first = 4 * (4 * (5 + 2) + 18)  # float32: x's and y's rows, the latest pattern only
    assert store.device_bytes == first
    store.spill(first)  # at the limit: nothing moves
    assert store.device_bytes == first
    before = rows.clone()
    store.spill(first - 1)
    assert store.device_bytes == 0
    rows.mul_(-3)  # a spill copies: what was saved before it no longer shares this memory
    _fill(store, rows, pattern, later=True)
    assert store.device_bytes == 4 * (4 * (2 + 2 + 1) + 18)
    found = store.collect([("x", 7, {"a": None, "e": None, "p": None}), ("y", 3, {"a": None}),
                           ("z", 7, {"e": None})])
    assert torch.equal(found["x"]["a"], torch.cat([-rows[:, :2], before[:, 2:5], rows[:, 5:7]],
                                                  dim=1))
    assert found["x"]["e"].shape == found["z"]["e"].shape == (1, 7, 0)
    assert torch.equal(found["x"]["p"], 2 * pattern)
    assert torch.equal(found["y"]["a"], torch.cat([before[:, :2], rows[:, 2:3]], dim=1) * 10)
    for saved in found.values():
        for value in saved.values():
            assert type(value) is torch.Tensor  # on the host
    assert store.device_bytes == 0 and len(store) == 0


def test_a_spill_that_fails_fails_the_requests_it_moved_and_the_store_goes_on(
        monkeypatch, one_device_per_cat) -> None:
    """A spill that cannot finish (the host out of memory; on 2026-12-06 a landing thread that
    could not write an inference tensor) used to raise out of the step and stop the engine for
    every request. Now the requests whose saves it was moving fail, naming the cause, their
    saves freed; later requests save and collect as before."""
    monkeypatch.setattr(host_copies, "STAGING_BYTES", 64)
    rows, pattern = torch.randn(1, 8, 4), torch.randn(2, 3, 3)
    store = SaveStore()
    _fill(store, rows, pattern, later=False)

    def host_full(pairs):
        raise MemoryError("host memory exhausted")

    with monkeypatch.context() as broken:
        broken.setattr(host_copies, "land", host_full)
        store.spill(0)
    assert store.device_bytes == 0
    for program_id in ("x", "y", "z"):
        assert store.failed(program_id)
        assert store.has_saves(program_id, "a") is False
    found = store.collect([("x", 5, {"a": None}), ("y", 2, {"a": None})])
    assert found == {"x": {}, "y": {}}
    why = store.error("x")
    assert why is not None and "MemoryError: host memory exhausted" in why
    assert "save fewer values" in why
    store.save("w", "a", 0, on_a_device(rows[:, :3]), 1)  # a later request: as before
    store.spill(0)
    assert torch.equal(store.collect([("w", 3, {"a": None})])["w"]["a"], rows[:, :3])
    assert store.error("w") is None


@pytest.mark.parametrize("given", ["-1", "1.5", "lots", 1.5, True])
def test_a_bad_device_saves_limit_is_refused_by_name(given) -> None:
    with pytest.raises(ValueError, match="VLLM_INTERP_DEVICE_SAVES_MIB"):
        device_saves_limit(given)


def test_the_device_saves_limit_is_in_mib(monkeypatch) -> None:
    assert device_saves_limit(0) == 0
    assert device_saves_limit("3") == 3 * 2**20
    monkeypatch.setenv("VLLM_INTERP_DEVICE_SAVES_MIB", "5")
    assert device_saves_limit() == 5 * 2**20
    monkeypatch.delenv("VLLM_INTERP_DEVICE_SAVES_MIB")
    assert device_saves_limit() is None  # the store's own: half of the free device memory


def test_without_a_limit_half_the_device_memory_free_at_the_first_save_is_kept(
        monkeypatch) -> None:
    """`spill(None)` asks the saves' device once how much is free, when it first holds saves
    (after vLLM took its share), and keeps up to half of it; a device that cannot say gets
    the fallback."""
    asked: list[torch.device] = []

    def free(device):
        asked.append(device)
        return 1000

    monkeypatch.setattr(store_module, "free_device_bytes", free)
    store = SaveStore()
    store.spill(None)
    assert asked == []  # nothing held: nothing asked
    store.save("x", "a", 0, on_a_device(torch.zeros(1, 5, 25)), 1)  # 500 bytes
    store.spill(None)
    assert store.device_bytes == 500 and asked == [torch.device("cuda", 0)]
    store.save("x", "a", 5, on_a_device(torch.zeros(1, 1, 25)), 1)  # 600 > 1000 // 2
    store.spill(None)
    assert store.device_bytes == 0 and len(asked) == 1

    monkeypatch.setattr(store_module, "free_device_bytes", lambda device: None)
    fallback = SaveStore()
    fallback.save("x", "a", 0, on_a_device(torch.zeros(1, 5, 25)), 1)
    fallback.spill(None)  # 1 GiB: nothing moves
    assert fallback.device_bytes == 500


def test_llm_refuses_a_bad_device_saves_limit_before_starting_the_engine(monkeypatch) -> None:
    from vllm_runner import LLM
    monkeypatch.delenv("VLLM_INTERP_DEVICE_SAVES_MIB", raising=False)
    with pytest.raises(ValueError, match="interp_device_saves_mib"):
        LLM("no-such-model", interp_device_saves_mib=-5)
    monkeypatch.setenv("VLLM_INTERP_DEVICE_SAVES_MIB", "half")
    with pytest.raises(ValueError, match="'half'"):
        LLM("no-such-model")


@st.composite
def histories(draw):
    """One request's saves as steps make them: chunks of 1-5 rows that mostly follow on, with
    recomputations from an earlier position (preemption), and a spill after some of them."""
    chunks, position = [], 0
    for _ in range(draw(st.integers(1, 12))):
        if position and draw(st.integers(0, 4)) == 0:
            position = draw(st.integers(0, position))  # recomputed from here
        size = draw(st.integers(1, 5))
        chunks.append((position, size, draw(st.booleans())))  # (first, rows, spill after)
        position += size
    computed = draw(st.integers(1, position))
    return chunks, computed


@settings(deadline=None, max_examples=200)
@given(histories())
def test_spilling_at_any_point_never_changes_what_is_collected(history) -> None:
    chunks, computed = history
    kept, spilled = SaveStore(), SaveStore()
    with pytest.MonkeyPatch.context() as patch:  # hypothesis: no function-scoped fixtures
        patch.setattr(host_copies, "STAGING_BYTES", 64)  # runs of at most 16 rows are joined
        patch.setattr(torch, "cat", cat_on_one_device)
        for step, (first, size, spill_after) in enumerate(chunks):
            rows = torch.arange(size, dtype=torch.float32).reshape(1, size, 1) + 100 * step
            kept.save("k", "a", first, rows, 1)
            spilled.save("k", "a", first, on_a_device(rows), 1)
            if spill_after:
                spilled.spill(0)
                assert spilled.device_bytes == 0
        expected = kept.collect([("k", computed, {"a": None})])["k"]
        found = spilled.collect([("k", computed, {"a": None})])["k"]
    assert found.keys() == expected.keys()
    if "a" in expected:
        assert type(found["a"]) is torch.Tensor
        assert torch.equal(found["a"], expected["a"])


class _DeviceArena(SaveArena):
    """An arena whose blocks say they are on a GPU (`_OnADevice`): by default blocks of 4 rows
    of one float32, so histories cross several of them."""

    def __init__(self, width: int = 1, block_bytes: int = 16) -> None:
        super().__init__(width, 1, torch.device("cpu"), torch.float32, block_bytes=block_bytes)
        self.device = torch.device("cuda", 0)  # what the store sees; indices stay on the host

    def _allocate(self, rows: int) -> torch.Tensor:
        return on_a_device(torch.empty(rows, self.width))


@settings(deadline=None, max_examples=200)
@given(histories(), st.lists(st.booleans(), min_size=12, max_size=12))
def test_rows_kept_in_an_arena_are_collected_as_if_saved_whole(history, through_arena) -> None:
    """Graph taps' saves wait in an arena (`saves.arena`), the same rows for two taps in one
    `PendingRows`, mixed with saves the taps' Python made, spilled at any point: collected,
    they equal the same rows saved as tensors."""
    chunks, computed = history
    expected_store, store, arena = SaveStore(), SaveStore(), _DeviceArena()
    everything = {"a": None, "b": None}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(host_copies, "STAGING_BYTES", 64)
        patch.setattr(torch, "cat", cat_on_one_device)
        for step, (first, size, spill_after) in enumerate(chunks):
            rows = torch.arange(size, dtype=torch.float32).reshape(1, size, 1) + 100 * step
            by_location = {"a": rows, "b": -rows}
            for location, value in by_location.items():
                expected_store.save("k", location, first, value, 1)
            if through_arena[step]:
                block, row = arena.reserve(size)
                arena.write(list(by_location), block, row,
                            [value[0] for value in by_location.values()])
                store.save_pending(("a", "b"), arena, [("k", first, block, row, size)])
            else:
                for location, value in by_location.items():
                    store.save("k", location, first, on_a_device(value), 1)
            assert store.device_bytes > 0
            if spill_after:
                store.spill(0)
                assert store.device_bytes == 0
        expected = expected_store.collect([("k", computed, everything)])["k"]
        found = store.collect([("k", computed, everything)])["k"]
    assert found.keys() == expected.keys() == {"a", "b"}
    for location, value in found.items():
        assert type(value) is torch.Tensor  # on the host
        assert torch.equal(value, expected[location])
    assert arena.blocks <= 1  # only the block rows still go into is kept


def three_requests_over_six_blocks(arena: SaveArena | None = None
                                   ) -> tuple[SaveStore, SaveArena]:
    """Three requests x, y, z saving one row each at taps a and b for 12 steps (the value: the
    step), in an arena (by default on the host) of blocks of 6 rows: 2 steps a block."""
    store = SaveStore()
    arena = arena or SaveArena(2, 1, torch.device("cpu"), torch.float32, 48)
    for step in range(12):
        block, row = arena.reserve(3)
        arena.write(["a", "b"], block, row, [torch.full((3, 2), float(step))] * 2)
        store.save_pending(("a", "b"), arena, [(key, step, block, row + index, 1)
                                               for index, key in enumerate("xyz")])
    return store, arena


def test_an_arenas_blocks_are_freed_when_their_requests_are_collected_or_dropped() -> None:
    store, arena = three_requests_over_six_blocks()
    assert arena.blocks == 6
    assert store.held() == {"requests": 3, "bytes": 3 * 2 * 12 * 2 * 4}
    store.drop(["x"])
    found = store.collect([("y", 12, {"a": None, "b": None})])["y"]
    for value in found.values():
        assert torch.equal(value, torch.arange(12.0).reshape(1, 12, 1).expand(1, 12, 2))
    assert arena.blocks == 6  # z's rows are in every block
    store.drop(["z"])
    assert arena.blocks == 1 and len(store) == 0


def test_a_collection_gathers_many_requests_rows_from_a_gpu_arena_together(monkeypatch) -> None:
    """Rows waiting in an arena on a GPU come out for all the requests a collection takes at
    once: one `index_select` per block and tap (not one per request too), their indices sent to
    the device in one copy (a blocking copy waits for the work queued before it), once for the
    taps that saved the same requests."""
    from vllm_runner.saves import arena as save_arena
    store, arena = three_requests_over_six_blocks(_DeviceArena(width=2, block_bytes=48))
    copies: list[int] = []
    copy = save_arena._on_index_device
    monkeypatch.setattr(save_arena, "_on_index_device",
                        lambda index, device: copies.append(len(index)) or copy(index, device))
    selects: list[int] = []
    index_select = torch.Tensor.index_select

    def counted(rows: torch.Tensor, *args: object) -> torch.Tensor:
        selects.append(1)
        with torch._C.DisableTorchFunctionSubclass():  # the subclass would call it once more
            return index_select(rows, *args)

    monkeypatch.setattr(torch.Tensor, "index_select", counted)
    found = store.collect([(key, 12, {"a": None, "b": None}) for key in "xyz"])
    assert copies == [2 * 3 * 12]  # every row's source and target, the taps sharing them
    assert len(selects) == 2 * 6  # the blocks at each tap
    for key in "xyz":
        for value in found[key].values():
            assert type(value) is torch.Tensor  # on the host
            assert torch.equal(value, torch.arange(12.0).reshape(1, 12, 1).expand(1, 12, 2))
    assert arena.blocks == 1  # only the block rows still go into is kept


def test_a_collection_larger_than_a_staging_buffer_gathers_in_groups(monkeypatch) -> None:
    """Gathered together, a collection's rows would all be on the device at once: requests are
    gathered in groups of at most a staging buffer's worth (here 2 of the 3 requests' 96 bytes
    a tap), and each still gets its own rows."""
    monkeypatch.setattr(host_copies, "STAGING_BYTES", 2 * 2 * 96)
    store, _ = three_requests_over_six_blocks(_DeviceArena(width=2, block_bytes=48))
    gathered: list[int] = []
    together = store_module.gather_together
    monkeypatch.setattr(store_module, "gather_together",
                        lambda waiting: gathered.append(len(waiting := list(waiting)))
                        or together(waiting))
    found = store.collect([(key, 12, {"a": None, "b": None}) for key in "zxy"])
    assert gathered == [2 * 2, 2]  # (request, tap) pairs: z and x, then y
    for key in "xyz":
        for value in found[key].values():
            assert torch.equal(value, torch.arange(12.0).reshape(1, 12, 1).expand(1, 12, 2))


def test_a_collection_for_another_process_writes_rows_into_files_from_the_staging_buffer(
        monkeypatch) -> None:
    """A client in another process on this host (`wire.SharedFiles`): each request's rows go
    from the staging buffer straight into its file, none into memory of the worker's own, and
    the client gets them back as they were saved."""
    from vllm_runner.saves import wire
    monkeypatch.setattr(wire, "SHARED_MIN_BYTES", 1)
    monkeypatch.setattr(host_copies, "on_a_device", lambda rows: True)
    landed: list[int] = []
    land = host_copies.land
    monkeypatch.setattr(host_copies, "land", lambda pairs: landed.append(len(pairs)) or land(pairs))
    store, _ = three_requests_over_six_blocks(_DeviceArena(width=2, block_bytes=48))
    files = wire.SharedFiles()
    found = store.collect([(key, 12, {"a": None, "b": None}) for key in "xyz"], files.places)
    assert all(value.is_meta for saved in found.values() for value in saved.values())
    assert not any(landed)
    data = wire.encode({key: {"error": None, "saved": saved} for key, saved in found.items()},
                       files=files)
    assert all(data[key]["segment"] for key in "xyz")
    for result in wire.decode(data).values():
        for value in result["saved"].values():
            assert torch.equal(value, torch.arange(12.0).reshape(1, 12, 1).expand(1, 12, 2))


@pytest.mark.parametrize("client", ["in-process", "another-process"])
@pytest.mark.parametrize(("failing", "at_call"), [("gather_together", 2),
                                                  ("_in_position_order", 1)],
                         ids=["gathering-the-second-group", "joining-a-requests-first-tap"])
def test_a_collection_that_fails_halfway_fails_its_requests_and_the_store_goes_on(
        monkeypatch, client: str, failing: str, at_call: int) -> None:
    """A collection that cannot finish (the host out of memory) used to raise out of the
    worker's call, and the caller lost every request's text, those without programs too. Now
    each request it was collecting fails naming the cause (after an earlier failure of its
    program) and comes back with no saves; every row they held is freed, the arena's blocks
    too — those of a request taken out of the store when the failure came among them; files
    made for a client in another process are removed; later requests save and collect as
    before."""
    import os

    from vllm_runner.saves import wire
    monkeypatch.setattr(wire, "SHARED_MIN_BYTES", 1)
    monkeypatch.setattr(host_copies, "STAGING_BYTES", 2 * 2 * 96)  # groups: z and x, then y
    monkeypatch.setattr(host_copies, "on_a_device", lambda rows: True)
    store, arena = three_requests_over_six_blocks(_DeviceArena(width=2, block_bytes=48))
    store.fail("x", "an edit was not finite")
    files = wire.SharedFiles() if client == "another-process" else None
    works, calls = getattr(store_module, failing), []

    def host_full(*args):
        calls.append(1)
        if len(calls) == at_call:
            raise MemoryError("host memory exhausted")
        return works(*args)

    with monkeypatch.context() as broken:
        broken.setattr(store_module, failing, host_full)
        found = store.collect([(key, 12, {"a": None, "b": None}) for key in "zxy"],
                              files.places if files else None)
    assert found == {"z": {}, "x": {}, "y": {}}
    assert len(calls) == at_call and len(store) == 0 and store.held()["bytes"] == 0
    assert not store._axes and not store._fills
    assert arena.blocks == 1  # only the block rows still go into is kept
    for key in "zxy":
        why = store.error(key)
        assert why is not None and "MemoryError: host memory exhausted" in why
        assert "its text is complete" in why
        assert why.startswith("an edit was not finite; then ") == (key == "x")
    if files is not None:
        made = [file.path for file in files.files.values()]
        assert bool(made) == (failing == "gather_together")  # z's and x's, written before
        data = wire.encode({key: {"error": "failed", "saved": {}} for key in "zxy"},
                           files=files)
        assert all(data[key]["segment"] is None for key in "zxy")
        assert not any(os.path.exists(path) for path in made)
    rows = torch.randn(1, 3, 2)
    store.save("w", "a", 0, on_a_device(rows), 1)  # a later request: as before
    assert torch.equal(store.collect([("w", 3, {"a": None})])["w"]["a"], rows)
    assert store.error("w") is None


@pytest.mark.parametrize("raised", [MemoryError, KeyboardInterrupt])
@pytest.mark.parametrize("on_a_gpu", [False, True], ids=["host-arena", "device-arena"])
def test_a_request_whose_rows_fail_to_join_frees_its_arena_blocks(
        monkeypatch, on_a_gpu: bool, raised: type[BaseException]) -> None:
    """The last request holding an arena's blocks fails, or is interrupted, while its rows are
    put in position order, after the store let go of them: its blocks are freed all the same
    (they stayed held for the engine's life: 16 MiB or more a tap on a GPU)."""
    store, arena = three_requests_over_six_blocks(
        _DeviceArena(width=2, block_bytes=48) if on_a_gpu else None)
    store.drop(["y", "z"])
    assert arena.blocks == 6

    def fails(*args):
        raise raised("host memory exhausted")

    monkeypatch.setattr(store_module, "_in_position_order", fails)
    if raised is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            store.collect([("x", 12, {"a": None, "b": None})])
    else:
        assert store.collect([("x", 12, {"a": None, "b": None})]) == {"x": {}}
    assert arena.blocks == 1 and len(store) == 0
    assert not store._axes and not store._fills


@settings(deadline=None, max_examples=150)
@given(st.integers(1, 4), st.lists(st.tuples(st.booleans(), st.integers(-1, 3), st.booleans()),
                                   min_size=1, max_size=10))
def test_decode_steps_kept_as_a_run_are_collected_as_if_saved_whole(members, steps) -> None:
    """Decode steps of an unchanged schedule keep their graph-tap saves once a step
    (`repeated_saves`); spilled, dropped, or jumping to other positions (a step the run did not
    see) at any step, every request's rows come back as if each step's were saved as tensors,
    the device bytes counted are the rows still there, and the arena's blocks are freed."""
    from parts import layout_of
    from vllm_runner.compiled.repeated_saves import RepeatedSaves

    store, expected_store, arena = SaveStore(), SaveStore(), _DeviceArena()
    rings = [SimpleNamespace(location=location, arena=arena, ring=torch.zeros(8, 1))
             for location in ("a", "b")]
    repeated = RepeatedSaves()
    live = [f"p{member}" for member in range(members)]
    rows = [(program_id, index) for index, program_id in enumerate(live)]  # the plan's list
    position, on_device = 0, dict.fromkeys(live, 0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "cat", cat_on_one_device)
        for step, (spill, dropped, jump) in enumerate(steps):
            position += 2 if jump else 1  # a jump: the run's next step is not this one
            for number, ring in enumerate(rings):
                ring.ring.copy_(torch.arange(8.0).reshape(8, 1) + 100 * step + 1000 * number)
            layout = layout_of([1] * members, [position] * members)
            for program_id, index in rows:
                for ring in rings:
                    expected_store.save(program_id, ring.location, position,
                                        ring.ring[index:index + 1].clone().unsqueeze(0), 1)
                on_device[program_id] += 1
            repeated.keep([(rings, rows)], layout, store)  # type: ignore[list-item]
            assert store.device_bytes == sum(on_device.values()) * 2 * 4
            if spill:
                store.spill(0)
                on_device = dict.fromkeys(on_device, 0)
                assert store.device_bytes == 0
            if 0 <= dropped < len(rows):  # aborted: the next steps schedule the others
                program_id = rows[dropped][0]
                store.drop([program_id])
                expected_store.drop([program_id])
                on_device.pop(program_id)
                rows = [row for row in rows if row[0] != program_id]
        assert store.held() == expected_store.held()
        wanted = [(program_id, 10_000, {"a": None, "b": None}) for program_id, _ in rows]
        found = store.collect(wanted)
        expected = expected_store.collect(wanted)
    for program_id, _ in rows:
        for location in ("a", "b"):
            assert torch.equal(found[program_id][location], expected[program_id][location])
    assert len(store) == 0
    assert arena.blocks <= 1  # only the block rows still go into is kept


def test_rows_saved_apart_from_a_run_of_steps_end_the_run() -> None:
    """A request of a run of steps (`SharedRows`) given rows that do not follow on (another
    position, saved request by request) leaves the run: no later step may extend it."""
    from vllm_runner.saves.arena import SharedRows

    store, arena = SaveStore(), SaveArena(1, 1, torch.device("cpu"), torch.float32, 64)
    block, row = arena.reserve(1)
    arena.write(["a"], block, row, [torch.zeros(1, 1)])
    [pending] = store.save_pending(("a",), arena, [("k", 0, block, row, 1)])
    run = SharedRows(arena, [0], [1])
    pending.join(run, 0)
    block, row = arena.reserve(1)
    arena.write(["a"], block, row, [torch.ones(1, 1)])
    run.add(block, row)
    assert run.open and pending.end == 2
    block, row = arena.reserve(1)
    arena.write(["a"], block, row, [torch.full((1, 1), 5.0)])
    store.save_pending(("a",), arena, [("k", 5, block, row, 1)])  # not position 2
    assert not run.open
    found = store.collect([("k", 10, {"a": None})])["k"]["a"]
    assert found.flatten().tolist() == [0.0, 1.0, 5.0]


def test_unread_checks_fail_their_requests_when_a_failure_is_next_asked_about() -> None:
    """Edits' non-finite values counted on the device (`unread_checks`): a read later in the same
    forward does not wait for the answers (`failed_so_far`); an edit (`failed`), the next step
    (`any_failed`), an error's reader and collection do, and fail whom they refused, each
    with its own message."""
    from vllm_runner.saves.unread_checks import UnreadChecks

    store = SaveStore()
    store.check_later(UnreadChecks(["p-a", "p-b"], torch.tensor([0, 3]),
                                   lambda index, bad: f"{'ab'[index]} has {bad} bad values"))
    assert store.may_have_failed and not store.failed_so_far("p-b")
    assert store.failed("p-b") and not store.failed("p-a")
    assert store.error("p-b") == "b has 3 bad values"
    assert not store.may_have_failed

    def refused(program_id: str) -> UnreadChecks:
        return UnreadChecks([program_id], torch.tensor([1]), lambda *_: f"{program_id} is bad")

    store.check_later(refused("p-c"))
    assert store.any_failed and store.error("p-c") == "p-c is bad"
    store.check_later(refused("p-d"))
    assert store.error("p-d") == "p-d is bad"
    store.check_later(refused("p-e"))
    store.collect([("p-e", 10, {})])
    assert store.failed_so_far("p-e") and store.error("p-e") == "p-e is bad"


@pytest.mark.parametrize("spilled", [False, True])
def test_results_of_different_widths_are_padded_to_the_widest_not_cut(
        monkeypatch, one_device_per_cat, spilled) -> None:
    """An SAE's every active feature (`Features(top_k=None)`): each step's pieces as wide as its
    busiest row, padded with their fill to the request's widest when collected (or moved to the
    host first), and not cut to a position's width as an attention pattern's are; a filtered
    position keeps its row's width."""
    monkeypatch.setattr(host_copies, "STAGING_BYTES", 64)
    store = SaveStore()
    prefill = torch.arange(3 * 5).reshape(1, 3, 5)
    decode = [torch.tensor([[[7, 8]]]), torch.tensor([[[9, 1, 2, 3, 4, 5, 6]]])]
    store.save("x", "f", 0, on_a_device(prefill), 1, -1, width_is_position=False)
    store.save("x", "f", 3, on_a_device(decode[0]), 1, -1, width_is_position=False)
    if spilled:
        store.spill(0)
    store.save("x", "f", 4, on_a_device(decode[1]), 1, -1, width_is_position=False)
    store.save("y", "f", 0, on_a_device(prefill), 1, -1, width_is_position=False)
    found = store.collect([("x", 5, {"f": None}), ("y", 2, {"f": lambda position: position < 2})])
    expected = torch.full((1, 5, 7), -1)
    expected[0, :3, :5] = prefill[0]
    expected[0, 3, :2] = decode[0][0, 0]
    expected[0, 4] = decode[1][0, 0]
    assert torch.equal(found["x"]["f"], expected)
    assert torch.equal(found["y"]["f"], prefill[:, :2])
