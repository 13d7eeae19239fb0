"""A remote tier on Redis or Valkey: one cache shared by every serving machine
(docs/redis.md tells the whole story).

Each block is one Redis string (so one slot of a cluster)::

    key:    b"kvt:2:" + namespace digest (hex) + b":" + tenant + b":" + block hash
    value:  the block record's compact header (:mod:`tiering.tiers.block_record`), then
            the payload, or with ``encryption`` its AES-GCM ciphertext

A value that does not verify or is no string is a failed key, deleted and never served.
The ``2`` names this format: blocks of the earlier one (a hash per block, under
``kvt:<digest>:...``) are never read, so engines of both versions can share a server
while they age out. A job's pipelines (:mod:`backends.redis.jobs`) run off the loop,
with the checksums and the cipher: on a stream that carries several jobs at once
(:mod:`backends.redis.stream`), to one server or to a cluster's nodes; on redis-py's
data path, as one hop on the tier's pool. No call is retried. Blocks move on the
tier's own RESP connections (:mod:`backends.redis.wire`): a payload goes out from its
slot and comes back straight into it, and is verified there. redis-py's client runs
everything else (the start's checks, lookups, usage, deletes, a cluster's
redirections), and the data path too where the url asks for an option that path lacks
or ``data_path`` says so.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Annotated, Any, Literal, Self

from pydantic import AfterValidator, Field, model_validator

from backends.breaker import BreakerOptions, BreakerState, CircuitBreaker
from backends.redis.connection import endpoint_of
from backends.redis.control import (
    CLIENT_ERRORS,
    UNREACHABLE,
    AuthenticationError,
    ClientError,
    Redis,
    RedisCluster,
    RedisConnectionError,
    ResponseError,
    check_url,
    detached,
    new_client,
    round_trip,
)
from backends.redis.jobs import JobShape, LoadWork, StoreWork
from backends.redis.landing import CORRUPT, MISSING, REFUSED, LandingBuffers
from backends.redis.resp import joined
from backends.redis.stream import RespStream
from backends.redis.wire import WirePipelines
from tiering.errors import ClosedError, InvalidArgumentError
from tiering.options import ActorOptions, Bytes, PositiveInt, Seconds, SecondsOrZero, secret
from tiering.security.encryption import TAG_BYTES, BlockCipher, Keyring, keyring_from
from tiering.tiers.actor import TierActor, deliver
from tiering.tiers.block_record import (
    MAX_TENANT_BYTES,
    namespace_digest,
)
from tiering.tiers.tier_api import JobMetadata, JobResult, OffloadKey, ReqContext

logger = logging.getLogger(__name__)


def namespace_prefix(namespace: str) -> bytes:
    """How every Redis key of a block of ``namespace`` starts, whatever its tenant:
    ``kvt:2:`` + the namespace digest (hex) + ``:`` (the format above)."""
    return b"kvt:2:" + namespace_digest(namespace).hex().encode() + b":"


_CHECK_BATCH = 1000  # keys per EXISTS pipeline

_TLS_ARGUMENTS = {
    "tls_ca_file": "ssl_ca_certs",
    "tls_cert_file": "ssl_certfile",
    "tls_key_file": "ssl_keyfile",
}  # the tier's TLS options, and redis-py's names of them


def _tenant(tenant: str) -> str:
    if ":" in tenant:
        raise ValueError("must not hold ':'")
    if len(tenant.encode()) > MAX_TENANT_BYTES:
        raise ValueError(f"must be at most {MAX_TENANT_BYTES} bytes (UTF-8)")
    return tenant


def _readable_file(path: str | None) -> str | None:
    if path is not None and not os.path.isfile(path):
        raise ValueError("must name a readable file")
    return path


_File = Annotated[str | None, AfterValidator(_readable_file)]


class RedisOptions(BreakerOptions, ActorOptions):
    """The Redis tier's options; what each means: the table in docs/redis.md.

    ``url`` (it may hold a password) and ``encryption`` (a keyring or its spec) are never
    shown. The url's syntax is checked with redis-py's own parser, for ``cluster`` too
    (:func:`~backends.redis.control.check_url`); the ``tls_*`` files go with ``rediss://``
    only. ``namespace`` and ``tenant`` (no ``:``) are bound into every record: blocks
    under another never show.
    """

    url: str = secret()
    namespace: str = Field(min_length=1)
    tenant: Annotated[str, AfterValidator(_tenant)] = ""
    timeout_s: Seconds = 5.0
    max_connections: PositiveInt = 32
    ttl_s: Seconds | None = None
    presence_ttl_s: SecondsOrZero = 30.0
    absence_ttl_s: SecondsOrZero = 1.0
    presence_entries: PositiveInt = 1 << 20
    tls_ca_file: _File = None
    tls_cert_file: _File = None
    tls_key_file: _File = None
    usage_every_s: Seconds = 5.0
    cluster: bool = False
    pipeline_bytes: Bytes = 2 << 20
    encryption: str | Keyring | None = secret(None)
    data_path: Literal["sockets", "redis-py"] = "sockets"
    # Two (streams, or pool threads): their Python between syscalls contends for the
    # GIL, and more threads wait on each other (and the loop on them) more than they
    # overlap; one leaves the server idle while it lands a store's replies.
    io_threads: PositiveInt = 2

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        """The url's syntax (for ``cluster`` too), and TLS files only with TLS."""
        check_url(self.url, cluster=self.cluster)
        for name in _TLS_ARGUMENTS:
            if getattr(self, name) is not None and not self.url.startswith("rediss://"):
                raise ValueError(f"{name} needs a rediss:// url (TLS)")
        return self

    def tls_arguments(self) -> dict[str, str]:
        """The TLS files given, under redis-py's names for them."""
        tls = {arg: getattr(self, name) for name, arg in _TLS_ARGUMENTS.items()}
        return {arg: path for arg, path in tls.items() if path is not None}

    def client(self, *, cluster: bool) -> Redis | RedisCluster:
        """A new client of ``url`` with these timeouts, pool bound and TLS files
        (a cluster client with ``cluster``, which connects as it is made)."""
        return new_client(
            self.url,
            cluster=cluster,
            timeout_s=self.timeout_s,
            max_connections=self.max_connections,
            tls=self.tls_arguments(),
        )

    def wire(self, client: Redis | RedisCluster) -> WirePipelines | None:
        """The data path on the tier's own connections, beside ``client`` (whose map
        of a cluster's slots it reads); None for redis-py's (``data_path``, or a url
        asking for an option only redis-py implements)."""
        if self.data_path != "sockets":
            return None
        endpoint = endpoint_of(self.url, timeout_s=self.timeout_s, tls=self.tls_arguments())
        if endpoint is None:
            return None
        # One stream per I/O thread, sharing the jobs' window: at most max_inflight
        # pipelines on the wire, as with a job per thread.
        window = max(1, self.max_inflight // self.io_threads)
        cluster = client if isinstance(client, RedisCluster) else None
        return WirePipelines(endpoint, cluster, streams=self.io_threads, window=window)


class RedisTier(TierActor):
    """A secondary tier on a Redis (or Valkey) server, shared by many engines; its
    options are :class:`RedisOptions`.

    Guarantees: a load serves a block only if it verifies (see the module docstring); a
    key the server refuses, or that holds no block, fails alone; a connection failure
    fails the job's keys (never the engine), within about ``timeout_s``; ``lookup``
    never blocks. Key material never shows in ``repr``, statistics, errors or logs.
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
        tenant, ns = o.tenant.encode(), namespace_digest(o.namespace)
        self._prefix = namespace_prefix(o.namespace) + tenant + b":"
        # What every record of this tier is written with and checked against.
        self._record: dict[str, Any] = dict(tenant=tenant, payload_bytes=block_bytes, ns_digest=ns)
        self._blocks_per_pipeline = max(1, o.pipeline_bytes // block_bytes)
        self._job_shape: JobShape | None = None
        # Each I/O thread's buffer of one pipeline's sealed payloads (with encryption).
        self._seal_buffers = threading.local()
        # Made by the first call that needs it (a cluster client connects as it is made,
        # so one whose nodes are down at start is made later, by a probe) and dropped
        # at close; the lock keeps the I/O threads from making two.
        self._client: Redis | RedisCluster | None = None
        self._wire: WirePipelines | None = None  # made with the client
        self._client_lock = threading.Lock()
        self._serving = False  # from start until close: whether a client may be made
        # key -> (present, trusted until): a bounded LRU of recent answers
        self._presence: OrderedDict[OffloadKey, tuple[bool, float]] = OrderedDict()
        self._known_present = 0  # its present answers, kept as they change: no scan
        self._to_check: dict[OffloadKey, None] = {}  # queued for the next batched check
        self._in_check: set[OffloadKey] = set()  # in the check on the wire now
        self._checking = False
        # The server's INFO memory and DBSIZE, read every usage_every_s (0 until then).
        self._server_usage = {"used_bytes": 0, "capacity_bytes": 0, "server_keys": 0}
        self._counters = dict.fromkeys(
            ("stored_blocks", "loaded_blocks", "corrupt_blocks", "missing_blocks",
             "unreachable_calls", "lookup_round_trips", "pipelines"),
            0,
        )  # fmt: skip

    # -- life cycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and start serving; a server that does not answer within ``timeout_s``
        only opens the breaker. Raises InvalidArgumentError, leaving nothing running, if
        the server refuses the url's credentials (quoting the server, never the
        password), its certificate does not verify (naming ``tls_ca_file``), or it is
        (not) a cluster node against ``cluster``."""
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
        """Stop making clients and drop the one made (no hop runs any more)."""
        with self._client_lock:
            self._serving = False
            client, self._client = self._client, None
            wire, self._wire = self._wire, None
        if wire is not None:
            wire.close()
        if client is not None:
            client.close()  # disconnects the pool's idle connections; never blocks long

    # -- queries ----------------------------------------------------------------------

    @staticmethod
    def get_tier_type() -> str:
        return "redis"

    def lookup(self, key: OffloadKey, req_context: ReqContext = None) -> bool | None:
        """False while the breaker is not closed (open, or half-open with its probe
        out) or the tier is closed, whatever the cache holds; else True/False from a
        fresh cached answer, or None (ask again) with the key queued for the next
        batched check. InvalidArgumentError unless ``key`` is bytes."""
        if not isinstance(key, bytes):
            raise InvalidArgumentError(f"keys must be bytes, got {type(key).__name__}")
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

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext = None) -> None:
        """Nothing to do: the server keeps its own recency (``allkeys-lru``)."""

    def _usage(self) -> dict[str, Any]:
        """The server's memory in use, ``maxmemory`` (0: no limit) and key count
        (``counters["server_keys"]``), as last read (every ``usage_every_s``)."""
        usage = self._server_usage
        return {
            "used_blocks": self.get_num_blocks(),
            "used_bytes": usage["used_bytes"],
            "capacity_bytes": usage["capacity_bytes"],
            "counters": {**self._counters, "server_keys": usage["server_keys"]},
            "failures": {},
        }

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

    # -- hooks ------------------------------------------------------------------------

    async def _do_store(self, job: JobMetadata) -> JobResult:
        return await self._run_hop(job, "store", StoreWork)

    async def _do_load(self, job: JobMetadata) -> JobResult:
        return await self._run_hop(job, "load", LoadWork)

    async def _run_hop(
        self, job: JobMetadata, what: str, work: type[StoreWork | LoadWork]
    ) -> JobResult:
        """Run ``job``'s work on a stream, or on a pool thread through redis-py (unless
        the breaker refuses), and account for what each key came to."""
        keys = list(job.keys)
        if not self._serving or not self.breaker.allow():
            outcome: dict[bytes, str] | BaseException | None = None
        else:
            todo = work(self._shape(), keys, list(job.block_ids))
            wire = self._wire
            if wire is not None:
                outcome = await self._on_stream(wire.stream(), todo)
            else:
                outcome = await self.run_blocking(self._run_work, todo)
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
        self._counters["pipelines"] += -(-len(keys) // self._blocks_per_pipeline)
        if refusals:
            self._failures.record(f"redis refused a block's {what}", len(refusals), refusals[0])
        if not failed:
            return JobResult(job.job_id, True)
        first = next(iter(failed.values()))
        return JobResult(job.job_id, False, tuple(failed), f"{len(failed)} keys failed: {first}")

    async def _on_stream(
        self, stream: RespStream, work: StoreWork | LoadWork
    ) -> dict[bytes, str] | ClientError:
        """``work`` carried by ``stream``, awaited as :meth:`run_blocking` awaits."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[dict[bytes, str] | ClientError] = loop.create_future()

        def settle(outcome: Any) -> None:
            raised = isinstance(outcome, BaseException) and not isinstance(outcome, CLIENT_ERRORS)
            deliver(loop, done, outcome, raised=raised)

        try:
            call = stream.submit(work, settle)
        except RuntimeError as exc:
            raise ClosedError("the redis tier is closed") from exc
        return await self.wait_call(call, done)

    # -- I/O threads: one hop per job -----------------------------------------------

    # A hop returns the client's error rather than raising it: a raised error would keep
    # the hop's frames, and with them views of the host pool, alive in its traceback.
    # A view handed to the client is released once the call is over, whatever happened.

    def _hello(self) -> ClientError | InvalidArgumentError | None:
        """Ping the server with a plain client and check that it is (or is not) a
        cluster node, as ``cluster`` says; then make the tier's client. Returns the
        client's error, or an InvalidArgumentError if no call could ever succeed."""
        probe = self.options.client(cluster=False)
        try:
            probe.ping()
            enabled = bool(probe.info("cluster").get("cluster_enabled", 0))
            if enabled != self.options.cluster:
                said = "a Redis Cluster node" if enabled else "not a cluster node"
                return InvalidArgumentError(
                    f"cluster: the redis server is {said}, but the tier has cluster={not enabled}"
                )
            self._connected()
        except AuthenticationError as exc:
            return InvalidArgumentError(f"url: the redis server refused its credentials ({exc})")
        except CLIENT_ERRORS as exc:
            if "certificate verify failed" not in str(exc).lower():
                return detached(exc)
            return InvalidArgumentError(
                "tls_ca_file: the redis server's certificate did not verify against "
                f"{self.options.tls_ca_file or 'the system CAs'!r} ({exc})"
            )
        finally:
            probe.close()
        return None

    def _shape(self) -> JobShape:
        """What this tier's jobs are made with (made once, at the first job)."""
        if self._job_shape is None:
            o = self.options
            self._job_shape = JobShape(
                slot=self.slot,
                prefix=self._prefix,
                record=self._record,
                cipher=self._cipher,
                per_pipeline=self._blocks_per_pipeline,
                expiry=() if o.ttl_s is None else ("EX", max(1, round(o.ttl_s))),
                seal_buffers=self._sealing_buffers,
                landing_buffers=LandingBuffers(self.block_bytes),
                delete=self._delete,
            )
        return self._job_shape

    def _run_work(self, work: StoreWork | LoadWork) -> dict[bytes, str] | ClientError:
        """On a pool thread: ``work``'s pipelines one after another through redis-py's
        client (its data path). Returns ``work``'s outcome, or the client's error if a
        call failed (the blocks before it are stored)."""
        try:
            client = self._connected()
            for pipeline in work.pipelines():
                pipeline.answer(round_trip(client, [joined(c) for c in pipeline.commands]))
        except CLIENT_ERRORS as exc:
            work.finish()
            return detached(exc)
        except BaseException:
            work.finish()  # the views go, whatever went wrong
            raise
        return work.finish()

    def _delete(self, names: list[bytes]) -> None:
        """Delete ``names`` (values that are no blocks of this tier) from the server, as
        far as it goes: a failure is logged, and the next load of each fails again."""
        try:
            self._connected().delete(*names)
        except CLIENT_ERRORS as exc:  # the job's other keys still count
            logger.debug("redis tier: deleting corrupt blocks failed: %r", detached(exc))

    def _sealing_buffers(self) -> list[memoryview]:
        """This I/O thread's buffers for one pipeline's sealed payloads
        (``block_bytes + TAG_BYTES`` each), made on its first call."""
        if not hasattr(self._seal_buffers, "views"):
            stride = self.block_bytes + TAG_BYTES
            arena = memoryview(bytearray(self._blocks_per_pipeline * stride))
            self._seal_buffers.views = [arena[i : i + stride] for i in range(0, len(arena), stride)]
        buffers: list[memoryview] = self._seal_buffers.views
        return buffers

    def _usage_hop(self) -> dict[str, int] | ClientError:
        """The server's memory use, limit and key count (summed over a cluster's
        primaries); the client's error if that failed."""
        try:
            client = self._connected()
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
        """``EXISTS`` of every key in one pipelined round trip (an error reply in the
        place of a key the server would not answer for)."""
        return round_trip(self._connected(), [("EXISTS", self._prefix + key) for key in keys])

    def _connected(self) -> Redis | RedisCluster:
        """The tier's client, made now if this is the first call that needs it. Raises
        RedisConnectionError once closed, the client's error if no cluster node answers."""
        with self._client_lock:
            if self._client is None:
                if not self._serving:
                    raise RedisConnectionError("the redis tier is closed")
                client = self.options.client(cluster=self.options.cluster)
                self._client, self._wire = client, self.options.wire(client)
            return self._client

    # -- presence cache and background tasks (loop thread) ----------------------------

    def _remember(self, keys: Sequence[OffloadKey], present: bool) -> None:
        """Cache what was just found of ``keys``; a presence check on the wire now may
        have read the server before that, so its answer for them is dropped."""
        if not keys:
            return
        if self._in_check:
            self._in_check.difference_update(keys)
        ttl = self.options.presence_ttl_s if present else self.options.absence_ttl_s
        entry = (present, time.monotonic() + ttl)
        presence, known = self._presence, self._known_present
        for key in keys:
            old = presence.pop(key, None)  # then put back last: the most recent
            known += present - (old is not None and old[0])
            presence[key] = entry
        limit = self.options.presence_entries
        while len(presence) > limit:
            _, (dropped, _) = presence.popitem(last=False)
            known -= dropped
        self._known_present = known

    def _forget(self, key: OffloadKey) -> None:
        """Drop the cached answer for ``key`` (and a check's on the wire now): a lookup
        asks the server again."""
        self._in_check.discard(key)
        old = self._presence.pop(key, None)
        if old is not None:
            self._known_present -= old[0]

    def _schedule_check(self) -> None:
        """Start the batched check, on the loop; a lookup may come from another thread
        (vLLM calls tiers from its scheduler thread), which hands the start over."""
        if self._checking:
            return
        loop = self._loop
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._checking = self.spawn(self._check_presence(), name="presence-check")
        elif loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._schedule_check)

    async def _check_presence(self) -> None:
        """Check every queued key, in pipelined batches (one round trip each)."""
        try:
            while self._to_check and self._serving and self.breaker.allow():
                batch = list(self._to_check)[:_CHECK_BATCH]
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
        """Read the server's usage now and every ``usage_every_s`` while the tier runs
        (skipped while the breaker is open)."""
        while self._serving:
            if self.breaker.state is BreakerState.CLOSED:
                usage = await self.run_blocking(self._usage_hop)
                if isinstance(usage, dict):
                    self._server_usage = usage
            await asyncio.sleep(self.options.usage_every_s)

    def _unreachable(self, what: str, exc: BaseException) -> None:
        self._counters["unreachable_calls"] += 1
        self.breaker.failed()
        self._failures.record(f"redis unreachable during {what}", 1, type(exc).__name__)
