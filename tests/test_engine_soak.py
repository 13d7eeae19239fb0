"""A seeded, model-based soak of the engine's public API.

Each seed picks a configuration (write policy, CPU eviction policy, a CPU tier of 2 to 6
slots, a memory tier admitting by a drawn rule within a drawn write budget and/or an NVMe
tier of either layout under ``tmp_path``) and runs
several engine *lives* on the same NVMe root. A life is rounds of concurrent random
jobs: stores, loads of ``keys[:lookup(keys)]``, touches, awaiters cancelled at random
points (the job must still complete), ``flush()`` awaited or cut short by ``wait_for``.
Jobs name one of several tenants in some configurations (a tenant's blocks hold bytes of
its own, so one served across tenants is caught), and the NVMe tier encrypts its blocks
in some. Some lives inject tier faults through a :class:`tests._faults.FaultInjector`: EIO on
reads, a flipped byte in a stored block (a block file or a segment record), ENOSPC for
a few writes; any life may have slow calls. A life ends with a graceful close
(sometimes with jobs still in flight) or a hard ``close()``.

The reference model is simple because a block's content is a function of its key
(:func:`tests._engine_helpers.block_content`). Checks:

* every key a load reports as landed holds exactly its bytes on the device;
* every job yields exactly one result, and one ``get_finished()`` entry, and a result
  is successful exactly when it names no failed key;
* after every round the engine settles: no job in flight, no pinned block;
* after a graceful close of a life without damaging faults (slow calls allowed), every
  key whose store succeeded in that life is found by ``lookup`` in the next engine on
  that root and loads byte-exact (NVMe configurations only);
* after a hard ``close()`` of such a life, every block the NVMe tier had stored by its
  events (as a router follows them) is found in the next engine and loads byte-exact.
  The NVMe tier checkpoints every 1 to 3 blocks in most configurations, so checkpoints
  are written while other store jobs are still in flight.

A flipped byte is put back after its life ends (if the file is still the one flipped),
so damage never leaks into a later life's durability check.

The small-caps soak (``test_soak_small_caps_write_back``) runs a segment-layout NVMe tier
under write-back whose cap holds fewer blocks than the soak's keys (2 to 16 segments per
cap, or the segment size the tier derives), so the tier evicts all the time; every life
ends with a graceful close (sometimes with jobs in flight) and the next one reopens the
root. It follows the events (``enable_events``) as a router would, and checks, besides
the above:

* the close's result (what ``aclose()`` returns) names every block the CPU tier held
  and the NVMe tier did not, unless a removal event of the close said that the NVMe
  tier took it and evicted it again;
* every block whose store succeeded is held by some medium by the events, or a removal
  event named it;
* every block the events say the NVMe tier holds after the close is found after the
  reopen and loads byte-exact.

Short in CI: ``KVT_SOAK_SEEDS`` seeds (default 8) from ``KVT_SOAK_FIRST_SEED``
(default 0), ``KVT_SOAK_SMALL_CAPS_SEEDS`` small-caps seeds (default 4),
``KVT_SOAK_LIVES`` lives (default 3) of ``KVT_SOAK_ROUNDS`` rounds (default 10) each.
Long on demand, e.g.::

    KVT_SOAK_SEEDS=500 KVT_SOAK_ROUNDS=40 python3 -m pytest -q tests/test_engine_soak.py

A failure names its seed; rerun it alone with ``KVT_SOAK_FIRST_SEED=<seed>
KVT_SOAK_SEEDS=1``. Each seed's choices come from one ``random.Random(seed)``; the
interleaving of concurrent jobs is up to the loop, so a rerun is close, not identical.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from backends.nvme.segments import align_up
from tests._engine_helpers import (
    DEVICE_BLOCKS,
    block_copies,
    flip_byte,
    h,
    holds,
    make_kv,
    nvme_spec,
    put,
    result_of,
    settle,
    spin,
    wipe,
)
from tests._faults import FaultInjector
from tiering import Job, JobResult, TieringEngine, tenant_keys
from tiering.device.kv_layout import kv_block_bytes
from tiering.tiers.block_record import HEADER_BYTES

SEEDS = int(os.environ.get("KVT_SOAK_SEEDS", "8"))
FIRST_SEED = int(os.environ.get("KVT_SOAK_FIRST_SEED", "0"))
LIVES = int(os.environ.get("KVT_SOAK_LIVES", "3"))
ROUNDS = int(os.environ.get("KVT_SOAK_ROUNDS", "10"))
SMALL_CAPS_SEEDS = int(os.environ.get("KVT_SOAK_SMALL_CAPS_SEEDS", "4"))
KEYS = 24
BLOCK_BYTES = 512  # of make_kv's cache
SOAK_KEYRING = "1:" + base64.b64encode(bytes(range(32))).decode()


@dataclass
class _Config:
    write_policy: str
    policy: str
    cpu_blocks: int
    memory_blocks: int | None
    nvme: bool
    nvme_tier: str  # the registered name of the NVMe tier
    tenants: tuple[str | None, ...]  # each job names one of these
    encrypted: bool  # the NVMe tier seals its blocks
    # Blocks stored between the NVMe tier's checkpoints (None: its default): small, so
    # checkpoints are written while other store jobs are in flight.
    checkpoint_every: int | None = None
    # Small caps: the NVMe tier's cap and segment size in records (None: the tier's
    # defaults), every life closes gracefully, and events are followed (see _Soak).
    nvme_records: int | None = None
    segment_records: int | None = None
    # What the engine writes to the memory tier: a rule, and a budget in blocks a second
    # (None: unbounded). The NVMe tier takes every block: a block its rule refused would
    # be in no tier after the close, and the durability checks count on it.
    admission: str = "all"
    budget_blocks: float | None = None

    @property
    def small_caps(self) -> bool:
        return self.nvme_records is not None

    @classmethod
    def draw(cls, rng: random.Random) -> _Config:
        tiers = rng.choice(["memory", "nvme", "both", "both"])
        return cls(
            write_policy=rng.choice(["write_through", "write_back"]),
            policy=rng.choice(["lru", "arc", "s3fifo"]),
            cpu_blocks=rng.randint(2, 6),
            memory_blocks=rng.randint(3, 12) if tiers != "nvme" else None,
            nvme=tiers != "memory",
            nvme_tier="nvme",
            tenants=rng.choice([(None,), (None, "t1", "t2")]),
            encrypted=tiers != "memory" and rng.random() < 0.5,
            checkpoint_every=rng.choice([1, 2, 3, None]),
            admission=rng.choice(["all", "all", "seen-twice", "adaptive"]),
            budget_blocks=rng.choice([None, None, 0.5, 20.0]),
        )

    def admits(self) -> dict[str, Any]:
        """The memory tier's admission options in this configuration."""
        options: dict[str, Any] = {"admission": self.admission}
        if self.budget_blocks is not None:
            options["write_budget"] = max(1, round(self.budget_blocks * BLOCK_BYTES))
        return options

    @classmethod
    def draw_small_caps(cls, rng: random.Random) -> _Config:
        """A segment tier under write-back whose cap holds fewer blocks than the soak's
        keys, so that it evicts: 2 to 16 segments per cap, or the segment size the
        tier derives from the cap."""
        nvme_records = rng.randint(8, 20)
        per_cap = rng.choice([None, 2, 4, 16])
        return cls(
            write_policy="write_back",
            policy=rng.choice(["lru", "arc", "s3fifo"]),
            cpu_blocks=rng.randint(2, 16),
            memory_blocks=rng.randint(3, 12) if rng.random() < 0.3 else None,
            nvme=True,
            nvme_tier="nvme",
            tenants=rng.choice([(None,), (None, "t1", "t2")]),
            encrypted=rng.random() < 0.3,
            checkpoint_every=rng.choice([1, 2, 3, None]),
            nvme_records=nvme_records,
            segment_records=None if per_cap is None else max(1, nvme_records // per_cap),
        )


@dataclass(frozen=True)
class _Issued:
    """One job as the soak issued it: its kind, handle, the caller's hashes, device
    block ids and tenant."""

    kind: str
    job: Job
    keys: list[bytes]
    ids: list[int]
    tenant: str | None


@dataclass
class _Life:
    """What one engine life issued and saw."""

    jobs: list[_Issued] = field(default_factory=list)
    finished: Counter[int] = field(default_factory=Counter)
    stored_ok: set[tuple[str | None, bytes]] = field(default_factory=set)  # (tenant, key)
    damaged: bool = False
    flipped: list[tuple[Path, int, int, int]] = field(default_factory=list)
    # Small caps: the keys each medium holds by the events so far, as a router that
    # applies them in order sees it.
    held: dict[str, set[bytes]] = field(default_factory=dict)
    removed: set[bytes] = field(default_factory=set)  # named by a removal event
    closed: bool = False  # events from now on happened during the close
    removed_by_close: set[bytes] = field(default_factory=set)  # from the NVMe tier


class _Soak:
    def __init__(self, seed: int, root: Path, *, small_caps: bool = False) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.root = root
        self.config = _Config.draw_small_caps(self.rng) if small_caps else _Config.draw(self.rng)
        self.kv = make_kv(seed)
        self.keys = [h(1000 * (seed + 1) + i) for i in range(KEYS)]
        # (tenant, key) by the key its blocks live under in every tier (and in events).
        self.owner_of = {
            scoped: (tenant, key)
            for tenant in self.config.tenants
            for key, scoped in zip(self.keys, tenant_keys(self.keys, tenant), strict=True)
        }
        self.must_survive: set[tuple[str | None, bytes]] = set()
        self.loads_landed = 0
        self.jobs = 0
        self.survivors_checked = 0
        self.recent: set[tuple[str | None, bytes]] = set()

    def _engine(self, faults: FaultInjector) -> TieringEngine:
        tiers: list[Any] = []
        if self.config.memory_blocks is not None:
            memory = {"type": "memory", "max_blocks": self.config.memory_blocks}
            tiers.append(memory | self.config.admits())
        if self.config.nvme:
            tier = self.config.nvme_tier
            options: dict[str, Any] = {"encryption": SOAK_KEYRING} if self.config.encrypted else {}
            if self.config.checkpoint_every is not None:
                options["checkpoint_every"] = self.config.checkpoint_every
            if self.config.nvme_records is not None:
                record = HEADER_BYTES + align_up(kv_block_bytes(self.kv))
                options["capacity_bytes"] = self.config.nvme_records * record
                if self.config.segment_records is not None:
                    options["segment_bytes"] = HEADER_BYTES + self.config.segment_records * record
            tiers.append(nvme_spec(self.root, faults, tier=tier, enospc_retry_s=0.01, **options))
        return TieringEngine(
            self.kv,
            self.config.cpu_blocks,
            policy=self.config.policy,
            secondary_tiers=tiers,
            write_policy=self.config.write_policy,
            enable_events=self.config.nvme,
        )

    async def run(self) -> None:
        for life_no in range(LIVES):
            await self._life(life_no)
        assert self.loads_landed > 0, "no load landed: the soak checked nothing"
        print(
            f"soak seed {self.seed}: {self.jobs} jobs, {self.loads_landed} loaded blocks "
            f"checked, {self.survivors_checked} blocks checked after a reopen ({self.config})"
        )

    # ------------------------------------------------------------------ one life

    async def _life(self, life_no: int) -> None:
        rng = self.rng
        faults = FaultInjector()
        engine = self._engine(faults)
        life = _Life()
        # Small caps: blocks must survive every close, so no damaging faults.
        faulty = rng.random() < 0.4 and not self.config.small_caps
        await engine.__aenter__()
        try:
            if self.config.nvme:
                self._follow_events(engine, life)
            await self._check_survivors(engine, life)
            for _ in range(ROUNDS):
                if faulty and rng.random() < 0.3:
                    self._inject(faults, life)
                if rng.random() < 0.2:
                    faults.delay(rng.choice(["pwritev", "preadv"]), 0.002, times=rng.randint(1, 4))
                await self._round(engine, life)
                await settle(engine)
                self._drain(engine, life)
            graceful = rng.random() < 0.75 or self.config.small_caps
            if not graceful and rng.random() < 0.5:  # writes in flight overlap longer
                faults.delay("pwritev", 0.003, times=rng.randint(1, 3))
            in_flight = []
            if not graceful or rng.random() < 0.5:
                in_flight = self._issue_some(engine, life)
            if not graceful:  # a hard stop at a random point of the jobs' lives
                await asyncio.sleep(rng.choice([0, 0.001, 0.005, 0.02]))
                self._drain(engine, life)
        except BaseException:
            engine.close()
            faults.clear()
            with contextlib.suppress(Exception):
                await engine.aclose()
            raise
        closed: JobResult | None = None
        if graceful:
            closed = await engine.aclose()
        else:
            engine.close()
            faults.clear()  # a hard stop must not wait on a slowed call
            await engine.aclose()
        faults.clear()
        life.closed = True
        for issued in in_flight:
            await self._check(issued, life)
        with contextlib.suppress(Exception):
            self._drain(engine, life)
        self._check_results(life)
        self._restore_flips(life)
        if self.config.small_caps:
            self.must_survive = self._survivors_by_events(life, closed)
        elif not self.config.nvme or life.damaged:
            self.must_survive = set()
        elif graceful:
            self.must_survive = set(life.stored_ok)
        else:  # a hard stop: what the NVMe tier had stored, by its events, is all there
            self.must_survive = {self.owner_of[key] for key in life.held.get("NVME", set())}

    def _follow_events(self, engine: TieringEngine, life: _Life) -> None:
        """Start following events: the reopened NVMe tier holds what lookup finds
        (nothing is in the CPU or a memory tier yet); later events change that."""
        held = {
            scoped for scoped, (t, key) in self.owner_of.items() if engine.lookup([key], tenant=t)
        }
        life.held = {"NVME": held}

    def _survivors_by_events(
        self, life: _Life, closed: JobResult | None
    ) -> set[tuple[str | None, bytes]]:
        """After a graceful close, checked against the events as a router sees them.

        The CPU tier's blocks that the NVMe tier does not hold are gone with the close:
        each was either taken by the NVMe tier and evicted again during the close (a
        removal event), or is named by the close's result. Every block whose store
        succeeded is held by a medium or was named by a removal event. Returns what the
        NVMe tier holds by the events: all of it must be there after the reopen."""
        assert isinstance(closed, JobResult), f"seed {self.seed}: aclose() returned {closed!r}"
        nvme, cpu = life.held.get("NVME", set()), life.held.get("CPU", set())
        unnamed = cpu - nvme - life.removed_by_close - set(closed.failed_keys)
        assert not unnamed, (
            f"seed {self.seed}: the close lost {len(unnamed)} block(s) without naming them: "
            f"{closed} ({self.config})"
        )
        assert closed.success == (not closed.failed_keys), f"seed {self.seed}: {closed}"
        for tenant, key in life.stored_ok:
            scoped = tenant_keys([key], tenant)[0]
            where = [medium for medium, keys in life.held.items() if scoped in keys]
            assert where or scoped in life.removed, (
                f"seed {self.seed}: {key.hex()} of tenant {tenant} stored with success, "
                f"then gone from every medium with no removal event ({self.config})"
            )
        return {self.owner_of[scoped] for scoped in nvme}

    async def _check_survivors(self, engine: TieringEngine, life: _Life) -> None:
        """The previous life closed gracefully and cleanly: its stores are all here."""
        for tenant in self.config.tenants:
            keys = sorted(k for t, k in self.must_survive if t == tenant)
            for key in keys:
                assert engine.lookup([key], tenant=tenant) == 1, (
                    f"seed {self.seed}: {key.hex()} of tenant {tenant} lost by a close"
                )
            self.survivors_checked += len(keys)
            for start in range(0, len(keys), self.config.cpu_blocks):
                chunk = keys[start : start + self.config.cpu_blocks]
                ids = list(range(len(chunk)))
                wipe(self.kv, ids)
                result = await engine.load(chunk, ids, tenant=tenant)
                assert result.success, f"seed {self.seed}: survivors failed to load: {result}"
                held = engine.tenant_keys(chunk, tenant)
                for key, i in zip(held, ids, strict=True):
                    assert holds(self.kv, key, i), (
                        f"seed {self.seed}: {key.hex()} wrong after reopen"
                    )
                self.loads_landed += 1
                await settle(engine)
        engine.get_finished()

    # ---------------------------------------------------------------- one round

    async def _round(self, engine: TieringEngine, life: _Life) -> None:
        rng = self.rng
        jobs = self._issue_some(engine, life)
        awaiters = []
        for issued in jobs:
            if rng.random() < 0.3:
                awaiters.append(asyncio.create_task(result_of(issued.job)))
        flushing = None
        if rng.random() < 0.25:
            flushing = asyncio.create_task(self._flush(engine))
        if rng.random() < 0.2:
            engine.touch(rng.sample(self.keys, 3), tenant=rng.choice(self.config.tenants))
        await spin(rng.randint(0, 6))
        for task in awaiters:
            task.cancel()
        for task in awaiters:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for issued in jobs:
            await self._check(issued, life)
        if flushing is not None:
            await flushing

    def _issue_some(self, engine: TieringEngine, life: _Life) -> list[_Issued]:
        rng = self.rng
        free = list(range(DEVICE_BLOCKS))
        rng.shuffle(free)
        issued = []
        for _ in range(rng.randint(1, 4)):
            size = rng.randint(1, min(3, self.config.cpu_blocks))
            keys = list(dict.fromkeys(rng.choice(self.keys) for _ in range(size)))
            tenant = rng.choice(self.config.tenants)
            if rng.random() < 0.45:
                ids = [free.pop() for _ in keys]
                # A tenant's block holds the bytes of its tenant key: a load served from
                # another tenant's block would hold other bytes.
                put(self.kv, engine.tenant_keys(keys, tenant), ids)
                entry = _Issued("store", engine.store(keys, ids, tenant=tenant), keys, ids, tenant)
            else:
                mine = sorted(k for t, k in self.recent if t == tenant)
                if mine and rng.random() < 0.7:  # mostly keys likely to be held
                    keys = list(dict.fromkeys(rng.choice(mine) for _ in range(size)))
                keys = keys[: engine.lookup(keys, tenant=tenant)]
                if not keys:
                    continue
                ids = [free.pop() for _ in keys]
                wipe(self.kv, ids)
                entry = _Issued("load", engine.load(keys, ids, tenant=tenant), keys, ids, tenant)
            issued.append(entry)
            life.jobs.append(entry)
            self.jobs += 1
        return issued

    async def _check(self, issued: _Issued, life: _Life) -> None:
        kind, job, keys, ids, tenant = (
            issued.kind,
            issued.job,
            issued.keys,
            issued.ids,
            issued.tenant,
        )
        result = await job
        assert isinstance(result, JobResult) and result.job_id == job.job_id
        assert result.success == (not result.failed_keys), f"seed {self.seed}: {result}"
        assert result.success == (result.error is None), f"seed {self.seed}: {result}"
        assert set(result.failed_keys) <= set(keys), f"seed {self.seed}: {result} names other keys"
        if kind == "store":
            if result.success:
                life.stored_ok.update((tenant, key) for key in keys)
                self.recent.update((tenant, key) for key in keys)
            return
        held = self._held(keys, tenant)
        for key, mine, i in zip(keys, held, ids, strict=True):
            if key not in result.failed_keys:
                assert holds(self.kv, mine, i), (
                    f"seed {self.seed}: load job {job.job_id} reported {key.hex()} landed "
                    f"but device block {i} holds other bytes ({self.config})"
                )
                self.loads_landed += 1

    def _held(self, keys: list[bytes], tenant: str | None) -> list[bytes]:
        """The keys ``tenant``'s blocks live under, whose bytes they hold."""
        return tenant_keys(keys, tenant)

    async def _flush(self, engine: TieringEngine) -> None:
        bound = self.rng.choice([None, 0.0, 0.001, 0.01])
        if bound is None:
            assert isinstance(await engine.flush(), bool)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(engine.flush(), bound)

    def _drain(self, engine: TieringEngine, life: _Life) -> None:
        for result in engine.get_finished():
            life.finished[result.job_id] += 1
        if self.config.nvme:
            for event in engine.take_events():
                held = life.held.setdefault(event.medium, set())
                if event.removed:
                    held.difference_update(event.block_hashes)
                    life.removed.update(event.block_hashes)
                    if life.closed and event.medium == "NVME":
                        life.removed_by_close.update(event.block_hashes)
                else:
                    held.update(event.block_hashes)

    def _check_results(self, life: _Life) -> None:
        for issued in life.jobs:
            assert issued.job.done(), f"seed {self.seed}: job {issued.job.job_id} never finished"
        ids = {issued.job.job_id for issued in life.jobs}
        for job_id in ids:
            assert life.finished[job_id] == 1, (
                f"seed {self.seed}: job {job_id} appeared {life.finished[job_id]} times "
                "in get_finished()"
            )

    # ------------------------------------------------------------------ faults

    def _inject(self, faults: FaultInjector, life: _Life) -> None:
        rng = self.rng
        choice = rng.choice(["eio-read", "flip", "enospc"] if self.config.nvme else ["none"])
        if choice == "eio-read":
            faults.fail("preadv", errno.EIO, times=rng.randint(1, 2))
        elif choice == "enospc":
            faults.fail("pwritev", errno.ENOSPC, times=rng.randint(1, 3))
        elif choice == "flip":
            copies = [copy for found in block_copies(self.root).values() for copy in found]
            if not copies:
                return
            path, offset, length = rng.choice(copies)
            position = offset + length - 1 - rng.randrange(min(64, length))
            try:
                flipped, original = flip_byte(path, position)
            except FileNotFoundError:
                return
            life.flipped.append((path, position, flipped, original))
        else:
            return
        life.damaged = True

    def _restore_flips(self, life: _Life) -> None:
        for path, position, flipped, original in reversed(life.flipped):
            with contextlib.suppress(FileNotFoundError), open(path, "r+b") as file:
                file.seek(position)
                if file.read(1) == bytes([flipped]):  # still the copy that was flipped
                    file.seek(position)
                    file.write(bytes([original]))


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SEEDS))
async def test_soak(seed: int, tmp_path: Path) -> None:
    await _Soak(seed, tmp_path).run()


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SMALL_CAPS_SEEDS))
async def test_soak_small_caps_write_back(seed: int, tmp_path: Path) -> None:
    await _Soak(seed, tmp_path, small_caps=True).run()
