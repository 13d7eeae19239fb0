"""A remote tier on Redis or Valkey: one cache shared by every serving machine
(docs/redis.md). Each block is one Redis string (so one slot of a cluster)::

    key:    b"kvt:2:" + namespace digest (hex) + b":" + tenant + b":" + block hash
    value:  the block record's compact header (:mod:`tiering.tiers.block_record`), then
            the payload, or with ``encryption`` its AES-GCM ciphertext

(blocks of the earlier format, under ``kvt:<digest>:...``, are never read). A job's
bytes move on the tier's own connections (:mod:`.streams`), the control calls through
redis-py (:mod:`.control`). No call is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from backends.breaker import BreakerState, CircuitBreaker
from backends.redis.control import (
    CLIENT_ERRORS,
    UNREACHABLE,
    AuthenticationError,
    ClientError,
    LazyClient,
    RedisCluster,
    ResponseError,
    detached,
    round_trip,
)
from backends.redis.jobs import CORRUPT, MISSING, REFUSED, JobShape, LoadJob, StoreJob
from backends.redis.options import RedisOptions
from backends.redis.streams import Link, Streams
from tiering.errors import ClosedError, InvalidArgumentError
from tiering.lifecycle import running_loop
from tiering.security.encryption import BlockCipher, Keyring, keyring_from
from tiering.tiers.actor import TierActor
from tiering.tiers.block_record import namespace_digest
from tiering.tiers.tier_api import JobMetadata, JobResult, OffloadKey, ReqContext
from tiering.validation import check_offload_key

logger = logging.getLogger(__name__)


def namespace_prefix(namespace: str) -> bytes:
    """How every Redis key of a block of ``namespace`` starts, whatever its tenant."""
    return b"kvt:2:" + namespace_digest(namespace).hex().encode() + b":"


class RedisTier(TierActor):
    """A secondary tier on a Redis (or Valkey) server, shared by many engines; its
    options are :class:`RedisOptions`.

    Guarantees: a load serves a block only if it verifies (a value that does not, or is
    no string, is a failed key, deleted and never served); a key the server refuses
    fails alone; a connection failure fails the job's keys (never the engine), within
    about ``timeout_s``; ``lookup`` never blocks. Key material never shows in ``repr``,
    statistics, errors or logs.
    """

    Options = RedisOptions

    def __init__(
        self,
        primary_kv_view: memoryview,
        block_bytes: int,
        options: RedisOptions | None = None,
        /,
        **values: Any,
    ) -> None:
        """Takes a :class:`RedisOptions`, keywords, or both (keywords win). Raises
        InvalidArgumentError naming a bad view, size or option (never showing the url
        or the keys)."""
        o = self.options = RedisOptions.check({**dict(options or {}), **values}, owner="RedisTier")
        keyring = keyring_from(o.encryption, option="encryption")
        self._cipher = None if keyring is None else BlockCipher(keyring)
        self.breaker = CircuitBreaker(o)
        super().__init__(primary_kv_view, block_bytes, **o.actor_options())
        tenant, digest = o.tenant.encode(), namespace_digest(o.namespace)
        self._prefix = namespace_prefix(o.namespace) + tenant + b":"
        self._client = LazyClient(functools.partial(o.client, cluster=o.cluster))
        self._shape = JobShape(
            pool=self.primary_kv_view,
            block_bytes=block_bytes,
            prefix=self._prefix,
            # What every record of this tier is written with and checked against.
            record=dict(tenant=tenant, payload_bytes=block_bytes, ns_digest=digest),
            cipher=self._cipher,
            per_pipeline=max(1, o.pipeline_bytes // block_bytes),
            expiry=() if o.ttl_s is None else ("EX", max(1, round(o.ttl_s))),
            delete=self._client.delete,
        )
        self._streams: Streams | None = None  # made at start
        self._serving = False  # from start until close
        # key -> (present, trusted until): a bounded LRU of recent answers
        self._presence: OrderedDict[OffloadKey, tuple[bool, float]] = OrderedDict()
        self._known_present = 0  # its present answers, kept as they change: no scan
        self._to_check: dict[OffloadKey, None] = {}  # queued for the next batched check
        self._in_check: set[OffloadKey] = set()  # in the check on the wire now
        self._checking = False
        # The server's INFO memory, read every usage_every_s (0 until then); its DBSIZE
        # is counters["server_keys"].
        self._server_usage = {"used_bytes": 0, "capacity_bytes": 0}
        self._counters = dict.fromkeys(
            ("stored_blocks", "loaded_blocks", "corrupt_blocks", "missing_blocks",
             "unreachable_calls", "lookup_round_trips", "pipelines", "server_keys"),
            0,
        )  # fmt: skip

    async def start(self) -> None:
        """Connect and start serving; a server that does not answer within ``timeout_s``
        only opens the breaker. Raises InvalidArgumentError, leaving nothing running, if
        a ``tls_*`` file does not load, the server refuses the url's credentials (never
        quoting the password) or its certificate (naming ``tls_ca_file``), or it is (not)
        a cluster node against ``cluster``."""
        self._serving = True
        error = await self.run_blocking(self._hello)
        if isinstance(error, InvalidArgumentError):
            self.shutdown()  # closed at once (nothing runs): the client is dropped
            raise error
        if error is not None:
            self._unreachable("ping", error)
        else:
            self.breaker.succeeded()
        await super().start()
        self.spawn(self._watch_usage(), name="usage")

    def _on_closed(self) -> None:
        self._serving = False
        if self._streams is not None:
            self._streams.close()
        self._client.close()

    @staticmethod
    def get_tier_type() -> str:
        return "redis"

    def lookup(self, key: OffloadKey, req_context: ReqContext = None) -> bool | None:
        """False while the breaker is not closed (open, or half-open with its probe
        out) or the tier is closed, whatever the cache holds; else True/False from a
        fresh cached answer, or None (ask again) with the key queued for the next
        batched check. InvalidArgumentError unless ``key`` is bytes."""
        check_offload_key(key)
        # A load now fails at once (or is the probe): a cached True would only send the
        # engine to a miss.
        if self.breaker.state is not BreakerState.CLOSED or self.closed:
            return False
        if self.storing(key):
            return None
        entry = self._presence.get(key)
        if entry is not None and entry[1] > time.monotonic():
            return entry[0]
        if key not in self._in_check:
            self._to_check[key] = None
            self._schedule_check()
        return None

    def get_num_blocks(self) -> int:
        """Blocks this tier knows to be on the server (its presence cache); the server
        may hold more, stored by other engines."""
        return self._known_present

    def _usage(self) -> dict[str, Any]:
        """The server's memory in use, ``maxmemory`` (0: no limit) and key count
        (``counters["server_keys"]``), as last read."""
        counters = dict(self._counters)
        return {"used_blocks": self.get_num_blocks(), **self._server_usage, "counters": counters}

    @property
    def keyring(self) -> Keyring | None:
        """The keyring blocks are sealed and opened with (None: stored plain)."""
        return None if self._cipher is None else self._cipher.keyring

    def __repr__(self) -> str:
        o, sealed = self.options, "" if self._cipher is None else f" encryption={self.keyring!r}"
        return (
            f"<RedisTier {o.namespace!r} tenant={o.tenant!r} breaker={self.breaker.state}"
            f"{sealed} {self.statistics()!r}>"
        )

    # -- jobs: decided on the loop, carried by a stream -------------------------------

    async def _hand_over(self, job: JobMetadata, what: str) -> JobResult:
        """Hand ``job`` to a stream (unless the breaker refuses it) and await its result,
        decided on the loop once the stream delivers its outcome. ClosedError once closed."""
        streams = self._streams
        if streams is None or not self._serving or not self.breaker.allow():
            return self._account(job, what, None)
        done: asyncio.Future[JobResult] = asyncio.get_running_loop().create_future()
        kind = StoreJob if what == "store" else LoadJob
        plan = functools.partial(kind, self._shape, list(job.keys), list(job.block_ids))
        try:
            call = streams.submit(plan, functools.partial(self._settle, done, job, what))
        except RuntimeError as exc:
            raise ClosedError("the redis tier is closed") from exc
        return await self.wait_call(call, done)

    _do_store = functools.partialmethod(_hand_over, what="store")
    _do_load = functools.partialmethod(_hand_over, what="load")

    def _settle(
        self, done: asyncio.Future[JobResult], job: JobMetadata, what: str, outcome: Any
    ) -> None:
        # On the stream's thread: ``done`` is resolved on the loop.
        def settled() -> None:
            if isinstance(outcome, BaseException) and not isinstance(outcome, CLIENT_ERRORS):
                if not done.done():
                    done.set_exception(outcome)
                return
            result = self._account(job, what, outcome)
            if not done.done():
                done.set_result(result)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            done.get_loop().call_soon_threadsafe(settled)

    def _account(
        self, job: JobMetadata, what: str, outcome: dict[bytes, str] | ClientError | None
    ) -> JobResult:
        """``job``'s result from its outcome (the failed keys with why; the client's
        error; None: the breaker refused it), told to the cache, breaker and counters."""
        keys = list(job.keys)
        if not isinstance(outcome, dict):
            for key in keys:  # whatever the server holds now, the cache no longer knows
                self._forget(key)
            if outcome is None:
                reason = "redis unreachable: circuit open, retrying later"
                self._failures.record("redis unreachable (circuit open)", len(keys))
            elif isinstance(outcome, UNREACHABLE):
                reason = f"redis unreachable: {outcome}"
                self._unreachable(what, outcome)
            else:
                reason = f"redis refused the {what}: {outcome}"
                self._failures.record(f"redis refused a {what}", len(keys), str(outcome))
            return JobResult(job.job_id, False, tuple(keys), reason)
        failed = outcome
        self.breaker.succeeded()
        refusals: list[str] = []
        absent: list[OffloadKey] = []
        for key, why in failed.items():
            if why.startswith(REFUSED):
                self._forget(key)  # the server would not say: no answer kept
                refusals.append(why)
            else:  # absent, or corrupt and deleted
                absent.append(key)
                self._counters["corrupt_blocks"] += why.startswith(CORRUPT)
                self._counters["missing_blocks"] += why.startswith(MISSING)
        self._remember(absent, False)
        self._remember([key for key in keys if key not in failed], True)
        done = "stored_blocks" if what == "store" else "loaded_blocks"
        self._counters[done] += len(keys) - len(failed)
        self._counters["pipelines"] += self._shape.pipelines(keys)
        if refusals:
            self._failures.record(f"redis refused a block's {what}", len(refusals), refusals[0])
        if not failed:
            return JobResult(job.job_id, True)
        first = next(iter(failed.values()))
        return JobResult(job.job_id, False, tuple(failed), f"{len(failed)} keys failed: {first}")

    # -- on the pool's threads: a call returns the client's error rather than raising it
    # (a raised error's traceback would keep its frames, and the views they name, alive)

    def _hello(self) -> ClientError | InvalidArgumentError | None:
        """Make the streams, ping the server, check ``cluster`` and make the client.
        Returns the client's error, or an InvalidArgumentError if no call can succeed."""
        o = self.options
        try:
            endpoint = o.endpoint()
        except InvalidArgumentError as exc:
            return exc
        link = functools.partial(Link, endpoint, self._client if o.cluster else None)
        # One stream per I/O thread, sharing the jobs' window (at least 1 each): at most
        # max_inflight pipelines on the wire, as with a job per thread.
        self._streams = Streams(link, count=o.io_threads, window=self.max_inflight // o.io_threads)
        probe = o.client(cluster=False)
        try:
            probe.ping()
            enabled = bool(probe.info("cluster").get("cluster_enabled", 0))
            if enabled != o.cluster:
                said = "a Redis Cluster node" if enabled else "not a cluster node"
                return InvalidArgumentError(
                    f"cluster: the redis server is {said}, but the tier has cluster={not enabled}"
                )
            self._client.get()
        except AuthenticationError as exc:
            return InvalidArgumentError(f"url: the redis server refused its credentials ({exc})")
        except CLIENT_ERRORS as exc:
            if "certificate verify failed" not in str(exc).lower():
                return detached(exc)
            return InvalidArgumentError(
                "tls_ca_file: the redis server's certificate did not verify against "
                f"{o.tls_ca_file or 'the system CAs'!r} ({exc})"
            )
        finally:
            probe.close()
        return None

    def _usage_hop(self) -> dict[str, int] | ClientError:
        """The server's memory use, limit and key count (a cluster's primaries' sum)."""
        try:
            client = self._client.get()
            if isinstance(client, RedisCluster):
                nodes = client.info("memory", target_nodes=RedisCluster.PRIMARIES)
                keys = client.dbsize(target_nodes=RedisCluster.PRIMARIES)
                memory = list(nodes.values())
            else:
                memory, keys = [client.info("memory")], client.dbsize()
        except CLIENT_ERRORS as exc:
            return detached(exc)
        return {
            "used_bytes": sum(int(node.get("used_memory", 0)) for node in memory),
            "capacity_bytes": sum(int(node.get("maxmemory", 0)) for node in memory),
            "server_keys": int(keys),
        }

    def _exists_hop(self, keys: Sequence[bytes]) -> list[int | ResponseError]:
        return round_trip(self._client.get(), [("EXISTS", self._prefix + key) for key in keys])

    # -- presence cache and background tasks (loop thread) ----------------------------

    def _remember(self, keys: Sequence[OffloadKey], present: bool) -> None:
        """Cache what was just found of ``keys`` (dropping the answer for them of a
        check on the wire now, which may have read the server before)."""
        if not keys:
            return
        self._in_check.difference_update(keys)
        ttl = self.options.presence_ttl_s if present else self.options.absence_ttl_s
        entry = (present, time.monotonic() + ttl)
        presence, known = self._presence, self._known_present
        for key in keys:
            old = presence.pop(key, None)  # then put back last: the most recent
            known += present - (old is not None and old[0])
            presence[key] = entry
        while len(presence) > self.options.presence_entries:
            _, (dropped, _) = presence.popitem(last=False)
            known -= dropped
        self._known_present = known

    def _forget(self, key: OffloadKey) -> None:
        self._in_check.discard(key)
        old = self._presence.pop(key, None)
        if old is not None:
            self._known_present -= old[0]

    def _schedule_check(self) -> None:
        """Start the batched check on the loop (a lookup from another thread, as vLLM's
        scheduler's, hands the start over)."""
        if self._checking:
            return
        loop = self._loop
        if loop is not None and running_loop() is loop:
            self._checking = self.spawn(self._check_presence(), name="presence-check")
        elif loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._schedule_check)

    async def _check_presence(self) -> None:
        """Check every queued key, in pipelined batches (one round trip each)."""
        try:
            while self._to_check and self._serving and self.breaker.allow():
                batch = list(self._to_check)[:1000]  # keys per EXISTS pipeline
                for key in batch:
                    del self._to_check[key]
                self._in_check.update(batch)
                try:
                    found = await self.run_blocking(self._exists_hop, batch)
                except UNREACHABLE as exc:
                    self._unreachable("lookup", exc)
                    return
                except CLIENT_ERRORS as exc:
                    logger.debug("redis tier: presence check refused: %r", exc)
                    return
                self.breaker.succeeded()
                self._counters["lookup_round_trips"] += 1
                answers: dict[bool, list[OffloadKey]] = {True: [], False: []}
                for key, count in zip(batch, found, strict=True):
                    if key in self._in_check:  # else a store or load has answered since
                        # An error reply (the server would not say) reads as absent.
                        answers[isinstance(count, int) and count > 0].append(key)
                for present, keys in answers.items():
                    self._remember(keys, present)
        finally:
            self._checking = False
            self._in_check.clear()
            if self.breaker.state is not BreakerState.CLOSED:
                self._to_check.clear()  # lookups answer False until the server is back

    async def _watch_usage(self) -> None:
        """Read the server's usage every ``usage_every_s`` while the breaker is closed."""
        while self._serving:
            if self.breaker.state is BreakerState.CLOSED:
                usage = await self.run_blocking(self._usage_hop)
                if isinstance(usage, dict):
                    self._counters["server_keys"] = usage.pop("server_keys")
                    self._server_usage = usage
            await asyncio.sleep(self.options.usage_every_s)

    def _unreachable(self, what: str, exc: BaseException) -> None:
        self._counters["unreachable_calls"] += 1
        self.breaker.failed()
        self._failures.record(f"redis unreachable during {what}", 1, type(exc).__name__)
