"""The Redis tier's options (docs/redis.md) and its url: checked at construction (by
redis-py's parser too), made into its own connections' endpoint and redis-py clients.
"""

from __future__ import annotations

import inspect
import os
import ssl
import urllib.parse
from typing import Annotated, Any, Self

from pydantic import AfterValidator, Field, model_validator
from redis.backoff import NoBackoff
from redis.connection import (
    URL_QUERY_ARGUMENT_PARSERS,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.retry import Retry

from backends.breaker import BreakerOptions
from backends.redis.connection import Endpoint
from backends.redis.control import Redis, RedisCluster
from tiering.errors import InvalidArgumentError
from tiering.options import ActorOptions, Bytes, PositiveInt, Seconds, SecondsOrZero, secret
from tiering.security.encryption import Keyring
from tiering.tiers.block_record import MAX_TENANT_BYTES

# The tier's TLS options, and redis-py's names of them.
_TLS_FILES = {
    "tls_ca_file": "ssl_ca_certs", "tls_cert_file": "ssl_certfile", "tls_key_file": "ssl_keyfile",
}  # fmt: skip
# Query options the tier sets from one of its own options.
_TIER_SETS = {
    "socket_timeout": "timeout_s", "socket_connect_timeout": "timeout_s",
    "max_connections": "max_connections", "retry_on_timeout": "timeout_s",
    "retry_on_error": "timeout_s", **{name: option for option, name in _TLS_FILES.items()},
}  # fmt: skip
# The query options the tier's own connections implement (it refuses every other one).
_IMPLEMENTED = (
    "db", "username", "password", "client_name", "socket_keepalive", "ssl_check_hostname",
)  # fmt: skip


# The query options redis-py takes: names safe to show (any other may be a piece of a
# password that spilled into the query).
_REDIS_PY_NAMES = {*URL_QUERY_ARGUMENT_PARSERS} | {
    name
    for kind in (SSLConnection, UnixDomainSocketConnection)
    for cls in kind.__mro__
    if "__init__" in vars(cls)
    for name in inspect.signature(cls.__init__).parameters
    if name not in ("self", "args", "kwargs")
}


def _url_problem(url: str, *, cluster: bool) -> str | None:
    """What is wrong with ``url``, in words that quote no part of it; None if nothing."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
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
    if parts.scheme == "unix" and not parts.path:
        return "a unix:// url needs the path of the server's socket"
    database = urllib.parse.unquote(parts.path).strip("/")
    if parts.scheme != "unix" and database and not database.isdigit():
        return "its path must be the database number (/0, /1, ...) or nothing"
    # A query option the tier refuses (named only if redis-py takes it).
    for name, (value, *_) in urllib.parse.parse_qs(parts.query).items():
        if name not in _REDIS_PY_NAMES:
            return "its query has an option redis-py does not take"
        if name in _TIER_SETS:
            return f"its query sets {name}, which the tier sets from {_TIER_SETS[name]}"
        if name not in _IMPLEMENTED:
            takes = ", ".join(_IMPLEMENTED)
            return (
                f"its query option {name} is not implemented by the redis tier (it takes {takes})"
            )
        try:
            URL_QUERY_ARGUMENT_PARSERS.get(name, str)(value)
        except (TypeError, ValueError):
            return f"its query option {name} has an invalid value"
        if name == "socket_keepalive" and parts.scheme == "unix":
            return "its query option socket_keepalive needs a redis:// or rediss:// url"
        if name == "ssl_check_hostname" and parts.scheme != "rediss":
            return "its query option ssl_check_hostname needs a rediss:// url"
        if name == "client_name" and not all("!" <= c <= "~" for c in value):  # as Redis says
            return "its query option client_name must be printable ASCII without spaces"
    try:
        options = parse_url(url)  # the parser redis-py connects with
    except (TypeError, ValueError):
        return "redis-py cannot parse it"
    if cluster and options.get("db", 0) != 0:
        return "a Redis Cluster has database 0 only"
    return None


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
    """The Redis tier's options; ``url`` (it may hold a password) and ``encryption`` (a
    keyring or its spec) are never shown. A url the tier refuses (docs/redis.md) raises
    InvalidArgumentError saying why, never quoting it; the ``tls_*`` files go with
    ``rediss://`` only. ``namespace`` and ``tenant`` (no ``:``) are bound into every
    record: blocks under another never show."""

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
    # Two streams: their Python between syscalls contends for the GIL, and more threads
    # wait on each other (and the loop on them) more than they overlap; one leaves the
    # server idle while it lands a store's replies.
    io_threads: PositiveInt = 2

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.url.startswith("unix://") and self.cluster:
            raise InvalidArgumentError("cluster needs a redis:// or rediss:// url, not unix://")
        problem = _url_problem(self.url, cluster=self.cluster)
        if problem is not None:  # raised here, outside any handler: no parser error chained
            shown = "the url is not shown: it may hold a password"
            raise InvalidArgumentError(f"url: {problem} ({shown})")
        for name in _TLS_FILES:
            if getattr(self, name) is not None and not self.url.startswith("rediss://"):
                raise ValueError(f"{name} needs a rediss:// url (TLS)")
        return self

    def client(self, *, cluster: bool) -> Redis | RedisCluster:
        """A new redis-py client of ``url`` with these TLS files and pool bound, every
        socket operation timing out after ``timeout_s``; with ``cluster`` a cluster client
        that never retries (but follows MOVED, ASK and TRYAGAIN) and connects as it is
        made (raising the client's error if no node answers)."""
        tls = {arg: getattr(self, name) for name, arg in _TLS_FILES.items()}
        options: dict[str, Any] = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            "max_connections": self.max_connections,
            "decode_responses": False,
            **{arg: path for arg, path in tls.items() if path is not None},
        }
        if cluster:
            return RedisCluster.from_url(self.url, retry=Retry(NoBackoff(), 0), **options)
        return Redis.from_url(self.url, **options)

    def endpoint(self) -> Endpoint:
        """Where and how the tier's own connections reach ``url``, as redis-py's do:
        credentials, database, client name, TCP keepalive (unless ``socket_keepalive`` is
        false), and with ``rediss://`` a TLS context (verified against ``tls_ca_file`` or
        the system's CAs, host name checked unless ``ssl_check_hostname`` is false). It
        reads the TLS files (call it off the loop). Raises InvalidArgumentError naming a
        ``tls_*`` file that does not load."""
        options: dict[str, Any] = parse_url(self.url)
        kind = options.get("connection_class")
        context = None
        if kind is SSLConnection:
            try:
                context = ssl.create_default_context(cafile=self.tls_ca_file)
            except OSError as exc:
                raise InvalidArgumentError(f"tls_ca_file: its CAs do not load ({exc})") from None
            try:
                if self.tls_cert_file is not None:
                    context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
            except OSError as exc:
                raise InvalidArgumentError(
                    f"tls_cert_file, tls_key_file: the certificate and key do not load ({exc})"
                ) from None
            context.check_hostname = options.get("ssl_check_hostname", True) is not False
        return Endpoint(
            host=options.get("host", "localhost"),
            port=int(options.get("port", 6379)),
            path=options.get("path") if kind is UnixDomainSocketConnection else None,
            username=options.get("username"),
            password=options.get("password"),
            db=int(options.get("db", 0)),
            client_name=options.get("client_name"),
            tls=context,
            keepalive=options.get("socket_keepalive", True) is not False,
            timeout_s=self.timeout_s,
        )
