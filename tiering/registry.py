"""Secondary tiers by name: built-ins, registered factories and installed entry points.

``tiering`` never imports ``backends`` at import time: built-in tiers are named by
import path and imported the first time :func:`make_tier` builds one. A name is
resolved in this order: :func:`register_tier` registrations, built-ins, then entry
points of the group ``kv_tiering.tiers`` (each loading to a factory).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from tiering.errors import InvalidArgumentError, UnknownTierError
from tiering.secondary import SecondaryTierManager

ENTRY_POINT_GROUP = "kv_tiering.tiers"

TierFactory = Callable[..., SecondaryTierManager]
"""Called as ``factory(primary_kv_view, block_bytes, **kwargs)``."""

TierSpec = str | Mapping[str, Any] | Callable[[memoryview, int], SecondaryTierManager]
"""A tier name, ``{"type": name, **kwargs}``, or ``factory(primary_kv_view, block_bytes)``."""

_BUILTINS: dict[str, str] = {
    "example": "backends.example:ExampleSecondaryTier",
    "memory": "backends.memory:MemoryTier",
    "nvme": "backends.nvme:NVMeTier",
    "redis": "backends.redis:RedisTier",
}
_REGISTERED: dict[str, TierFactory] = {}


def register_tier(name: str, factory: TierFactory) -> None:
    """Make ``factory`` buildable as ``name``; it replaces a built-in or earlier one.

    Raises:
        InvalidArgumentError: ``name`` is not a non-empty str or ``factory`` not callable.
    """
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"tier name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise InvalidArgumentError(f"factory for tier {name!r} is not callable: {factory!r}")
    _REGISTERED[name] = factory


def unregister_tier(name: str) -> None:
    """Forget a :func:`register_tier` registration (built-ins come back into view).

    Raises:
        UnknownTierError: nothing is registered under ``name``.
    """
    if _REGISTERED.pop(name, None) is None:
        raise UnknownTierError(f"no tier is registered under {name!r}")


def tier_names() -> list[str]:
    """Every name :func:`make_tier` accepts, sorted."""
    return sorted({*_REGISTERED, *_BUILTINS, *(ep.name for ep in _entry_points())})


def make_tier(
    spec: TierSpec,
    primary_kv_view: memoryview,
    block_bytes: int,
    *,
    defaults: Mapping[str, Any] | None = None,
) -> SecondaryTierManager:
    """Build a secondary tier over the host pool from a name, a mapping or a factory.

    ``spec`` is a tier name, a mapping ``{"type": name, **kwargs}`` (kwargs go to the
    tier's constructor), or a callable ``factory(primary_kv_view, block_bytes)``.
    ``defaults`` are keyword arguments a named tier receives when its constructor
    accepts them and the spec does not set them (the engine passes ``namespace``).

    Raises:
        UnknownTierError: no tier is known by that name (the message lists the known
            ones), or a built-in's module cannot be imported.
        InvalidArgumentError: ``spec`` has the wrong shape, the kwargs do not fit the
            tier's constructor or the tier rejects them (the message names the tier),
            or the factory returned something that is not a SecondaryTierManager.
    """
    if isinstance(spec, str):
        name, kwargs = spec, {}
        factory = tier_factory(name)
    elif isinstance(spec, Mapping):
        name, kwargs = _split_mapping(spec)
        factory = tier_factory(name)
    elif callable(spec):
        name, kwargs, factory = getattr(spec, "__qualname__", repr(spec)), {}, spec
    else:
        raise InvalidArgumentError(
            "tier spec must be a name, a mapping with a 'type' key, or a factory; "
            f"got {type(spec).__name__}"
        )
    if defaults and not callable(spec):
        kwargs = {**_accepted(factory, defaults), **kwargs}
    _check_signature(name, factory, primary_kv_view, block_bytes, kwargs)
    try:
        tier = factory(primary_kv_view, block_bytes, **kwargs)
    except InvalidArgumentError as exc:
        if repr(name) in str(exc):
            raise
        raise InvalidArgumentError(f"tier {name!r}: {exc}") from exc
    if not isinstance(tier, SecondaryTierManager):
        raise InvalidArgumentError(
            f"factory for tier {name!r} returned {type(tier).__name__}, not a SecondaryTierManager"
        )
    return tier


def _split_mapping(spec: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    kwargs = dict(spec)
    name = kwargs.pop("type", None)
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(
            f"tier spec mapping needs a 'type' naming the tier, got {spec.get('type')!r}"
        )
    bad_keys = [k for k in kwargs if not isinstance(k, str)]
    if bad_keys:
        raise InvalidArgumentError(f"tier {name!r}: option names must be str, got {bad_keys!r}")
    return name, kwargs


def tier_factory(name: str) -> TierFactory:
    """The factory (usually the tier class) registered under ``name``: registered
    ones first, then the built-ins, then ``kv_tiering.tiers`` entry points.

    Raises:
        UnknownTierError: nothing is registered under ``name``, or its module cannot be
            imported.
        InvalidArgumentError: its entry point is not callable.
    """
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTINS:
        module_name, _, attribute = _BUILTINS[name].partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UnknownTierError(
                f"tier {name!r} ({_BUILTINS[name]}) cannot be imported: {exc}"
            ) from exc
        factory: TierFactory = getattr(module, attribute)
        return factory
    for ep in _entry_points():
        if ep.name == name:
            loaded = ep.load()
            if not callable(loaded):
                raise InvalidArgumentError(
                    f"entry point {ep.value!r} for tier {name!r} is not callable"
                )
            return loaded  # type: ignore[no-any-return]
    raise UnknownTierError(f"unknown tier {name!r}; known tiers: {tier_names()}")


def _accepted(factory: TierFactory, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options ``factory`` names as keyword parameters."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    return {k: v for k, v in options.items() if k in parameters}


def _check_signature(
    name: str,
    factory: TierFactory,
    primary_kv_view: memoryview,
    block_bytes: int,
    kwargs: dict[str, Any],
) -> None:
    """Reject kwargs the factory cannot take before calling it (clear error, no side effects)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # no introspectable signature: the call itself will tell
    try:
        signature.bind(primary_kv_view, block_bytes, **kwargs)
    except TypeError as exc:
        raise InvalidArgumentError(f"tier {name!r}: bad options {sorted(kwargs)}: {exc}") from exc


def _entry_points() -> tuple[EntryPoint, ...]:
    return tuple(entry_points(group=ENTRY_POINT_GROUP))


__all__ = [
    "ENTRY_POINT_GROUP",
    "TierFactory",
    "TierSpec",
    "make_tier",
    "register_tier",
    "tier_factory",
    "tier_names",
    "unregister_tier",
]
