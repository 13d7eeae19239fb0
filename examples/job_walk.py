"""Which of the project's modules one job passes through on its way to the bytes.

    python examples/job_walk.py [--redis URL]

It runs one ``engine.store()`` of a block down to its write on NVMe, and one load of a
block that only Redis holds (the CPU tier evicted it) down to its read from the
socket, under a profiler that follows every thread. For each it prints the order in
which modules of ``tiering`` and ``backends`` are entered by a call from another
module, up to the first system call that moves the block's bytes (``os.pwritev`` /
``os.preadv`` on NVMe, a socket send or receive for Redis); how many modules that
is; and how many of those entries go back into a module that is still on the calling
stack beneath (control going back and forth, a callback on the way down), and how many
times the trip goes back into a module it had left.

Without ``--redis`` it starts the tests' own ``redis-server`` (tests/_redis_servers.py).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from tiering.cli_args import make_parser, run_main

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' own redis-server starter
PACKAGES = (str(ROOT / "tiering"), str(ROOT / "backends"))
LAYERS, SHAPE = 2, (8, 2, 16, 8, 64)  # 8 device blocks of 32 KiB per layer


def module_of(frame: FrameType | None) -> str | None:
    """The project module a frame runs in (``tiering/engine.py``), or None."""
    if frame is None:
        return None
    name = frame.f_code.co_filename
    return str(Path(name).relative_to(ROOT)) if name.startswith(PACKAGES) else None


class Walk:
    """Profiles every thread started inside it (so: open it before the engine) while
    ``walking``, until a system call in ``until`` runs."""

    def __init__(self, until: set[str]) -> None:
        self.until = until
        self.entries: list[str] = []
        self.back_and_forth: list[str] = []
        self.walking = False
        self.done = False

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.done or not self.walking:
            return
        if event == "c_call" and getattr(arg, "__name__", "") in self.until:
            if any(module_of(f) for f in _stack(frame)):
                self.done = True
            return
        if event != "call":
            return
        here = module_of(frame)
        if here is None:
            return
        callers = [m for m in (module_of(f) for f in _stack(frame.f_back)) if m]
        if callers and callers[0] == here:
            return
        self.entries.append(here)
        if here in callers[1:]:
            self.back_and_forth.append(" -> ".join(reversed([here, *callers[:3]])))

    def __enter__(self) -> Walk:
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def stays(self) -> list[str]:
        """The modules in the order the trip is in them, a run of calls in one as one."""
        stays: list[str] = []
        for module in self.entries:
            if not stays or stays[-1] != module:
                stays.append(module)
        return stays

    def summary(self) -> dict[str, Any]:
        stays = self.stays()
        return {
            "modules": len(set(stays)),
            "returns_to_a_module_left": len(stays) - len(set(stays)),
            "reentries_on_stack": len(self.back_and_forth),
            "reached_io": self.done,
        }


def _stack(frame: FrameType | None) -> list[FrameType]:
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out


def show(name: str, walk: Walk) -> None:
    print(f"{name}: {walk.summary()}")
    print("  " + " -> ".join(walk.stays()))
    for chain in walk.back_and_forth:
        print(f"  back into a module on the stack: {chain}")


async def walk_nvme(root: Path) -> Walk:
    from tiering import TieringEngine

    kv = [torch.randn(SHAPE) for _ in range(LAYERS)]
    tier = {"type": "nvme", "root": str(root), "capacity_bytes": 64 << 20}
    with Walk({"pwritev", "pwrite", "write"}) as walk:
        async with TieringEngine(kv, 4, secondary_tiers=[tier]) as engine:
            job = engine.store([b"warm-up"], [0])
            await job
            await job.cascaded
            walk.walking = True
            job = engine.store([b"walked"], [1])
            await job
            await job.cascaded
            walk.walking = False
    return walk


async def walk_redis(url: str) -> Walk:
    from tiering import TieringEngine

    kv = [torch.randn(SHAPE) for _ in range(LAYERS)]
    tier = {"type": "redis", "url": url, "namespace": "job-walk"}
    with Walk({"recv_into", "recvmsg_into", "recv"}) as walk:
        async with TieringEngine(kv, 2, secondary_tiers=[tier]) as engine:
            await _fill(engine, walk)
    return walk


async def _fill(engine: Any, walk: Walk) -> None:
    for i in range(4):  # four blocks through a CPU tier of two: the first leave it
        job = engine.store([b"block-%d" % i], [i])
        await job
        await job.cascaded
    await engine.load([b"block-0"], [5])  # warm: connections made
    for i in range(2, 6):
        job = engine.store([b"block-%d" % (i + 10)], [i])
        await job
        await job.cascaded
    walk.walking = True
    await engine.load([b"block-1"], [7])
    walk.walking = False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The checked command line."""
    parser = make_parser(__doc__)
    parser.add_argument("--redis", metavar="URL", help="a redis-server (default: start one)")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        nvme = asyncio.run(walk_nvme(Path(scratch) / "nvme"))
        server = None
        url = args.redis
        if url is None:
            from _redis_servers import LocalRedisServer

            server = LocalRedisServer(Path(scratch))
            server.start()
            url = server.url
        try:
            redis = asyncio.run(walk_redis(url))
        finally:
            if server is not None:
                server.stop()
    show("engine.store() to bytes on NVMe", nvme)
    show("engine.load() of a block only Redis holds, to its bytes", redis)
    print(json.dumps({"nvme_store": nvme.summary(), "redis_load": redis.summary()}))
    return 0 if nvme.done and redis.done else 1


if __name__ == "__main__":
    run_main(main)
