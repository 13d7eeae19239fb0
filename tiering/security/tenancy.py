"""Tenants, sans-I/O: each tenant's blocks live under keys of its own,
``BLAKE2b(hash, key=BLAKE2b(tenant))``, except for a call's leading blocks the operator
shared (:meth:`Tenancy.share`); tenant ids never reach a key, an event or a metric
(docs/security.md#tenants)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tiering.core.scheduler_api import BlockHash
from tiering.errors import InvalidArgumentError
from tiering.validation import hash_list

MAX_TENANT_CHARS = 256
MAX_TENANT_LABELS = 1024  # tenants counted apart; later ones count as OTHER_TENANTS
OTHER_TENANTS = "other"
_TENANT_PERSON = b"kvtier.tenant"
_SCOPE_PERSON = b"kvtier.scope"
_LABEL_PERSON = b"kvtier.label"
_CACHED_TENANTS = 4096


@dataclass(slots=True)
class TenantLookups:
    """One tenant's ``engine.lookup`` calls, the hashes they named and how many of the
    leading ones hit (monotonic totals)."""

    lookups: int = 0
    blocks: int = 0
    hit_blocks: int = 0


def check_tenant(tenant: object) -> str | None:
    """``tenant`` if it is None or a tenant id (1 to 256 characters); else InvalidArgumentError."""
    if tenant is None or (isinstance(tenant, str) and 0 < len(tenant) <= MAX_TENANT_CHARS):
        return tenant
    raise InvalidArgumentError(
        f"tenant must be None or a string of 1 to {MAX_TENANT_CHARS} characters, got {tenant!r:.80}"
    )


def tenant_label(tenant: str) -> str:
    """The opaque label metrics use for ``tenant``: 16 hex digits of a BLAKE2b digest of
    the id (the same in every process; the id itself never shows)."""
    digest = hashlib.blake2b(tenant.encode("utf-8"), digest_size=8, person=_LABEL_PERSON)
    return digest.hexdigest()


class Tenancy:
    """The keys each tenant's blocks are stored under, and the ``shared_blocks`` every
    tenant may hit on (InvalidArgumentError if not bytes hashes)."""

    __slots__ = ("_secrets", "_shared")

    def __init__(self, shared_blocks: Iterable[BlockHash] = ()) -> None:
        self._shared: set[bytes] = set(hash_list("shared_blocks", shared_blocks))
        self._secrets: dict[str, bytes] = {}

    def share(self, block_hashes: Iterable[BlockHash]) -> None:
        """Let every tenant hit on these blocks of a public prefix (InvalidArgumentError,
        sharing nothing, for bad hashes)."""
        self._shared.update(hash_list("block_hashes", block_hashes))

    def keys(self, block_hashes: Sequence[BlockHash], tenant: str | None) -> Sequence[BlockHash]:
        """The keys ``tenant``'s blocks live under (see the module docstring); the
        caller has checked ``block_hashes``."""
        if tenant is None:
            return block_hashes
        secret = self._secrets.get(tenant)
        if secret is None:
            if len(self._secrets) >= _CACHED_TENANTS:
                self._secrets.clear()
            secret = hashlib.blake2b(
                tenant.encode("utf-8"), digest_size=32, person=_TENANT_PERSON
            ).digest()
            self._secrets[tenant] = secret
        shared, blake2b = self._shared, hashlib.blake2b
        keys: list[BlockHash] = []
        public = bool(shared)
        for h in block_hashes:
            public = public and h in shared
            if not public:
                h = blake2b(h, digest_size=32, key=secret, person=_SCOPE_PERSON).digest()
            keys.append(h)
        return keys


def tenant_keys(
    block_hashes: Sequence[BlockHash], tenant: str | None, shared_blocks: Iterable[BlockHash] = ()
) -> list[BlockHash]:
    """The keys an engine stores ``tenant``'s blocks under (for a router matching KV events
    against a tenant's prompts); InvalidArgumentError for a bad tenant or hashes."""
    hashes = hash_list("block_hashes", block_hashes)
    return list(Tenancy(shared_blocks).keys(hashes, check_tenant(tenant)))
