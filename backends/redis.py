"""A remote tier on Redis or Valkey: one cache shared by every serving machine.

Each block is one Redis hash under one key, so its header and payload live in one slot
of a Redis Cluster too::

    key:    b"kvt:" + namespace digest (hex) + b":" + tenant + b":" + block hash
    fields: b"h" -> a compact header (magic, version, payload length, payload checksum,
                   namespace digest, the key), b"p" -> the payload bytes

The header carries what :mod:`backends.nvme_format` carries for a block file, without
the page padding (Redis needs no aligned offsets). A load verifies the header (magic,
namespace, key, length) and the payload's checksum before the CPU slot counts as
loaded; a value that fails is a failed key and is deleted, never served.

With ``encryption`` (a keyring, :mod:`tiering.encryption`) every block is sealed with
AES-GCM under the keyring's current key, and its value takes format version 2::

    b"h" -> the same header, with version 2 and, in place of the payload checksum, the
            key id (u32) and the 12-byte nonce; no checksum of the plaintext (equal
            payloads would show as equal checksums)
    b"p" -> the ciphertext (as long as the payload), then the 16-byte GCM tag

The associated data is the namespace digest and the block's key, so a value copied to
another block's key, or into another namespace, fails to open. A tier reads the format
it writes and no other: without ``encryption`` a version-2 value is a corrupt block (as
it is to a reader from before version 2), and with it a version-1 value is one too, so
a tier that encrypts never serves bytes that did not authenticate. A value sealed under
a key id the keyring lacks, or that does not authenticate, is a corrupt block as well:
a failed key, deleted from the server, logged once per key id by the cipher. Sealing
and opening run on the I/O threads inside the job's hop; a load decrypts straight into
the CPU slot (a failed key's slot then holds garbage, as a failed load's may).

The client (redis-py's synchronous one) runs on the tier's I/O threads, one hop per job:
it copies every value it sends and receives, which on the event loop measured a loop
lag p99 of 34-49 ms at 2 MiB blocks (docs/redis.md).

``lookup`` is synchronous and never waits on the network: it answers from a bounded
presence cache (present answers kept ``presence_ttl_s``, absent ones ``absence_ttl_s``)
and, for a key it has no fresh answer for, returns None ("ask again") and queues the
key for a batched check: one pipelined round trip of ``EXISTS`` for every key queued
meanwhile. A block another machine stored is therefore found one step later.

Every call has a timeout. After ``breaker_failures`` connection failures in a row a
:class:`~backends.breaker.CircuitBreaker` opens: lookups answer False, stores and loads
fail at once, and a probe goes through after a back-off; the tier recovers by itself
when the server is back. Redis going away never takes the engine down.

Capacity is Redis's own: configure ``maxmemory`` with ``maxmemory-policy allkeys-lru``
on the server; ``ttl_s`` (optional) expires blocks after that many seconds. A block
evicted by the server between a lookup and a load is a failed key.

With ``cluster=True`` the tier talks to a Redis Cluster through redis-py's cluster
client: a job's pipeline is split by node, written to every node before any reply is
read. A job's blocks go in pipelines of at most ``pipeline_bytes`` of payload each, so
at most ``max_inflight * pipeline_bytes`` payload bytes are in flight (and in the
client's buffers) at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

import xxhash

from backends.breaker import BreakerState, CircuitBreaker
from backends.nvme_format import check_key, namespace_digest, payload_checksum
from tiering.actor import ACTOR_OPTIONS, TierActor
from tiering.encryption import TAG_BYTES, BlockCipher, Keyring, Seal, associated_data, keyring_from
from tiering.errors import CorruptBlockError, InvalidArgumentError
from tiering.secondary import JobMetadata, JobResult, OffloadKey, ReqContext
from tiering.validation import positive_int, seconds

try:
    import redis
    from redis.cluster import RedisCluster
    from redis.exceptions import (
        AuthenticationError,
        ClusterDownError,
        RedisClusterException,
        RedisError,
    )
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # pragma: no cover - exercised only without redis-py
    raise ImportError(
        "the redis tier needs redis-py (pip install 'kv-tiering[redis]'); "
        f"importing it failed: {type(exc).__name__}: {exc}"
    ) from exc

logger = logging.getLogger(__name__)

MAGIC = b"KVTRDS\r\n"
FORMAT_VERSION = 1
"""A plain block: the payload, and its checksum in the header."""
SEALED_VERSION = 2
"""An encrypted block: ciphertext and tag, the key id and nonce in the header."""
# magic, version, payload length, checksum (v1) or key id + nonce (v2), ns, key len
_FIXED = struct.Struct("<8sHxxQ16s16sH")
_SEAL = struct.Struct("<I12s")  # a v2 header's 16 bytes in place of the checksum
_TRAILER = struct.Struct("<Q")  # xxh3_64 of everything before it

HEADER_FIELD = b"h"
PAYLOAD_FIELD = b"p"

_CLIENT_ERRORS = (RedisError, RedisClusterException, OSError)
"""What a call to the server may raise (the cluster client's own errors are no
RedisErrors)."""
_ClientError = RedisError | RedisClusterException | OSError
_UNREACHABLE = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    RedisClusterException,  # no node of the cluster answered, or a slot has no node
    ConnectionError,
    TimeoutError,
    OSError,
)
_CHECK_BATCH = 1000  # keys per EXISTS pipeline


def encode_header(
    *,
    key: bytes,
    payload_bytes: int,
    ns_digest: bytes,
    checksum: bytes | None = None,
    seal: Seal | None = None,
) -> bytes:
    """The compact header of one block value: a plain one (version 1) with the payload's
    ``checksum``, or a sealed one (version 2) with ``seal``'s key id and nonce (its tag
    goes after the ciphertext, in the payload field).

    Raises:
        InvalidArgumentError: not exactly one of ``checksum`` and ``seal`` is given.
    """
    if (checksum is None) == (seal is None):
        raise InvalidArgumentError("a block header takes a checksum or a seal, not both")
    if seal is None:
        version, field = FORMAT_VERSION, checksum
    else:
        version, field = SEALED_VERSION, _SEAL.pack(seal.key_id, seal.nonce)
    body = _FIXED.pack(MAGIC, version, payload_bytes, field, ns_digest, len(key)) + key
    return body + _TRAILER.pack(xxhash.xxh3_64_intdigest(body))


def _check_header(
    header: bytes, *, key: bytes, payload_bytes: int, ns_digest: bytes
) -> tuple[int, bytes]:
    """The version and the 16-byte checksum-or-seal field of a header that verifies
    (its own checksum, magic, a known version, namespace, key and length).

    Raises:
        CorruptBlockError: saying which check failed.
    """
    if len(header) < _FIXED.size + _TRAILER.size:
        raise CorruptBlockError(f"header is {len(header)} bytes")
    body, (stored,) = header[: -_TRAILER.size], _TRAILER.unpack(header[-_TRAILER.size :])
    if xxhash.xxh3_64_intdigest(body) != stored:
        raise CorruptBlockError("header checksum mismatch")
    magic, version, length, field, ns, key_len = _FIXED.unpack_from(body, 0)
    if magic != MAGIC or version not in (FORMAT_VERSION, SEALED_VERSION):
        raise CorruptBlockError("not a block value of this format")
    if ns != ns_digest:
        raise CorruptBlockError("block belongs to another namespace")
    if body[_FIXED.size :] != key or key_len != len(key):
        raise CorruptBlockError("block holds another key")
    if length != payload_bytes:
        raise CorruptBlockError(f"block is of {length} bytes, expected {payload_bytes}")
    return version, field


def check_value(
    header: bytes, payload: bytes, *, key: bytes, payload_bytes: int, ns_digest: bytes
) -> None:
    """Verify one plain block value read back (call it off the loop: it hashes the
    payload).

    Raises:
        CorruptBlockError: the header is damaged or of another format, names another
            namespace, key or length, the value is encrypted (this reader has no keys:
            never serve ciphertext), or the payload's checksum differs. The message
            says which.
    """
    version, checksum = _check_header(
        header, key=key, payload_bytes=payload_bytes, ns_digest=ns_digest
    )
    if version != FORMAT_VERSION:
        raise CorruptBlockError("block is encrypted, and this tier has no encryption keyring")
    if len(payload) != payload_bytes:
        raise CorruptBlockError(f"payload is {len(payload)} bytes, expected {payload_bytes}")
    if payload_checksum(payload) != checksum:
        raise CorruptBlockError("payload checksum mismatch")


def open_value(
    header: bytes,
    sealed: bytes,
    *,
    key: bytes,
    payload_bytes: int,
    ns_digest: bytes,
    cipher: BlockCipher,
    into: memoryview,
) -> None:
    """Verify one sealed block value read back and decrypt its payload into ``into``
    (``payload_bytes`` long). Blocking: call it off the loop.

    ``into`` holds the plaintext only if this returns; after a failure its bytes are
    garbage (never to be served: the key has failed).

    Raises:
        CorruptBlockError: the header is damaged or of another format, names another
            namespace, key or length, or the value is not encrypted (a tier that
            encrypts serves nothing unauthenticated);
            :class:`~tiering.encryption.UnknownKeyError` (the keyring lacks its key id)
            or :class:`~tiering.encryption.AuthenticationError` (a wrong key, altered
            or moved bytes), both CorruptBlockErrors, from the cipher, which logs each
            once per key id.
    """
    version, field = _check_header(
        header, key=key, payload_bytes=payload_bytes, ns_digest=ns_digest
    )
    if version != SEALED_VERSION:
        raise CorruptBlockError("block is not encrypted, and this tier reads only encrypted ones")
    if len(sealed) != payload_bytes + TAG_BYTES:
        raise CorruptBlockError(
            f"sealed payload is {len(sealed)} bytes, expected {payload_bytes + TAG_BYTES}"
        )
    key_id, nonce = _SEAL.unpack(field)
    seal = Seal(key_id, nonce, bytes(sealed[payload_bytes:]))
    with memoryview(sealed) as view:
        cipher.open_into(seal, view, associated_data(ns_digest, key), into)


class RedisTier(TierActor):
    """A secondary tier on a Redis (or Valkey) server, shared by many engines.

    Args:
        primary_kv_view, block_bytes: as every tier.
        url: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS) or
            ``unix://``; never logged or shown.
        namespace: what the blocks' bytes mean (the engine passes its cache identity);
            two namespaces on one server never see each other's blocks.
        tenant: an optional prefix that isolates tenants sharing a namespace.
        timeout_s: the limit of every call to the server.
        max_connections: the connection pool's bound.
        ttl_s: expire stored blocks after this many seconds (None: never).
        presence_ttl_s, absence_ttl_s: how long a lookup trusts a present / absent
            answer; presence_entries bounds the presence cache.
        breaker_failures, breaker_backoff_s, breaker_max_backoff_s: see
            :class:`~backends.breaker.CircuitBreaker`.
        tls_ca_file, tls_cert_file, tls_key_file: with a ``rediss://`` url, the CA that
            signed the server's certificate (default: the system's) and this client's
            certificate and key (for servers that ask for one).
        usage_every_s: how often the server's memory use is read for ``statistics()``.
        cluster: the url names a node of a Redis Cluster (``redis://`` or ``rediss://``);
            the tier finds the other nodes from it. A mismatch with the server found at
            start is an error.
        pipeline_bytes: the most payload bytes one pipelined round trip carries (at
            least one block); a larger job goes in several, one after another. Smaller
            pipelines kept the client's reply buffers small: at 2 MiB blocks on a local
            server, loads ran about 1.5x faster with one block per pipeline than with
            eight (docs/redis.md).
        encryption: None (blocks stored plain), or a keyring spec
            (``"2:<base64 key>,1:<base64 key>"``, ``"env:VARIABLE"``) or
            :class:`~tiering.encryption.Keyring`: blocks are sealed with AES-GCM under
            its first (current) key and read under any of its keys (see the module
            docstring for the format).
        inbox_size, max_inflight, io_threads: :class:`~tiering.actor.TierActor` options.

    Guarantees: a load serves a block only if its header and checksum verify (with
    ``encryption``: its header verifies and it authenticates under the keyring, and a
    plain block is never served); a connection failure fails the job's keys (never the
    engine); ``lookup`` never blocks. Key material never shows in ``repr``, statistics,
    errors or logs.

    Raises (constructor): InvalidArgumentError for a bad option, naming it and its value
    (the url is named without its value, which may hold a password; ``encryption``
    without its keys).
    """

    def __init__(
        self,
        primary_kv_view: memoryview,
        block_bytes: int,
        *,
        url: str,
        namespace: str,
        tenant: str = "",
        timeout_s: float = 5.0,
        max_connections: int = 32,
        ttl_s: float | None = None,
        presence_ttl_s: float = 30.0,
        absence_ttl_s: float = 1.0,
        presence_entries: int = 1 << 20,
        breaker_failures: int = 3,
        breaker_backoff_s: float = 1.0,
        breaker_max_backoff_s: float = 30.0,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        usage_every_s: float = 5.0,
        cluster: bool = False,
        pipeline_bytes: int = 2 << 20,
        encryption: str | Keyring | None = None,
        **actor_kwargs: Any,
    ) -> None:
        unknown = set(actor_kwargs) - ACTOR_OPTIONS
        if unknown:
            raise InvalidArgumentError(f"unknown redis tier option(s): {sorted(unknown)}")
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidArgumentError(
                "url must be a redis://, rediss:// or unix:// URL (value not shown: it may "
                "hold a password)"
            )
        if not isinstance(namespace, str) or not namespace:
            raise InvalidArgumentError(f"namespace must be a non-empty str, got {namespace!r}")
        if not isinstance(tenant, str) or ":" in tenant:
            raise InvalidArgumentError(f"tenant must be a str without ':', got {tenant!r}")
        if not isinstance(cluster, bool):
            raise InvalidArgumentError(f"cluster must be a bool, got {cluster!r}")
        if cluster and url.startswith("unix://"):
            raise InvalidArgumentError("cluster needs a redis:// or rediss:// url, not unix://")
        self.cluster = cluster
        self._tls = _tls_options(url, tls_ca_file, tls_cert_file, tls_key_file)
        self.timeout_s = seconds("timeout_s", timeout_s, allow_zero=False)
        self.max_connections = positive_int("max_connections", max_connections)
        self.ttl_s = None if ttl_s is None else seconds("ttl_s", ttl_s, allow_zero=False)
        self.presence_ttl_s = seconds("presence_ttl_s", presence_ttl_s, allow_zero=True)
        self.absence_ttl_s = seconds("absence_ttl_s", absence_ttl_s, allow_zero=True)
        self.presence_entries = positive_int("presence_entries", presence_entries)
        self.usage_every_s = seconds("usage_every_s", usage_every_s, allow_zero=False)
        self.pipeline_bytes = positive_int("pipeline_bytes", pipeline_bytes)
        keyring = keyring_from(encryption, option="encryption")
        self._cipher = None if keyring is None else BlockCipher(keyring)
        self.breaker = CircuitBreaker(
            failures=breaker_failures,
            backoff_s=breaker_backoff_s,
            max_backoff_s=breaker_max_backoff_s,
        )
        super().__init__(primary_kv_view, block_bytes, **actor_kwargs)
        self.namespace = namespace
        self.tenant = tenant
        self._ns_digest = namespace_digest(namespace)
        self._prefix = b"kvt:" + self._ns_digest.hex().encode() + b":" + tenant.encode() + b":"
        self._url = url
        self._blocks_per_pipeline = max(1, self.pipeline_bytes // block_bytes)
        # Each I/O thread's buffer of one pipeline's sealed payloads (with encryption):
        # made at its first store, reused by every later one.
        self._seal_buffers = threading.local()
        # Made by the first call that needs it (a cluster client connects as it is made,
        # so one whose nodes are down at start is made later, by a probe) and dropped
        # at close; the lock keeps the I/O threads from making two.
        self._client: redis.Redis | RedisCluster | None = None
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
        self._counters = {
            "stored_blocks": 0,
            "loaded_blocks": 0,
            "corrupt_blocks": 0,
            "missing_blocks": 0,
            "unreachable_calls": 0,
            "lookup_round_trips": 0,
            "pipelines": 0,
        }

    # -- life cycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and start serving. A server that does not answer (within
        ``timeout_s``) only opens the breaker: the tier recovers when it comes. One that
        refuses the credentials, or whose TLS certificate does not verify, is an error,
        since no call would ever succeed.

        Raises:
            InvalidArgumentError: the server refused the url's credentials (the message
                quotes the server, never the password), or its certificate did not
                verify (naming ``tls_ca_file``); nothing is left running.
        """
        self._serving = True
        error = await self.run_blocking(self._hello)
        if isinstance(error, AuthenticationError):
            self._fail_start()
            raise InvalidArgumentError(
                f"url: the redis server refused its credentials ({error})"
            ) from None
        if isinstance(error, InvalidArgumentError):
            self._fail_start()
            raise error
        if error is not None and "certificate verify failed" in str(error).lower():
            self._fail_start()
            raise InvalidArgumentError(
                "tls_ca_file: the redis server's certificate did not verify against "
                f"{self._tls.get('ssl_ca_certs', 'the system CAs')!r} ({error})"
            ) from None
        if error is not None:
            self._unreachable("ping", error)
        else:
            self.breaker.succeeded()
        await super().start()
        self.spawn(self._watch_usage(), name="usage")

    async def aclose(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109 - base API
        await super().aclose(timeout)
        self._drop_client()

    def shutdown(self) -> None:
        super().shutdown()
        if self.state.name == "CLOSED":
            self._drop_client()

    def _fail_start(self) -> None:
        self._drop_client()
        self.shutdown()

    def _drop_client(self) -> None:
        with self._client_lock:
            self._serving = False
            client, self._client = self._client, None
        if client is not None:
            client.close()  # disconnects the pool's idle connections; never blocks long

    # -- queries ----------------------------------------------------------------------

    @staticmethod
    def get_tier_type() -> str:
        return "redis"

    def lookup(self, key: OffloadKey, req_context: ReqContext = None) -> bool | None:
        """True/False from a fresh cached answer; otherwise None (ask again), and the
        key is checked in the next batched round trip. False while the breaker is open.

        Raises:
            InvalidArgumentError: ``key`` is not bytes.
        """
        if not isinstance(key, bytes):
            raise InvalidArgumentError(f"keys must be bytes, got {type(key).__name__}")
        if self.storing(key):
            return None
        entry = self._presence.get(key)
        if entry is not None and entry[1] > time.monotonic():
            return entry[0]
        if self.breaker.state is not BreakerState.CLOSED or self.closed:
            return False
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
        """``used_bytes`` is the server's memory in use and ``capacity_bytes`` its
        ``maxmemory`` (0: no limit), both as last read (every ``usage_every_s``); the
        server's key count is ``counters["server_keys"]``."""
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
        sealed = "" if self._cipher is None else f" encryption={self._cipher.keyring!r}"
        return (
            f"<RedisTier {self.namespace!r} tenant={self.tenant!r} breaker={self.breaker.state}"
            f"{sealed} {self.statistics()!r}>"
        )

    # -- hooks ------------------------------------------------------------------------

    async def _do_store(self, job: JobMetadata) -> JobResult:
        keys = list(job.keys)
        if not self._serving or not self.breaker.allow():
            return self._refused(job, keys)
        outcome = await self.run_blocking(self._store_hop, keys, list(job.block_ids))
        if not isinstance(outcome, int):
            return self._call_failed(job, keys, "store", outcome)
        self.breaker.succeeded()
        for key in keys:
            self._remember(key, True)
        self._counters["stored_blocks"] += len(keys)
        self._counters["pipelines"] += outcome
        return JobResult(job.job_id, True)

    async def _do_load(self, job: JobMetadata) -> JobResult:
        keys = list(job.keys)
        if not self._serving or not self.breaker.allow():
            return self._refused(job, keys)
        outcome = await self.run_blocking(self._load_hop, keys, list(job.block_ids))
        if not isinstance(outcome, tuple):
            return self._call_failed(job, keys, "load", outcome)
        reasons, pipelines = outcome
        self.breaker.succeeded()
        self._counters["pipelines"] += pipelines
        failed = {key: why for key, why in zip(keys, reasons, strict=True) if why}
        corrupt = sum(1 for why in failed.values() if why.startswith("corrupt"))
        for key in keys:
            self._remember(key, key not in failed)
        self._counters["loaded_blocks"] += len(keys) - len(failed)
        self._counters["corrupt_blocks"] += corrupt
        self._counters["missing_blocks"] += len(failed) - corrupt
        if not failed:
            return JobResult(job.job_id, True)
        first = next(iter(failed.values()))
        return JobResult(job.job_id, False, tuple(failed), f"{len(failed)} keys failed: {first}")

    # -- worker thread: one hop per job -------------------------------------------------

    # The client runs here, not on the loop: it copies every value it sends and receives
    # (2 MiB each), and on the loop that measured a p99 lag of 34-49 ms.

    # A hop returns the client's error rather than raising it: a raised error would keep
    # the hop's frames, and with them views of the host pool, alive in its traceback.
    # A view handed to the client is released once the call is over, whatever happened.

    def _hello(self) -> _ClientError | InvalidArgumentError | None:
        """Ping the server with a plain client and check that it is (or is not) a
        cluster node, as ``cluster`` says; then make the tier's client. The error, if
        any."""
        probe = self._new_client(cluster=False)
        try:
            probe.ping()
            enabled = bool(probe.info("cluster").get("cluster_enabled", 0))
        except _CLIENT_ERRORS as exc:
            return _detached(exc)
        finally:
            probe.close()
        if enabled != self.cluster:
            said = "a Redis Cluster node" if enabled else "not a cluster node"
            return InvalidArgumentError(
                f"cluster: the redis server is {said}, but the tier has cluster={self.cluster}"
            )
        try:
            self._connected()
        except _CLIENT_ERRORS as exc:
            return _detached(exc)
        return None

    def _store_hop(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> int | _ClientError:
        """Write every block (header, then the payload straight from its slot, or with
        ``encryption`` sealed into this thread's buffer) in pipelined round trips of at
        most ``pipeline_bytes``; how many, or the client's error if one failed (the
        blocks before it are stored)."""
        slot, ns, size, cipher = self.slot, self._ns_digest, self.block_bytes, self._cipher
        views: list[memoryview] = []
        sealed = self._sealing_buffers() if cipher is not None else []
        pipelines = 0
        try:
            client = self._connected()
            for start in range(0, len(keys), self._blocks_per_pipeline):
                stop = start + self._blocks_per_pipeline
                pipe = client.pipeline(transaction=False)
                for i, (key, block_id) in enumerate(
                    zip(keys[start:stop], block_ids[start:stop], strict=True)
                ):
                    payload = slot(block_id)
                    views.append(payload)
                    if cipher is None:
                        value = payload
                        header = encode_header(
                            key=check_key(key),
                            payload_bytes=size,
                            checksum=payload_checksum(payload),
                            ns_digest=ns,
                        )
                    else:
                        # The buffer is free again once the previous pipeline's
                        # execute returned: the client has sent it by then.
                        value = sealed[i]
                        seal = cipher.seal_into(payload, value, associated_data(ns, check_key(key)))
                        header = encode_header(key=key, payload_bytes=size, seal=seal, ns_digest=ns)
                    name = self._name_of(key)
                    pipe.hset(name, mapping={HEADER_FIELD: header, PAYLOAD_FIELD: value})
                    if self.ttl_s is not None:
                        pipe.expire(name, max(1, round(self.ttl_s)))
                try:
                    pipe.execute()
                finally:
                    pipe.reset()
                pipelines += 1
        except _CLIENT_ERRORS as exc:
            return _detached(exc)
        finally:
            # The client's own frames, kept in reference cycles after an error, may
            # still name these views: released, they no longer pin the host pool.
            for view in views:
                view.release()
        return pipelines

    def _load_hop(
        self, keys: Sequence[bytes], block_ids: Sequence[int]
    ) -> tuple[list[str], int] | _ClientError:
        """Read every block in pipelined round trips of at most ``pipeline_bytes``,
        verify each and copy the good ones into their slots; delete the corrupt ones
        from the server. Returns why each key failed ("" for the ones that landed) and
        how many round trips it took, or the client's error."""
        reasons: list[str] = []
        corrupt: list[bytes] = []
        pipelines = 0
        try:
            client = self._connected()
            for start in range(0, len(keys), self._blocks_per_pipeline):
                stop = start + self._blocks_per_pipeline
                pipe = client.pipeline(transaction=False)
                for key in keys[start:stop]:
                    pipe.hmget(self._name_of(key), [HEADER_FIELD, PAYLOAD_FIELD])
                try:
                    values = pipe.execute()
                finally:
                    pipe.reset()
                pipelines += 1
                for key, block_id, value in zip(
                    keys[start:stop], block_ids[start:stop], values, strict=True
                ):
                    reasons.append(self._land(key, block_id, value, corrupt))
                del values  # a whole pipeline of block bytes: not kept past its turn
        except _CLIENT_ERRORS as exc:
            return _detached(exc)
        if corrupt:
            try:
                client.delete(*corrupt)
            except _CLIENT_ERRORS as exc:  # the blocks that landed still count
                logger.debug("redis tier: deleting corrupt blocks failed: %r", _detached(exc))
        return reasons, pipelines

    def _land(
        self, key: bytes, block_id: int, value: list[bytes | None] | None, corrupt: list[bytes]
    ) -> str:
        """Verify one value read back and copy it into its slot: "" if it landed, else
        why not (a corrupt one's name is added to ``corrupt``)."""
        header, payload = value if value else (None, None)
        if header is None or payload is None:
            return "not in the redis tier"
        size, ns = self.block_bytes, self._ns_digest
        try:
            if self._cipher is None:
                check_value(header, payload, key=key, payload_bytes=size, ns_digest=ns)
                self.slot(block_id)[:] = payload
            else:
                with self.slot(block_id) as into:  # decrypted in place: no copy
                    open_value(
                        header,
                        payload,
                        key=key,
                        payload_bytes=size,
                        ns_digest=ns,
                        cipher=self._cipher,
                        into=into,
                    )
        except CorruptBlockError as exc:
            corrupt.append(self._name_of(key))
            return f"corrupt block: {exc}"
        return ""

    def _sealing_buffers(self) -> list[memoryview]:
        """This I/O thread's buffers for one pipeline's sealed payloads
        (``block_bytes + TAG_BYTES`` each), made on its first call."""
        buffers: list[memoryview] | None = getattr(self._seal_buffers, "views", None)
        if buffers is None:
            stride = self.block_bytes + TAG_BYTES
            arena = memoryview(bytearray(self._blocks_per_pipeline * stride))
            buffers = [
                arena[i * stride : (i + 1) * stride] for i in range(self._blocks_per_pipeline)
            ]
            self._seal_buffers.views = buffers
        return buffers

    def _usage_hop(self) -> dict[str, int] | _ClientError:
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
        except _CLIENT_ERRORS as exc:
            return _detached(exc)
        return {
            "used_bytes": sum(int(node.get("used_memory", 0)) for node in memory),
            "capacity_bytes": sum(int(node.get("maxmemory", 0)) for node in memory),
            "server_keys": int(keys),
        }

    def _exists_hop(self, keys: Sequence[bytes]) -> list[int]:
        """``EXISTS`` of every key in one pipelined round trip."""
        pipe = self._connected().pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._name_of(key))
        return pipe.execute()

    def _connected(self) -> redis.Redis | RedisCluster:
        """The tier's client, made now if this is the first call that needs it.

        Raises:
            RedisConnectionError: the tier is closed.
            RedisClusterException: no node of the cluster answered.
        """
        with self._client_lock:
            if self._client is None:
                if not self._serving:
                    raise RedisConnectionError("the redis tier is closed")
                self._client = self._new_client(cluster=self.cluster)
            return self._client

    def _new_client(self, *, cluster: bool) -> redis.Redis | RedisCluster:
        options: dict[str, Any] = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            "max_connections": self.max_connections,
            "decode_responses": False,
            **self._tls,
        }
        if cluster:
            return RedisCluster.from_url(self._url, **options)
        return redis.Redis.from_url(self._url, **options)

    # -- internals --------------------------------------------------------------------

    def _name_of(self, key: bytes) -> bytes:
        return self._prefix + key

    def _remember(self, key: OffloadKey, present: bool) -> None:
        ttl = self.presence_ttl_s if present else self.absence_ttl_s
        presence = self._presence
        old = presence.get(key)
        self._known_present += present - (old is not None and old[0])
        presence[key] = (present, time.monotonic() + ttl)
        presence.move_to_end(key)
        if len(presence) > self.presence_entries:
            _, (dropped, _) = presence.popitem(last=False)
            self._known_present -= dropped

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
                except _UNREACHABLE as exc:
                    self._unreachable("lookup", exc)
                    return
                except _CLIENT_ERRORS as exc:
                    logger.debug("redis tier: presence check refused: %r", exc)
                    return
                self.breaker.succeeded()
                self._counters["lookup_round_trips"] += 1
                for key, count in zip(batch, found, strict=True):
                    self._remember(key, bool(count))
                self._in_check.clear()
        finally:
            self._checking = False
            self._in_check.clear()
            if self.breaker.state is not BreakerState.CLOSED:
                self._to_check.clear()  # lookups answer False until the server is back

    def _call_failed(
        self, job: JobMetadata, keys: list[bytes], what: str, error: BaseException
    ) -> JobResult:
        if isinstance(error, _UNREACHABLE):
            self._unreachable(what, error)
            return JobResult(job.job_id, False, tuple(keys), f"redis unreachable: {error}")
        self._failures.record(f"redis refused a {what}", len(keys), str(error))
        return JobResult(job.job_id, False, tuple(keys), f"redis refused the {what}: {error}")

    async def _watch_usage(self) -> None:
        """Read the server's usage now and every ``usage_every_s`` while the tier runs
        (skipped while the breaker is open)."""
        while self._serving:
            if self.breaker.state is BreakerState.CLOSED:
                usage = await self.run_blocking(self._usage_hop)
                if isinstance(usage, dict):
                    self._server_usage = usage
            await asyncio.sleep(self.usage_every_s)

    def _refused(self, job: JobMetadata, keys: list[bytes]) -> JobResult:
        self._failures.record("redis unreachable (circuit open)", len(keys))
        return JobResult(
            job.job_id, False, tuple(keys), "redis unreachable: circuit open, retrying later"
        )

    def _unreachable(self, what: str, exc: BaseException) -> None:
        self._counters["unreachable_calls"] += 1
        self.breaker.failed()
        self._failures.record(f"redis unreachable during {what}", 1, type(exc).__name__)


def _tls_options(
    url: str, ca_file: str | None, cert_file: str | None, key_file: str | None
) -> dict[str, str]:
    """redis-py's TLS arguments from the tier's options, each checked.

    Raises:
        InvalidArgumentError: an option is not a readable file, or is given with a url
            that is not ``rediss://``.
    """
    given = {"tls_ca_file": ca_file, "tls_cert_file": cert_file, "tls_key_file": key_file}
    options = {}
    for name, path in given.items():
        if path is None:
            continue
        if not url.startswith("rediss://"):
            raise InvalidArgumentError(f"{name} needs a rediss:// url (TLS), got {path!r}")
        if not isinstance(path, str) or not os.path.isfile(path):
            raise InvalidArgumentError(f"{name} must name a readable file, got {path!r}")
        options[{"tls_ca_file": "ssl_ca_certs", "tls_cert_file": "ssl_certfile",
                 "tls_key_file": "ssl_keyfile"}[name]] = path  # fmt: skip
    return options


def _detached(exc: _ClientError) -> _ClientError:
    """A copy of ``exc`` with no traceback, no chained errors and no quoted command.

    The frames of a traceback (down in the client) hold the hop's views and replies,
    whole pipelines of block bytes, which must not outlive the job; and a pipeline's
    error quotes the command that failed, block bytes again, which have no place in a
    job's error.
    """
    args = list(exc.args)
    if args and isinstance(args[0], str):
        args[0] = _QUOTED_COMMAND.sub("", args[0])
    try:
        return type(exc)(*args)
    except TypeError:  # a class whose constructor wants other arguments
        return RedisError(str(args[0]) if args else type(exc).__name__)


_QUOTED_COMMAND = re.compile(r"^Command # \d+ \(.*\) of pipeline caused error: ", re.DOTALL)


__all__ = ["RedisTier", "check_value", "encode_header", "open_value"]
