"""LayerProgress: per-layer readiness of a load, on its own, through the DeviceCopier's
thread backend (both KV layouts) and through the engine's loads (CPU tier and NVMe, a
damaged block). The CUDA backend's per-layer events: tests/test_cuda_copies.py."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from _device_kv import (
    CountingExecutor,
    block_bytes_of,
    failing_index_copy,
    layers_of,
    make_kv,
    opened,
    snapshot,
)

from tests._engine_helpers import (
    assert_holds,
    corrupt_block,
    h,
    nvme_spec,
    put,
    settle,
    wipe,
)
from tests._engine_helpers import make_kv as engine_kv
from tiering import InvalidArgumentError, LayerProgress, TieringEngine, TransferError
from tiering.device.copier import DeviceCopier
from tiering.device.host_pool import HostPool
from tiering.device.thread_copies import ThreadCopyBackend

LAYOUTS = ["one_tensor", "mixed_dtypes"]  # one tensor; per-layer tensors


def wait_every_layer(progress: LayerProgress, timeout: float | None = None) -> None:
    """What a forward does over a whole load: wait for each layer in turn."""
    for layer in range(progress.num_layers):
        progress.wait(layer, timeout)


# ------------------------------------------------------------------------ on its own


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_a_bad_layer_count_is_rejected(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="num_layers"):
        LayerProgress(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 3, True, "0", None])
def test_a_bad_layer_index_is_rejected_by_every_query(bad: object) -> None:
    progress = LayerProgress(3)
    for call in (progress.ready, progress.wait, progress.mark):
        with pytest.raises(InvalidArgumentError, match="layer"):
            call(bad)  # type: ignore[operator]


def test_marks_make_layers_ready_one_by_one_and_a_failure_fails_only_the_rest() -> None:
    progress = LayerProgress(3)
    assert not progress.started and not progress.done()
    progress.mark(0)
    assert progress.ready(0) and not progress.ready(1) and progress.started
    progress.wait(0, timeout=0)
    with pytest.raises(TimeoutError, match="layer 1"):
        progress.wait(1, timeout=0)
    progress.fail(RuntimeError("link down"))
    assert progress.done() and isinstance(progress.error, TransferError)
    progress.wait(0)  # landed before the failure: still readable
    for layer in (1, 2):
        with pytest.raises(TransferError, match="link down"):
            progress.wait(layer)
    progress.mark(1)  # too late: a failed layer stays failed
    assert not progress.ready(1)


def test_a_failure_after_every_layer_landed_changes_nothing() -> None:
    progress = LayerProgress(2)
    progress.mark_all()
    progress.fail("late")
    assert progress.error is None and progress.done()
    wait_every_layer(progress, timeout=0)


def test_a_waiting_thread_wakes_on_its_layer() -> None:
    progress = LayerProgress(2)
    seen: list[object] = []
    waiter = threading.Thread(target=lambda: seen.append(progress.wait(1)))
    waiter.start()
    progress.mark(0)
    progress.mark(1)
    waiter.join()
    assert seen == [None]


class _Marker:
    def __init__(self) -> None:
        self.fired = False
        self.waits = 0

    def query(self) -> bool:
        return self.fired

    def wait(self) -> None:
        self.waits += 1


def test_a_marked_layer_behind_a_marker_is_ready_once_it_fires_and_wait_defers_to_it() -> None:
    progress, marker = LayerProgress(1), _Marker()
    progress.mark(0, marker)
    assert not progress.ready(0)  # enqueued, not landed
    progress.wait(0, timeout=0)  # returns at once: the stream waits, not the host
    assert marker.waits == 1
    marker.fired = True
    assert progress.ready(0)


# ------------------------------------------------------------------ the thread backend


class _CheckingProgress(LayerProgress):
    """Records, as each layer is marked, the order and whether that layer's rows of
    every block already hold what the load copies."""

    def __init__(
        self, kv: torch.Tensor | list[torch.Tensor], want: list[torch.Tensor], ids: list[int]
    ) -> None:
        super().__init__(len(want))
        self.kv, self.want, self.ids = kv, want, ids
        self.order: list[int] = []
        self.landed: list[bool] = []

    def mark(self, layer: int, event: object = None) -> None:
        rows = layers_of(self.kv)[layer].view(torch.uint8)[self.ids]
        self.landed.append(torch.equal(rows, self.want[layer][self.ids]))
        self.order.append(layer)
        super().mark(layer, event)  # type: ignore[arg-type]


@pytest.mark.parametrize("max_rows", [1, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
async def test_thread_backend_marks_each_layer_in_order_once_its_rows_landed(
    layout: str, max_rows: int
) -> None:
    async with opened(layout, staging_bytes=1) as (copier, kv, _pool):
        copier.max_rows = max_rows  # 1: a job of many chunks
        ids, slots = [11, 2, 3, 9, 0], [0, 9, 1, 2, 8]
        await copier.to_host(ids, slots)
        want = snapshot(kv)
        for t in layers_of(kv):
            t.zero_()
        progress = _CheckingProgress(kv, want, ids)
        handle = copier.to_device(slots, ids, progress=progress)
        await asyncio.to_thread(wait_every_layer, progress)  # a forward's thread, off the loop
        await handle
        layers = len(layers_of(kv))
        assert progress.order == list(range(layers))
        assert progress.landed == [True] * layers


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_no_layer_is_ready_before_the_worker_copies_it(layout: str) -> None:
    executor = CountingExecutor(1)
    backend = ThreadCopyBackend(max_workers=1, executor=executor)
    async with opened(layout, backend=backend) as (copier, _kv, _):
        progress = LayerProgress(copier.num_layers)
        with executor.held() as gate:
            handle = copier.to_device([0, 1], [4, 5], progress=progress)
            await asyncio.sleep(0)  # the hop is dispatched, and waits for the worker
            assert not any(progress.ready(i) for i in range(progress.num_layers))
            with pytest.raises(TimeoutError):
                progress.wait(0, timeout=0)
            gate.set()
            await handle
        assert all(progress.ready(i) for i in range(progress.num_layers))
    executor.shutdown()


async def test_a_copy_failing_part_way_fails_the_layers_not_landed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with opened("mixed_dtypes") as (copier, _kv, _):
        progress = LayerProgress(copier.num_layers)
        with (
            failing_index_copy(monkeypatch, 2, "simulated scatter fault"),  # the 2nd layer
            pytest.raises(TransferError, match="simulated scatter fault"),
        ):
            await copier.to_device([3], [1], progress=progress)
        progress.wait(0)
        for layer in (1, 2):
            with pytest.raises(TransferError, match="simulated scatter fault"):
                progress.wait(layer)


async def test_empty_load_marks_every_layer() -> None:
    async with opened("mixed_dtypes") as (copier, _, _):
        progress = LayerProgress(copier.num_layers)
        await copier.to_device([], [], progress=progress)
        wait_every_layer(progress, timeout=0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda n: "layers", "must be a LayerProgress"),
        (lambda n: LayerProgress(n + 1), "counts 4 layers but the KV cache has 3"),
        (lambda n: _marked(LayerProgress(n)), "in use already"),
    ],
)
async def test_a_bad_progress_is_rejected_before_anything_is_copied(make, message: str) -> None:
    async with opened("mixed_dtypes") as (copier, kv, _):
        before = snapshot(kv)
        with pytest.raises(InvalidArgumentError, match=message):
            copier.to_device([0], [1], progress=make(copier.num_layers))
        assert copier.statistics().jobs_in_flight == 0
        assert all(torch.equal(a, b) for a, b in zip(snapshot(kv), before, strict=True))


def _marked(progress: LayerProgress) -> LayerProgress:
    progress.mark(0)
    return progress


def test_a_copier_counts_the_kv_caches_tensors_as_layers() -> None:
    for layout, layers in (("one_tensor", 1), ("mixed_dtypes", 3)):
        kv = make_kv(layout, "cpu")
        with HostPool(2, block_bytes_of(kv)) as pool:
            assert DeviceCopier(kv, pool).num_layers == layers


# --------------------------------------------------------------------------- the engine


async def test_an_engine_load_marks_every_layer_and_the_bytes_are_there() -> None:
    kv = engine_kv(1)
    keys = [h(i) for i in range(4)]
    put(kv, keys, [0, 1, 2, 3])
    async with TieringEngine(kv, 8) as engine:
        assert engine.num_layers == 3
        assert (await engine.store(keys, [0, 1, 2, 3])).success
        wipe(kv, [4, 5, 6, 7])
        progress = LayerProgress(engine.num_layers)
        job = engine.load(keys, [4, 5, 6, 7], progress=progress)
        await asyncio.to_thread(wait_every_layer, progress)
        assert_holds(kv, keys, [4, 5, 6, 7])  # every layer readable before the job's await
        assert (await job).success
        with pytest.raises(InvalidArgumentError, match="in use already"):
            engine.load(keys, [4, 5, 6, 7], progress=progress)
        with pytest.raises(InvalidArgumentError, match="counts 2 layers"):
            engine.load(keys, [4, 5, 6, 7], progress=LayerProgress(2))


async def test_an_engine_load_from_nvme_marks_layers_and_a_damaged_block_fails_them(
    tmp_path: Path,
) -> None:
    kv = engine_kv(2)
    keys, fillers = [h(i) for i in range(3)], [h(i) for i in range(10, 13)]
    put(kv, keys + fillers, [0, 1, 2, 3, 4, 5])
    async with TieringEngine(kv, 3, secondary_tiers=[nvme_spec(tmp_path)]) as engine:
        store = engine.store(keys, [0, 1, 2])
        assert (await store).success and await store.cascaded
        assert (await engine.store(fillers, [3, 4, 5])).success  # the prefix leaves the CPU
        await settle(engine)
        before = engine.lookup_statistics().hits_by_tier
        assert engine.lookup(keys) == 3
        after = engine.lookup_statistics().hits_by_tier
        assert after[1] - (before[1] if before else 0) == 3  # all three on NVMe only
        wipe(kv, [6, 7, 8])
        progress = LayerProgress(engine.num_layers)
        job = engine.load(keys, [6, 7, 8], progress=progress)
        await asyncio.to_thread(wait_every_layer, progress)
        assert_holds(kv, keys, [6, 7, 8])
        assert (await job).success

        assert (await engine.store(fillers, [3, 4, 5])).success
        await settle(engine)
        corrupt_block(tmp_path, keys[1])
        engine.touch(fillers)  # the prefix's blocks are the CPU tier's victims
        others = [h(i) for i in range(20, 23)]
        put(kv, others, [9, 10, 11])
        assert (await engine.store(others, [9, 10, 11])).success
        await settle(engine)
        progress = LayerProgress(engine.num_layers)
        job = engine.load(keys, [6, 7, 8], progress=progress)
        with pytest.raises(TransferError):
            await asyncio.to_thread(progress.wait, 0)
        result = await job
        assert not result.success and keys[1] in result.failed_keys
