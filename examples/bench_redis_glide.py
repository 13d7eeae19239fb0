"""Measure valkey-glide, a candidate client for the Redis tier (issue 29), against the
plain pipelined redis-py loop that ``bench_redis.py`` uses as its baseline.

Usage (valkey-glide is no dependency of kv-tiering: it pins its own protobuf, so it
goes in a virtual environment of its own)::

    python3 -m venv /tmp/glide && /tmp/glide/bin/pip install valkey-glide 'redis[hiredis]'
    /tmp/glide/bin/python examples/bench_redis_glide.py [--block-sizes 128K,2M] [--repeat 5]

It starts the tests' own ``redis-server`` (tests/_redis_servers.py) on a free port and
runs, for each block size, ``--repeat`` rounds in which the two sides take turns going
first, each starting with none of the run's keys on the server (every key of a run
carries a random token of it; before each side and at the end, the keys of that token,
and no others, are deleted with ``SCAN ... MATCH`` and ``UNLINK``): store
``--size-mib`` MiB in jobs of 8 values, 4 jobs at once (one non-atomic batch or
pipeline per job), then load them back into a preallocated buffer (``slot[:] =
value``: both clients return each value as new ``bytes``). Every loaded byte is
compared after the timed part. glide copies a memoryview argument into ``bytes`` inside
``exec``; its values are made ``bytes`` before the timed part, so that copy is not
counted against it. Prints a line per block size and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as redis_asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
# Test aids, from the checkout: the local server, and the deletion of a run's keys.
from _redis_servers import LocalRedisServer, unlink_matching

JOB_BLOCKS, CONCURRENCY = 8, 4
TIMEOUT_MS = 120_000  # glide's default of 250 ms is short for a batch of 8 x 2 MiB


async def _jobs(count: int, run) -> float:
    """Seconds to run ``run(indexes)`` over ``range(count)`` in jobs, 4 at once."""
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(first: int) -> None:
        async with limit:
            await run(range(first, min(count, first + JOB_BLOCKS)))

    start = time.perf_counter()
    await asyncio.gather(*(one(first) for first in range(0, count, JOB_BLOCKS)))
    return time.perf_counter() - start


async def glide_round(client, prefix: str, values: list[bytes], slots: list[memoryview]):
    from glide import Batch, BatchOptions

    options = BatchOptions(timeout=TIMEOUT_MS)
    keys = [f"{prefix}glide-{i}" for i in range(len(values))]

    async def store(indexes: range) -> None:
        batch = Batch(is_atomic=False)
        for i in indexes:
            batch.set(keys[i], values[i])
        await client.exec(batch, raise_on_error=True, options=options)

    async def load(indexes: range) -> None:
        batch = Batch(is_atomic=False)
        for i in indexes:
            batch.get(keys[i])
        got = await client.exec(batch, raise_on_error=True, options=options)
        for i, value in zip(indexes, got, strict=True):
            slots[i][:] = value

    return await _jobs(len(values), store), await _jobs(len(values), load)


async def redis_py_round(client, prefix: str, values: list[memoryview], slots: list[memoryview]):
    keys = [f"{prefix}redis-py-{i}" for i in range(len(values))]

    async def store(indexes: range) -> None:
        async with client.pipeline(transaction=False) as pipe:
            for i in indexes:
                pipe.set(keys[i], values[i])
            await pipe.execute()

    async def load(indexes: range) -> None:
        async with client.pipeline(transaction=False) as pipe:
            for i in indexes:
                pipe.get(keys[i])
            for i, value in zip(indexes, await pipe.execute(), strict=True):
                slots[i][:] = value

    return await _jobs(len(values), store), await _jobs(len(values), load)


async def run(port: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The rounds the module docstring describes, on the server at ``127.0.0.1:port``
    (database 0); the figures by block size. Deletes the keys it wrote, and no other."""
    from glide import GlideClient, GlideClientConfiguration, NodeAddress

    url = f"redis://127.0.0.1:{port}/0"
    prefix = f"bench-glide:{secrets.token_hex(8)}:"  # every key of this run, and only they

    async def fresh_start() -> None:
        await asyncio.to_thread(unlink_matching, url, prefix.encode() + b"*")

    nbytes = args.size_mib << 20
    source, target = bytearray(os.urandom(nbytes)), bytearray(nbytes)
    glide = await GlideClient.create(
        GlideClientConfiguration([NodeAddress("127.0.0.1", port)], request_timeout=TIMEOUT_MS)
    )
    plain = redis_asyncio.Redis(port=port, max_connections=CONCURRENCY)
    figures: dict[str, dict[str, float]] = {}
    try:
        for size in args.block_sizes:
            count = nbytes // size
            views = [memoryview(source)[i * size : (i + 1) * size] for i in range(count)]
            values = [bytes(view) for view in views]  # glide would copy them in exec
            slots = [memoryview(target)[i * size : (i + 1) * size] for i in range(count)]
            rates: dict[str, list[tuple[float, float]]] = {"glide": [], "redis-py": []}
            for round_ in range(args.repeat):
                for side in ("glide", "redis-py")[:: 1 if round_ % 2 == 0 else -1]:
                    await fresh_start()
                    target[:] = bytes(nbytes)
                    if side == "glide":
                        seconds = await glide_round(glide, prefix, values, slots)
                    else:
                        seconds = await redis_py_round(plain, prefix, views, slots)
                    if target != source:
                        raise SystemExit(f"{side}: the loaded bytes differ from the stored")
                    rates[side].append((nbytes / seconds[0] / 1e9, nbytes / seconds[1] / 1e9))
            del views, slots
            median = statistics.median
            g, r = rates["glide"], rates["redis-py"]
            figures[f"{size >> 10}K"] = row = {
                "glide_store_GBps": round(median(x[0] for x in g), 3),
                "glide_load_GBps": round(median(x[1] for x in g), 3),
                "redis_py_store_GBps": round(median(x[0] for x in r), 3),
                "redis_py_load_GBps": round(median(x[1] for x in r), 3),
                "store_ratio": round(median(a[0] / b[0] for a, b in zip(g, r, strict=True)), 3),
                "load_ratio": round(median(a[1] / b[1] for a, b in zip(g, r, strict=True)), 3),
            }
            print(f"{size >> 10} KiB blocks (medians of {args.repeat}): glide ÷ redis-py "
                  f"store {row['store_ratio']}x, load {row['load_ratio']}x; {row}")  # fmt: skip
    finally:
        await glide.close()
        await plain.aclose()
        await fresh_start()
    return figures


def _sizes(text: str) -> list[int]:
    units = {"K": 1 << 10, "M": 1 << 20}
    try:
        sizes = [int(part[:-1]) * units[part[-1]] for part in text.upper().split(",")]
    except (KeyError, ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"sizes like 128K,2M, got {text!r}") from None
    if min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--block-sizes", type=_sizes, default="128K,2M", help="value sizes (default: %(default)s)"
    )
    parser.add_argument(
        "--size-mib", type=int, default=256, help="MiB stored a round (default: %(default)s)"
    )
    parser.add_argument(
        "--repeat", type=int, default=5, help="rounds of each side (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    if args.size_mib <= 0 or args.repeat <= 0:
        parser.error("argument --size-mib and --repeat: must be positive")
    return args


def main() -> None:
    args = parse_args()
    try:
        import glide  # noqa: F401
    except ImportError:
        raise SystemExit(
            "bench_redis_glide needs valkey-glide (in a venv of its own: see --help)"
        ) from None
    with tempfile.TemporaryDirectory(prefix="bench-glide-") as directory:
        server = LocalRedisServer(Path(directory))
        server.start()
        try:
            figures = asyncio.run(run(server.port, args))
        finally:
            server.stop()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
