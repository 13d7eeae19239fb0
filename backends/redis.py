"""A remote tier on Redis or Valkey: one cache shared by every serving machine.

Each block is one Redis hash under one key, so its header and payload live in one slot
of a Redis Cluster too::

    key:    b"kvt:" + namespace digest (hex) + b":" + tenant + b":" + block hash
    fields: b"h" -> a compact header (magic, version 3, payload length, payload
                   checksum, namespace digest, the tenant and the key),
            b"p" -> the payload bytes

The header carries what :mod:`backends.nvme_format` carries for a block file, without
the page padding (Redis needs no aligned offsets), and the tenant besides: every record
is bound to its namespace, tenant and key, so a value moved to another key, tenant or
namespace never loads. A load verifies the header (magic, version, namespace, tenant,
key, length) and the payload's checksum before the CPU slot counts as loaded; a value
that fails, or that is no hash at all (another client wrote the key), is a failed key
and is deleted, never served, and the job's other keys land. Versions 1 and 2, from
before the tenant was in the header, read as corrupt: a miss.

With ``encryption`` (a keyring, :mod:`tiering.encryption`) every block is sealed with
AES-GCM under the keyring's current key, and its value takes format version 4::

    b"h" -> the same header, with version 4 and, in place of the payload checksum, the
            key id (u32) and the 12-byte nonce; no checksum of the plaintext (equal
            payloads would show as equal checksums)
    b"p" -> the ciphertext (as long as the payload), then the 16-byte GCM tag

The associated data is :func:`record_binding`: the namespace digest, the tenant and the
block's key, so a value copied to another block's key, tenant or namespace fails to
open, even under a header forged to match. A tier reads the format it writes and no
other: without ``encryption`` a sealed value is a corrupt block, and with it a plain
value is one too, so a tier that encrypts never serves bytes that did not authenticate.
A value sealed under a key id the keyring lacks, or that does not authenticate, is a
corrupt block as well: a failed key, deleted from the server, logged once per key id by
the cipher. Sealing and opening run on the I/O threads inside the job's hop; a load
decrypts straight into the CPU slot (a failed key's slot then holds garbage, as a
failed load's may).

The client (redis-py's synchronous one) runs on the tier's I/O threads, one hop per job:
it copies every value it sends and receives, which on the event loop measured a loop
lag p99 of 34-49 ms at 2 MiB blocks (docs/redis.md). An error reply to one key's
command (WRONGTYPE, OOM) fails that key only; a connection failure fails the call.

``lookup`` is synchronous and never waits on the network: it answers from a bounded
presence cache (present answers kept ``presence_ttl_s``, absent ones ``absence_ttl_s``)
and, for a key it has no fresh answer for, returns None ("ask again") and queues the
key for a batched check: one pipelined round trip of ``EXISTS`` for every key queued
meanwhile. A block another machine stored is therefore found one step later. A store
or load that fails (a key, or the whole call) drops the cached answers of its keys, so
the engine stores them again rather than trust a block the tier may not hold.

Every call has a timeout, ``timeout_s``, and is not retried, on one server or a
cluster. After ``breaker_failures`` connection failures in a row a
:class:`~backends.breaker.CircuitBreaker` opens: lookups answer False, stores and loads
fail at once, and a probe goes through after a back-off; the tier recovers by itself
when the server is back. Redis going away never takes the engine down.

Capacity is Redis's own: configure ``maxmemory`` with ``maxmemory-policy allkeys-lru``
on the server; ``ttl_s`` (optional) expires blocks after that many seconds. A block
evicted by the server between a lookup and a load is a failed key.

With ``cluster=True`` the tier talks to a Redis Cluster through redis-py's cluster
client: a job's pipeline is split by node, written to every node before any reply is
read, and a command redirected (MOVED, ASK) is sent again where the cluster says. A
node that does not answer fails the call within about ``timeout_s``. A job's blocks go
in pipelines of at most ``pipeline_bytes`` of payload each, so at most ``max_inflight *
pipeline_bytes`` payload bytes are in flight (and in the client's buffers) at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import struct
import threading
import time
import urllib.parse
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
    from redis.backoff import NoBackoff
    from redis.cluster import PipelineCommand, RedisCluster
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS, Connection, parse_url
    from redis.exceptions import (
        AskError,
        AuthenticationError,
        ClusterDownError,
        RedisClusterException,
        RedisError,
        ResponseError,
        TryAgainError,
    )
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without redis-py
    raise ImportError(
        "the redis tier needs redis-py (pip install 'kv-tiering[redis]'); "
        f"importing it failed: {type(exc).__name__}: {exc}"
    ) from exc

logger = logging.getLogger(__name__)

MAGIC = b"KVTRDS\r\n"
FORMAT_VERSION = 3
"""A plain block: the payload, and its checksum in the header. (Versions 1 and 2, from
before the tenant was bound into the record, read as corrupt.)"""
SEALED_VERSION = 4
"""An encrypted block: ciphertext and tag, the key id and nonce in the header."""
# magic, version, payload length, checksum (plain) or key id + nonce (sealed), namespace
# digest, tenant length, key length; then the tenant and the key
_FIXED = struct.Struct("<8sHxxQ16s16sHH")
_SEAL = struct.Struct("<I12s")  # a sealed header's 16 bytes in place of the checksum
_TRAILER = struct.Struct("<Q")  # xxh3_64 of everything before it
_BOUND = struct.Struct("<HH")  # tenant and key lengths, ahead of them in the binding
MAX_TENANT_BYTES = 0xFFFF
"""The longest tenant (UTF-8) a header can hold."""

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
_NODE_DOWN = (RedisConnectionError, RedisTimeoutError, ClusterDownError)
"""Replies of a cluster pipeline that mean the node, not the key, failed."""

# How a load or store of one key failed; the first words of its reason.
_MISSING = "not in the redis tier"
_CORRUPT = "corrupt block"
_REFUSED = "redis refused"


def record_binding(ns_digest: bytes, tenant: bytes, key: bytes) -> bytes:
    """What a block's record is bound to: its namespace digest, tenant and key (the
    associated data a sealed block is sealed with). Lengths go first, so no two
    (tenant, key) pairs give the same bytes."""
    return associated_data(ns_digest, _BOUND.pack(len(tenant), len(key)) + tenant + key)


def encode_header(
    *,
    key: bytes,
    tenant: bytes,
    payload_bytes: int,
    ns_digest: bytes,
    checksum: bytes | None = None,
    seal: Seal | None = None,
) -> bytes:
    """The compact header of one block value of ``tenant`` (``b""`` for none): a plain
    one (:data:`FORMAT_VERSION`) with the payload's ``checksum``, or a sealed one
    (:data:`SEALED_VERSION`) with ``seal``'s key id and nonce (its tag goes after the
    ciphertext, in the payload field).

    Raises:
        InvalidArgumentError: not exactly one of ``checksum`` and ``seal`` is given, or
            ``tenant`` is longer than :data:`MAX_TENANT_BYTES`.
    """
    if (checksum is None) == (seal is None):
        raise InvalidArgumentError("a block header takes a checksum or a seal, not both")
    if len(tenant) > MAX_TENANT_BYTES:
        raise InvalidArgumentError(f"tenant is {len(tenant)} bytes, at most {MAX_TENANT_BYTES}")
    if seal is None:
        version, field = FORMAT_VERSION, checksum
    else:
        version, field = SEALED_VERSION, _SEAL.pack(seal.key_id, seal.nonce)
    body = (
        _FIXED.pack(MAGIC, version, payload_bytes, field, ns_digest, len(tenant), len(key))
        + tenant
        + key
    )
    return body + _TRAILER.pack(xxhash.xxh3_64_intdigest(body))


def _check_header(
    header: bytes, *, key: bytes, tenant: bytes, payload_bytes: int, ns_digest: bytes
) -> tuple[int, bytes]:
    """The version and the 16-byte checksum-or-seal field of a header that verifies
    (its own checksum, magic, a known version, namespace, tenant, key and length).

    Raises:
        CorruptBlockError: saying which check failed.
    """
    if len(header) < _FIXED.size + _TRAILER.size:
        raise CorruptBlockError(f"header is {len(header)} bytes")
    body, (stored,) = header[: -_TRAILER.size], _TRAILER.unpack(header[-_TRAILER.size :])
    if xxhash.xxh3_64_intdigest(body) != stored:
        raise CorruptBlockError("header checksum mismatch")
    magic, version, length, field, ns, tenant_len, key_len = _FIXED.unpack_from(body, 0)
    if magic != MAGIC or version not in (FORMAT_VERSION, SEALED_VERSION):
        raise CorruptBlockError("not a block value of this format")
    if ns != ns_digest:
        raise CorruptBlockError("block belongs to another namespace")
    if len(body) != _FIXED.size + tenant_len + key_len:
        raise CorruptBlockError("header lengths do not add up")
    if body[_FIXED.size : _FIXED.size + tenant_len] != tenant:
        raise CorruptBlockError("block belongs to another tenant")
    if body[_FIXED.size + tenant_len :] != key:
        raise CorruptBlockError("block holds another key")
    if length != payload_bytes:
        raise CorruptBlockError(f"block is of {length} bytes, expected {payload_bytes}")
    return version, field


def check_value(
    header: bytes,
    payload: bytes,
    *,
    key: bytes,
    tenant: bytes,
    payload_bytes: int,
    ns_digest: bytes,
) -> None:
    """Verify one plain block value of ``tenant`` read back (call it off the loop: it
    hashes the payload).

    Raises:
        CorruptBlockError: the header is damaged or of another format or version, names
            another namespace, tenant, key or length, the value is encrypted (this
            reader has no keys: never serve ciphertext), or the payload's checksum
            differs. The message says which.
    """
    version, checksum = _check_header(
        header, key=key, tenant=tenant, payload_bytes=payload_bytes, ns_digest=ns_digest
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
    tenant: bytes,
    payload_bytes: int,
    ns_digest: bytes,
    cipher: BlockCipher,
    into: memoryview,
) -> None:
    """Verify one sealed block value of ``tenant`` read back and decrypt its payload
    into ``into`` (``payload_bytes`` long). Blocking: call it off the loop.

    ``into`` holds the plaintext only if this returns; after a failure its bytes are
    garbage (never to be served: the key has failed).

    Raises:
        CorruptBlockError: the header is damaged or of another format or version, names
            another namespace, tenant, key or length, or the value is not encrypted (a
            tier that encrypts serves nothing unauthenticated);
            :class:`~tiering.encryption.UnknownKeyError` (the keyring lacks its key id)
            or :class:`~tiering.encryption.AuthenticationError` (a wrong key, altered
            or moved bytes), both CorruptBlockErrors, from the cipher, which logs each
            once per key id.
    """
    version, field = _check_header(
        header, key=key, tenant=tenant, payload_bytes=payload_bytes, ns_digest=ns_digest
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
        cipher.open_into(seal, view, record_binding(ns_digest, tenant, key), into)


class RedisTier(TierActor):
    """A secondary tier on a Redis (or Valkey) server, shared by many engines.

    Args:
        primary_kv_view, block_bytes: as every tier.
        url: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS) or
            ``unix://``, checked here with redis-py's own parser (a '/', '?', '#' or
            '@' in the user name or password percent-encoded; no query option the tier
            sets itself, such as ``socket_timeout``); never logged or shown.
        namespace: what the blocks' bytes mean (the engine passes its cache identity);
            two namespaces on one server never see each other's blocks.
        tenant: an optional prefix that isolates tenants sharing a namespace, bound
            into every record like the namespace.
        timeout_s: the limit of every call to the server (none is retried).
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

    Guarantees: a load serves a block only if its header (namespace, tenant, key) and
    checksum verify (with ``encryption``: its header verifies and it authenticates under
    the keyring, and a plain block is never served); a key the server refuses, or that
    holds no block, fails alone; a connection failure fails the job's keys (never the
    engine), within about ``timeout_s``; ``lookup`` never blocks, and forgets what it
    knew of a key whose store or load failed (it asks the server again). Key material
    never shows in ``repr``, statistics, errors or logs.

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
        if not isinstance(namespace, str) or not namespace:
            raise InvalidArgumentError(f"namespace must be a non-empty str, got {namespace!r}")
        if not isinstance(tenant, str) or ":" in tenant:
            raise InvalidArgumentError(f"tenant must be a str without ':', got {tenant!r}")
        if len(tenant.encode()) > MAX_TENANT_BYTES:
            raise InvalidArgumentError(f"tenant must be at most {MAX_TENANT_BYTES} bytes (UTF-8)")
        if not isinstance(cluster, bool):
            raise InvalidArgumentError(f"cluster must be a bool, got {cluster!r}")
        _check_url(url, cluster=cluster)
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
        self._tenant = tenant.encode()
        self._ns_digest = namespace_digest(namespace)
        self._prefix = b"kvt:" + self._ns_digest.hex().encode() + b":" + self._tenant + b":"
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
        if not isinstance(outcome, tuple):
            return self._call_failed(job, keys, "store", outcome)
        failed, pipelines = outcome
        self.breaker.succeeded()
        for key in keys:
            if key in failed:
                self._forget(key)
            else:
                self._learned(key, True)
        self._counters["stored_blocks"] += len(keys) - len(failed)
        self._counters["pipelines"] += pipelines
        if not failed:
            return JobResult(job.job_id, True)
        first = next(iter(failed.values()))
        self._failures.record("redis refused a block's store", len(failed), first)
        return JobResult(job.job_id, False, tuple(failed), f"{len(failed)} keys failed: {first}")

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
        corrupt = missing = 0
        for key in keys:
            why = failed.get(key)
            if why is None:
                self._learned(key, True)
            elif why.startswith(_REFUSED):
                self._forget(key)  # the server would not say: no answer kept
            else:  # absent, or corrupt and deleted
                self._learned(key, False)
                corrupt += why.startswith(_CORRUPT)
                missing += why.startswith(_MISSING)
        refused = len(failed) - corrupt - missing
        self._counters["loaded_blocks"] += len(keys) - len(failed)
        self._counters["corrupt_blocks"] += corrupt
        self._counters["missing_blocks"] += missing
        if refused:
            first_refusal = next(why for why in failed.values() if why.startswith(_REFUSED))
            self._failures.record("redis refused a block's load", refused, first_refusal)
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

    def _store_hop(
        self, keys: Sequence[bytes], block_ids: Sequence[int]
    ) -> tuple[dict[bytes, str], int] | _ClientError:
        """Write every block (header, then the payload straight from its slot, or with
        ``encryption`` sealed into this thread's buffer) in pipelined round trips of at
        most ``pipeline_bytes``. Returns the keys the server refused, with why (a key
        that held a value of another type is deleted, so that its next store lands),
        and how many round trips it took; or the client's error if a call failed (the
        blocks before it are stored)."""
        slot, ns, tenant, size, cipher = (
            self.slot,
            self._ns_digest,
            self._tenant,
            self.block_bytes,
            self._cipher,
        )
        per_block = 1 if self.ttl_s is None else 2  # HSET, then EXPIRE
        views: list[memoryview] = []
        sealed = self._sealing_buffers() if cipher is not None else []
        failed: dict[bytes, str] = {}
        wrong_type: list[bytes] = []
        pipelines = 0
        try:
            client = self._connected()
            for start in range(0, len(keys), self._blocks_per_pipeline):
                stop = start + self._blocks_per_pipeline
                commands: list[tuple[Any, ...]] = []
                for i, (key, block_id) in enumerate(
                    zip(keys[start:stop], block_ids[start:stop], strict=True)
                ):
                    payload = slot(block_id)
                    views.append(payload)
                    if cipher is None:
                        value = payload
                        header = encode_header(
                            key=check_key(key),
                            tenant=tenant,
                            payload_bytes=size,
                            checksum=payload_checksum(payload),
                            ns_digest=ns,
                        )
                    else:
                        # The buffer is free again once the previous round trip
                        # returned: the client has sent it by then.
                        value = sealed[i]
                        binding = record_binding(ns, tenant, check_key(key))
                        seal = cipher.seal_into(payload, value, binding)
                        header = encode_header(
                            key=key, tenant=tenant, payload_bytes=size, seal=seal, ns_digest=ns
                        )
                    name = self._name_of(key)
                    commands.append(("HSET", name, HEADER_FIELD, header, PAYLOAD_FIELD, value))
                    if self.ttl_s is not None:
                        commands.append(("EXPIRE", name, max(1, round(self.ttl_s))))
                replies = _round_trip(client, commands)
                pipelines += 1
                for i, key in enumerate(keys[start:stop]):
                    error = _first_error(replies[i * per_block : (i + 1) * per_block])
                    if error is not None:
                        failed[key] = f"{_REFUSED} the store: {error}"
                        if _holds_another_type(error):
                            wrong_type.append(self._name_of(key))
                del commands, replies
        except _CLIENT_ERRORS as exc:
            return _detached(exc)
        finally:
            # The client's own frames, kept in reference cycles after an error, may
            # still name these views: released, they no longer pin the host pool.
            for view in views:
                view.release()
        self._delete(client, wrong_type)
        return failed, pipelines

    def _load_hop(
        self, keys: Sequence[bytes], block_ids: Sequence[int]
    ) -> tuple[list[str], int] | _ClientError:
        """Read every block in pipelined round trips of at most ``pipeline_bytes``,
        verify each and copy the good ones into their slots; delete the corrupt ones
        (and values of another type) from the server. Returns why each key failed (""
        for the ones that landed) and how many round trips it took, or the client's
        error."""
        reasons: list[str] = []
        corrupt: list[bytes] = []
        pipelines = 0
        try:
            client = self._connected()
            for start in range(0, len(keys), self._blocks_per_pipeline):
                stop = start + self._blocks_per_pipeline
                commands = [
                    ("HMGET", self._name_of(key), HEADER_FIELD, PAYLOAD_FIELD)
                    for key in keys[start:stop]
                ]
                values = _round_trip(client, commands)
                pipelines += 1
                for key, block_id, value in zip(
                    keys[start:stop], block_ids[start:stop], values, strict=True
                ):
                    reasons.append(self._land(key, block_id, value, corrupt))
                del values  # a whole pipeline of block bytes: not kept past its turn
        except _CLIENT_ERRORS as exc:
            return _detached(exc)
        self._delete(client, corrupt)
        return reasons, pipelines

    def _delete(self, client: redis.Redis | RedisCluster, names: list[bytes]) -> None:
        """Delete ``names`` (values that are no blocks of this tier) from the server, as
        far as it goes: a failure is logged, and the next load of each fails again."""
        if not names:
            return
        try:
            client.delete(*names)
        except _CLIENT_ERRORS as exc:  # the job's other keys still count
            logger.debug("redis tier: deleting corrupt blocks failed: %r", _detached(exc))

    def _land(
        self,
        key: bytes,
        block_id: int,
        value: list[bytes | None] | ResponseError | None,
        corrupt: list[bytes],
    ) -> str:
        """Verify one value read back and copy it into its slot: "" if it landed, else
        why not (a corrupt one's name is added to ``corrupt``)."""
        if isinstance(value, ResponseError):
            if not _holds_another_type(value):
                return f"{_REFUSED} the load: {value}"
            corrupt.append(self._name_of(key))
            return f"{_CORRUPT}: the key holds no block ({value})"
        header, payload = value if value else (None, None)
        if header is None or payload is None:
            return _MISSING
        size, ns, tenant = self.block_bytes, self._ns_digest, self._tenant
        try:
            if self._cipher is None:
                check_value(
                    header, payload, key=key, tenant=tenant, payload_bytes=size, ns_digest=ns
                )
                self.slot(block_id)[:] = payload
            else:
                with self.slot(block_id) as into:  # decrypted in place: no copy
                    open_value(
                        header,
                        payload,
                        key=key,
                        tenant=tenant,
                        payload_bytes=size,
                        ns_digest=ns,
                        cipher=self._cipher,
                        into=into,
                    )
        except CorruptBlockError as exc:
            corrupt.append(self._name_of(key))
            return f"{_CORRUPT}: {exc}"
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

    def _exists_hop(self, keys: Sequence[bytes]) -> list[int | ResponseError]:
        """``EXISTS`` of every key in one pipelined round trip (an error reply in the
        place of a key the server would not answer for)."""
        return _round_trip(self._connected(), [("EXISTS", self._name_of(key)) for key in keys])

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
            # No retries: with redis-py's, a call to a node that stops answering took
            # several timeouts and back-offs (docs/redis.md). Redirections (MOVED, ASK)
            # are no retries: they are followed all the same.
            return RedisCluster.from_url(self._url, retry=Retry(NoBackoff(), 0), **options)
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

    def _learned(self, key: OffloadKey, present: bool) -> None:
        """Remember what a store or load just found of ``key``. A presence check on the
        wire now may have read the server before that: its answer for ``key`` is
        dropped."""
        self._in_check.discard(key)
        self._remember(key, present)

    def _forget(self, key: OffloadKey) -> None:
        """Drop the cached answer for ``key`` (and a check's on the wire now): a lookup
        asks the server again (the engine then stores a block the tier is not known to
        hold)."""
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
                except _UNREACHABLE as exc:
                    self._unreachable("lookup", exc)
                    return
                except _CLIENT_ERRORS as exc:
                    logger.debug("redis tier: presence check refused: %r", exc)
                    return
                self.breaker.succeeded()
                self._counters["lookup_round_trips"] += 1
                in_check = self._in_check
                for key, count in zip(batch, found, strict=True):
                    if key in in_check:  # else a store or load has answered since
                        # An error reply (the server would not say) reads as absent.
                        self._remember(key, isinstance(count, int) and count > 0)
                self._in_check.clear()
        finally:
            self._checking = False
            self._in_check.clear()
            if self.breaker.state is not BreakerState.CLOSED:
                self._to_check.clear()  # lookups answer False until the server is back

    def _call_failed(
        self, job: JobMetadata, keys: list[bytes], what: str, error: BaseException
    ) -> JobResult:
        for key in keys:  # whatever the server holds now, the cache no longer knows
            self._forget(key)
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
        for key in keys:
            self._forget(key)
        self._failures.record("redis unreachable (circuit open)", len(keys))
        return JobResult(
            job.job_id, False, tuple(keys), "redis unreachable: circuit open, retrying later"
        )

    def _unreachable(self, what: str, exc: BaseException) -> None:
        self._counters["unreachable_calls"] += 1
        self.breaker.failed()
        self._failures.record(f"redis unreachable during {what}", 1, type(exc).__name__)


_TIER_SETS = {
    "socket_timeout": "timeout_s",
    "socket_connect_timeout": "timeout_s",
    "max_connections": "max_connections",
    "retry_on_timeout": "timeout_s",
    "retry_on_error": "timeout_s",
}
"""Query options of a url that the tier sets itself, and the tier option that does."""


def _check_url(url: object, *, cluster: bool) -> None:
    """Check that redis-py will connect with ``url`` as the tier means it to.

    Raises:
        InvalidArgumentError: ``url`` is not a str of the redis://, rediss:// or
            unix:// scheme, or redis-py's parser refuses it, or it says something the
            tier would silently get wrong (a path that is no database number, a query
            option the tier sets itself, a database other than 0 for a cluster); or
            ``cluster`` is given with a unix:// url. The message names ``url`` and what
            is wrong, and never quotes the url or any part of it (it may hold a
            password).
    """
    if isinstance(url, str) and url.startswith("unix://") and cluster:
        raise InvalidArgumentError("cluster needs a redis:// or rediss:// url, not unix://")
    problem = _url_problem(url, cluster=cluster)
    if problem is not None:  # raised here, outside any handler: no parser error chained
        raise InvalidArgumentError(f"url: {problem} (the url is not shown: it may hold a password)")


def _url_problem(url: object, *, cluster: bool) -> str | None:
    """What is wrong with ``url`` (see :func:`_check_url`), in words that quote no part
    of it; None if nothing is."""
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        return "must be a redis://, rediss:// or unix:// URL"
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # its message may quote a piece of the url
        return "its host cannot be parsed"
    try:
        port = None if parts.scheme == "unix" else parts.port
    except ValueError:  # its message quotes the port, which may be a piece of a password
        return (
            "its port is not a number from 1 to 65535 (a '/', '?' or '#' in the user "
            "name or password must be percent-encoded: %2F, %3F, %23)"
        )
    # A password always comes before an '@': with one after the host (or a fragment),
    # part of the credentials spilled into the path, query or fragment.
    if "#" in url or "@" in parts.path + parts.query:
        return (
            "it holds an unescaped '/', '?', '#' or '@' after the user name or password "
            "(percent-encode them: %2F, %3F, %23, %40)"
        )
    if port == 0:
        return "its port is not a number from 1 to 65535"
    if parts.scheme == "unix":
        if not parts.path:
            return "a unix:// url needs the path of the server's socket"
    else:
        database = urllib.parse.unquote(parts.path).strip("/")
        if database and not database.isdigit():
            return "its path must be the database number (/0, /1, ...) or nothing"
    for name, values in urllib.parse.parse_qs(parts.query).items():
        if name in _TIER_SETS:
            return f"its query sets {name}, which the tier sets from {_TIER_SETS[name]}"
        parse = URL_QUERY_ARGUMENT_PARSERS.get(name)  # a name redis-py knows: safe to show
        try:
            if parse is not None:
                parse(values[0])
        except (TypeError, ValueError):
            return f"its query option {name} has an invalid value"
    try:
        options = parse_url(url)  # the parser redis-py connects with
    except (TypeError, ValueError):
        return "redis-py cannot parse it"
    if cluster and options.get("db", 0) != 0:
        return "a Redis Cluster has database 0 only"
    connection_class = options.pop("connection_class", Connection)
    try:
        connection_class(**options)  # builds the connection redis-py would, unconnected
    except (TypeError, ValueError, RedisError):
        return "its query has an option redis-py does not take, or an invalid value"
    return None


def _round_trip(
    client: redis.Redis | RedisCluster, commands: Sequence[tuple[Any, ...]]
) -> list[Any]:
    """Send ``commands`` pipelined (one round trip, or one per node of a cluster) and
    read every reply, once. An error reply to one command (the server refusing that
    key: WRONGTYPE, OOM) comes back in its place; a cluster's redirection (MOVED, ASK,
    TRYAGAIN) is followed by sending that command again on its own.

    Raises:
        what the client raises (a RedisError or RedisClusterException) when a connection
        fails or times out or the cluster is down. Nothing is retried, so a call ends
        within about the socket timeout; a cluster client first refreshes its map of
        the slots (as redis-py does), so a failed-over node is found.
    """
    if not isinstance(client, RedisCluster):
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        replies = pipe.execute(raise_on_error=False)
    else:
        # Not the pipeline's own execute: after a node timed out it sends each of that
        # node's commands again on its own, each waiting for its timeout. Without
        # redirections each node is written and read once, its errors left in place;
        # the redirected commands are sent again below.
        stack = [PipelineCommand(command, {}, i) for i, command in enumerate(commands)]
        pipe = client.pipeline(transaction=False)
        replies = pipe.send_cluster_commands(stack, raise_on_error=False, allow_redirections=False)
        down = next((reply for reply in replies if isinstance(reply, _NODE_DOWN)), None)
        if down is not None:
            _forget_frames(replies)
            try:
                client.nodes_manager.initialize()
            except _CLIENT_ERRORS as exc:  # the next call tries again
                logger.debug("redis tier: refreshing the cluster's slots failed: %r", exc)
            raise _detached(down)  # a copy: the original sits in the replies
        for i, reply in enumerate(replies):
            if isinstance(reply, (AskError, TryAgainError)):  # MovedError is an AskError
                try:
                    replies[i] = client.execute_command(*commands[i])
                except ResponseError as exc:
                    if isinstance(exc, ClusterDownError):
                        raise
                    replies[i] = exc
    _forget_frames(replies)
    return replies


def _forget_frames(replies: list[Any]) -> None:
    """Clear the tracebacks of error replies: their frames, down in the client, name the
    commands and with them views of the host pool, which must not outlive the call."""
    for reply in replies:
        if isinstance(reply, BaseException):
            reply.__traceback__ = None


def _first_error(replies: Sequence[Any]) -> ResponseError | None:
    """The first error reply of ``replies``, if any."""
    return next((reply for reply in replies if isinstance(reply, ResponseError)), None)


def _holds_another_type(error: ResponseError) -> bool:
    """The server refused a command because the key holds a value of another type (not
    a hash: another client wrote it): for this tier, a corrupt block."""
    return str(error).startswith("WRONGTYPE")


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
