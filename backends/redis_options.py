"""The Redis tier's options (:class:`RedisOptions`, for ``"redis"``), read by the registry
and the config.

The tier's constructor still checks its arguments itself, and alone checks the url's
syntax (with redis-py's parser); it is to take this model instead (``Options =
RedisOptions``, the url check moving into it), and its hand-written checks go.
"""

from __future__ import annotations

import os
from typing import Annotated, Self

from pydantic import AfterValidator, Field, model_validator

from tiering.encryption import Keyring
from tiering.options import ActorOptions, PositiveInt, Seconds, SecondsOrZero, secret

MAX_TENANT_BYTES = 0xFFFF  # the block record's limit on a tenant's bytes


def _tenant(tenant: str) -> str:
    if ":" in tenant:
        raise ValueError("must not hold ':'")
    if len(tenant.encode()) > MAX_TENANT_BYTES:
        raise ValueError(f"must be at most {MAX_TENANT_BYTES} bytes (UTF-8)")
    return tenant


def _redis_url(url: str) -> str:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("must be a redis://, rediss:// or unix:// URL")
    return url


def _readable_file(path: str | None) -> str | None:
    if path is not None and not os.path.isfile(path):
        raise ValueError("must name a readable file")
    return path


_File = Annotated[str | None, AfterValidator(_readable_file)]


class RedisOptions(ActorOptions):
    """The Redis tier's options (docs/redis.md). ``url`` is never shown in an error: it
    may hold a password."""

    url: Annotated[str, AfterValidator(_redis_url)] = secret()
    namespace: str = Field(min_length=1)
    tenant: Annotated[str, AfterValidator(_tenant)] = ""
    timeout_s: Seconds = 5.0
    max_connections: PositiveInt = 32
    ttl_s: Seconds | None = None
    presence_ttl_s: SecondsOrZero = 30.0
    absence_ttl_s: SecondsOrZero = 1.0
    presence_entries: PositiveInt = 1 << 20
    breaker_failures: PositiveInt = 3
    breaker_backoff_s: Seconds = 1.0
    breaker_max_backoff_s: Seconds = 30.0
    tls_ca_file: _File = None
    tls_cert_file: _File = None
    tls_key_file: _File = None
    usage_every_s: Seconds = 5.0
    cluster: bool = False
    pipeline_bytes: PositiveInt = 2 << 20
    encryption: str | Keyring | None = secret(None)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        """The checks across options."""
        if self.url.startswith("unix://") and self.cluster:
            raise ValueError("cluster needs a redis:// or rediss:// url, not unix://")
        if self.breaker_max_backoff_s < self.breaker_backoff_s:
            raise ValueError(
                f"breaker_max_backoff_s = {self.breaker_max_backoff_s!r} is below "
                f"breaker_backoff_s = {self.breaker_backoff_s!r}"
            )
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            if getattr(self, name) is not None and not self.url.startswith("rediss://"):
                raise ValueError(f"{name} needs a rediss:// url (TLS)")
        return self


__all__ = ["MAX_TENANT_BYTES", "RedisOptions"]
