"""Helpers shared by the engine's acceptance tests (defects, bad input, soak).

Everything here goes through the engine's public API: device KV tensors on the CPU,
real tiers, ``statistics()`` for "nothing left in flight". A block's content is a
deterministic function of its key (:func:`block_content`), so any tier, any engine and
any restart agree on what a key's bytes must be.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from backends.memory import MemoryTier
from tests._faults import Fault, FaultInjector
from tiering import JobMetadata, JobResult, TieringEngine
from tiering.errors import CorruptBlockError
from tiering.tiers.block_record import HEADER_BYTES, decode_header

DEVICE_BLOCKS = 32
SETTLE_S = 30.0
"""Generous bound for background work to end: a bound against hangs, not a timing check."""


def h(i: int) -> bytes:
    """The block hash numbered ``i``."""
    return i.to_bytes(8, "big")


def make_kv(seed: int = 0) -> list[torch.Tensor]:
    """Three layers of mixed dtypes; a block is 2*4*8*(2+4+2) = 512 bytes."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(DEVICE_BLOCKS, 2, 4, 8)] * 3
    dtypes = [torch.float16, torch.float32, torch.bfloat16]
    return [torch.randn(s, generator=gen).to(d) for s, d in zip(shapes, dtypes, strict=True)]


def block_content(key: bytes, kv: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The rows a block hash stands for: equal hashes mean equal KV, in every tier."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8].rjust(8, b"\0"), "big"))
    return [torch.randn(layer.shape[1:], generator=gen).to(layer.dtype) for layer in kv]


def put(kv: Sequence[torch.Tensor], keys: Sequence[bytes], ids: Sequence[int]) -> None:
    """Write each key's content into its device block (what a store then copies)."""
    for key, i in zip(keys, ids, strict=True):
        for layer, want in zip(kv, block_content(key, kv), strict=True):
            layer[i] = want


def wipe(kv: Sequence[torch.Tensor], ids: Sequence[int]) -> None:
    """Zero device blocks, so a load that writes nothing is seen."""
    for layer in kv:
        layer[list(ids)] = 0


def holds(kv: Sequence[torch.Tensor], key: bytes, i: int) -> bool:
    """True if device block ``i`` holds exactly ``key``'s content."""
    return all(
        torch.equal(layer[i], want) for layer, want in zip(kv, block_content(key, kv), strict=True)
    )


def assert_holds(kv: Sequence[torch.Tensor], keys: Sequence[bytes], ids: Sequence[int]) -> None:
    for key, i in zip(keys, ids, strict=True):
        assert holds(kv, key, i), f"device block {i} does not hold the bytes of {key.hex()}"


def nvme_spec(
    root: Path | str,
    faults: FaultInjector | None = None,
    *,
    tier: str = "nvme",
    one_record_segments: bool = False,
    **extra: Any,
) -> dict:
    """An NVMe tier spec under ``root`` that never refuses for free space (``tier``: the
    registered name). ``one_record_segments`` makes each record a segment of its own, so
    that each block is a write of its own: what a fault aimed at one key's writes needs."""
    spec: dict[str, Any] = {
        "type": tier,
        "root": str(root),
        "capacity_bytes": 64 << 20,
        "min_free_bytes": 0,
    }
    if faults is not None:
        spec["os_calls"] = faults
    if one_record_segments:
        spec["segment_bytes"] = HEADER_BYTES + 1  # rounds up to one record
    spec.update(extra)
    return spec


def block_copies(root: Path) -> dict[bytes, list[tuple[Path, int, int]]]:
    """Every stored copy of every block under ``root``: key -> ``(segment file, payload
    offset, payload length)`` (records whose header verifies)."""
    copies: dict[bytes, list[tuple[Path, int, int]]] = {}
    for path in sorted(root.rglob("*.seg")):
        data = path.read_bytes()
        start = HEADER_BYTES  # records follow the segment header, at page boundaries
        while start + HEADER_BYTES <= len(data):
            try:
                header = decode_header(data[start : start + HEADER_BYTES])
            except CorruptBlockError:
                start += 4096
                continue
            payload = header.payload_bytes
            if start + HEADER_BYTES + payload <= len(data):
                copies.setdefault(header.key, []).append((path, start + HEADER_BYTES, payload))
            start += HEADER_BYTES + -(-payload // 4096) * 4096
    return copies


def flip_byte(path: Path, offset: int) -> tuple[int, int]:
    """Invert the byte at ``offset`` of ``path``; returns (the byte now, the byte before)."""
    with open(path, "r+b") as file:
        file.seek(offset)
        before = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([before ^ 0xFF]))
    return before ^ 0xFF, before


def corrupt_block(root: Path, key: bytes) -> None:
    """Flip the last payload byte of every stored copy of ``key`` under ``root``: its
    checksum no longer matches."""
    copies = block_copies(root).get(key, [])
    assert copies, f"no stored copy of {key.hex()} under {root}"
    for path, offset, length in copies:
        flip_byte(path, offset + length - 1)


async def settle(engine: TieringEngine, bound_s: float = SETTLE_S) -> None:
    """Wait until the engine reports no job in flight and no pinned block.

    Polls ``statistics()``; the bound only guards against a hang.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while True:
        stats = engine.statistics()
        if stats.jobs_in_flight == 0 and stats.pinned_blocks == 0:
            return
        if loop.time() > deadline:
            raise AssertionError(f"engine did not settle within {bound_s} s: {stats!r}")
        await asyncio.sleep(0.005)


def assert_no_leaks(engine: TieringEngine) -> None:
    """Nothing in flight and nothing pinned (call after :func:`settle`)."""
    stats = engine.statistics()
    assert stats.jobs_in_flight == 0 and stats.pinned_blocks == 0, repr(stats)
    assert len(engine.manager.ready_hashes()) == len(engine.manager), "a store never ended"


async def result_of(job: Any) -> JobResult:
    """``await job`` as a coroutine, for ``asyncio.create_task``."""
    return await job


async def poll(predicate: Callable[[], bool], bound_s: float = SETTLE_S) -> bool:
    """Let the loop run until ``predicate()`` holds (True) or ``bound_s`` passed (False)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.002)
    return True


async def until(predicate: Callable[[], bool], what: str, bound_s: float = SETTLE_S) -> None:
    """Let the loop run until ``predicate()`` holds; fail after ``bound_s`` s."""
    if not await poll(predicate, bound_s):
        raise AssertionError(f"timed out waiting for {what}")


async def reached(rule: Fault, bound_s: float = SETTLE_S) -> None:
    """Wait (without blocking the loop) until a call is held or slowed by ``rule``."""
    await until(rule.reached.is_set, f"a {rule.op} call to reach its fault rule", bound_s)


async def spin(iterations: int = 20) -> None:
    """Let the loop run a few iterations, so callbacks already due have run."""
    for _ in range(iterations):
        await asyncio.sleep(0)


class KeyGatedMemoryTier(MemoryTier):
    """A memory tier whose loads of chosen keys wait at a per-key gate.

    ``gate(key)`` closes the gate of ``key`` (creating it); a load job that names a
    gated key waits until every gate of its keys is open. Every store job waits until
    ``store_gate`` is set (it is, until a test clears it).
    """

    def __init__(self, view: memoryview, block_bytes: int, **kwargs: Any) -> None:
        super().__init__(view, block_bytes, **kwargs)
        self.gates: dict[bytes, asyncio.Event] = {}
        self.store_gate = asyncio.Event()
        self.store_gate.set()
        self.loading: list[list[bytes]] = []
        self.storing_jobs = 0

    def gate(self, key: bytes) -> asyncio.Event:
        event = self.gates.setdefault(key, asyncio.Event())
        event.clear()
        return event

    async def _do_load(self, job: JobMetadata) -> JobResult:
        self.loading.append(list(job.keys))
        for key in job.keys:
            if key in self.gates:
                await self.gates[key].wait()
        return await super()._do_load(job)

    async def _do_store(self, job: JobMetadata) -> JobResult:
        self.storing_jobs += 1
        await self.store_gate.wait()
        return await super()._do_store(job)


def key_gated(**kwargs: Any) -> tuple[Callable[[memoryview, int], KeyGatedMemoryTier], list]:
    """A tier factory for the engine's ``secondary_tiers`` and the list it fills."""
    made: list[KeyGatedMemoryTier] = []

    def factory(view: memoryview, block_bytes: int) -> KeyGatedMemoryTier:
        made.append(KeyGatedMemoryTier(view, block_bytes, **kwargs))
        return made[-1]

    return factory, made


def engine_tasks(before: Collection[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    """Tasks of the running loop not in ``before`` and not yet done."""
    return {t for t in asyncio.all_tasks() if t not in before and not t.done()}
