"""The errors kv-tiering raises on purpose: each derives from :class:`TieringError` (a
serving framework catches one class) and from the builtin that fits (``KeyError``,
``ValueError``, ``RuntimeError``), so generic handlers keep working."""

from __future__ import annotations


class TieringError(Exception):
    """Base class of every error kv-tiering raises on purpose."""


class InvalidArgumentError(TieringError, ValueError):
    """An argument has the wrong type, value or shape; nothing was changed."""


class BlockNotFoundError(TieringError, KeyError):
    """A block hash is not stored (or not ready) where the call needs it; nothing was changed."""

    def __str__(self) -> str:  # KeyError's own quotes the message
        return str(self.args[0]) if self.args else "block not found"


class ConfigError(InvalidArgumentError):
    """A configuration (file, override or object) is invalid; nothing was applied. The
    message names the field's path (``tiers[0].capacity_bytes``) and any file, as
    ``field`` and ``source`` do."""

    def __init__(self, message: str, *, field: str = "", source: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.source = source


class UnknownPolicyError(InvalidArgumentError):
    """An eviction policy name that no policy is registered under."""


class UnknownTierError(InvalidArgumentError):
    """A secondary-tier type name that no tier is registered under."""


class NotLoadingError(InvalidArgumentError):
    """``complete_load`` named a block that has no reader; nothing was changed."""


class TierBusyError(TieringError, RuntimeError):
    """A tier's bounded inbox is full: back-pressure, try again after draining results."""


class ClosedError(TieringError, RuntimeError):
    """The engine or tier is closed (or not started) and accepts no more work."""


class TransferError(TieringError, RuntimeError):
    """A copy between tiers failed; the job that ran it reports failure."""


class CorruptBlockError(TieringError):
    """Bytes read from a tier failed verification (length, key or checksum); never served."""


class TraceError(InvalidArgumentError):
    """A trace file cannot be read, or one of its lines (named by number) is not a
    Mooncake trace record."""
