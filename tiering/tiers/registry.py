"""Secondary tiers by name (:func:`tier_factory`), and the bookkeeping replay's model of a
built-in tier (:func:`replay_model`); both import ``backends`` only on first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

from tiering.errors import ConfigError, InvalidArgumentError, UnknownTierError
from tiering.options import Options, Text
from tiering.tiers.tier_api import SecondaryTierManager
from tiering.validation import as_list

ENTRY_POINT_GROUP = "kv_tiering.tiers"

TierFactory = Callable[..., SecondaryTierManager]
"""Called as ``factory(primary_kv_view, block_bytes, **kwargs)``."""

TierSpec = str | Mapping[str, Any] | Callable[[memoryview, int], SecondaryTierManager]
"""A tier name, ``{"type": name, **kwargs}``, or ``factory(primary_kv_view, block_bytes)``."""

_BUILTINS: dict[str, str] = {
    "example": "backends.example:ExampleSecondaryTier",
    "memory": "backends.memory:MemoryTier",
    "nvme": "backends.nvme.tier:NVMeTier",
    "redis": "backends.redis.tier:RedisTier",
}
_REPLAY_MODELS: dict[str, str] = {"nvme": "backends.nvme.replay_model:SegmentLog"}
_REGISTERED: dict[str, TierFactory] = {}


def register_tier(name: str, factory: TierFactory) -> None:
    """Make ``factory`` buildable as ``name``, over a built-in or earlier one. Raises
    InvalidArgumentError if ``name`` is not a non-empty str or ``factory`` not callable."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"tier name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise InvalidArgumentError(f"factory for tier {name!r} is not callable: {factory!r}")
    _REGISTERED[name] = factory


def tier_names() -> list[str]:
    """Every name :func:`make_tier` accepts, sorted."""
    return sorted(
        {*_REGISTERED, *_BUILTINS, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))}
    )


def make_tier(
    spec: TierSpec,
    primary_kv_view: memoryview,
    block_bytes: int,
    *,
    defaults: Mapping[str, Any] | None = None,
) -> SecondaryTierManager:
    """A secondary tier over the host pool from a :data:`TierSpec`; a named tier's options
    go through :func:`check_options` (with ``defaults``: the engine's ``namespace``) first.
    Raises UnknownTierError (listing the known tiers) as :func:`tier_factory`, and
    InvalidArgumentError naming the tier and the option for a bad spec or option, or a
    factory that returned no SecondaryTierManager."""
    name, options, given = _parsed(spec, "tier spec")
    factory = tier_factory(name) if given is None else given
    try:
        if given is None:
            options = check_options(name, options, defaults=defaults)
        tier = factory(primary_kv_view, block_bytes, **options)
    except InvalidArgumentError as exc:
        if repr(name) in str(exc):
            raise
        raise InvalidArgumentError(f"tier {name!r}: {exc}") from exc
    except TypeError as exc:  # a factory without typed options, called with bad options
        raise InvalidArgumentError(f"tier {name!r}: bad options {sorted(options)}: {exc}") from exc
    if not isinstance(tier, SecondaryTierManager):
        raise InvalidArgumentError(
            f"factory for tier {name!r} returned {type(tier).__name__}, not a SecondaryTierManager"
        )
    return tier


def check_options(
    name: str, options: object, *, defaults: Mapping[str, Any] | None = None, where: str = ""
) -> dict[str, object]:
    """``options`` of the tier registered as ``name``, checked and converted by its typed
    options, with the ``defaults`` they declare where ``options`` leaves them out (a
    factory without typed options gets them as given, text read as TOML). Raises
    UnknownTierError as :func:`tier_factory`, InvalidArgumentError (ConfigError when
    ``where`` is given) naming ``where.option``, its value and the reason."""
    error = ConfigError if where else InvalidArgumentError
    if not isinstance(options, Mapping):
        raise error(
            f"{where or 'options'}: expected a mapping of tier options, got {options!r:.60}"
        )
    for key in options:
        if not isinstance(key, str) or key == "type":
            why = "the tier's type is given once" if key == "type" else "option names are str"
            raise error(f"{where}[{key!r}]: {why}")
    model = tier_options(name)
    if model is None:
        return {k: v.as_toml() if isinstance(v, Text) else v for k, v in options.items()}
    given = {k: v for k, v in (defaults or {}).items() if k in model.model_fields} | dict(options)
    checked = model.check(given, where=where, owner=f"tier {name!r}", error=error)
    return {key: getattr(checked, key) for key in given}


def tier_options(name: str) -> type[Options] | None:
    """The typed options of the tier registered as ``name``: its factory's ``Options``,
    or None for a factory that checks its own. Raises as :func:`tier_factory`."""
    factory = tier_factory(name)
    model = getattr(factory, "Options", None)
    return model if isinstance(model, type) and issubclass(model, Options) else None


def tier_specs(specs: object) -> list[TierSpec]:
    """``specs`` as a new list of tier specs (``secondary_tiers``). Raises
    InvalidArgumentError for one spec rather than a list, or a list holding a non-spec."""
    if isinstance(specs, str | bytes | Mapping) or callable(specs):
        raise InvalidArgumentError(
            f"secondary_tiers must be a list of tier specs, got one spec {specs!r:.60}; "
            "wrap it in a list"
        )
    out = as_list("secondary_tiers", specs, "tier specs")
    for i, spec in enumerate(out):
        _parsed(spec, f"secondary_tiers[{i}]")
    return out


def _parsed(spec: object, what: str) -> tuple[str, dict[str, Any], TierFactory | None]:
    """The tier name and options ``spec`` gives, and the factory if it is one. Raises
    InvalidArgumentError naming ``what`` for a spec of none of the three forms."""
    if isinstance(spec, str):
        return spec, {}, None
    if isinstance(spec, Mapping):
        options = dict(spec)
        name = options.pop("type", None)
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"{what} needs a 'type' naming the tier, got {name!r}")
        return name, options, None
    if callable(spec):
        return getattr(spec, "__qualname__", repr(spec)), {}, spec
    raise InvalidArgumentError(
        f"{what} must be a tier name, a mapping with a 'type' or a factory, got {spec!r:.60}"
    )


def tier_factory(name: str) -> TierFactory:
    """The factory (usually the tier class) under ``name``: registered ones first, then
    the built-ins, then entry points of the group ``kv_tiering.tiers``. Raises
    UnknownTierError if there is none or its module cannot be imported,
    InvalidArgumentError if its entry point is not callable."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTINS:
        return _imported(name, _BUILTINS[name])  # type: ignore[no-any-return]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            loaded = ep.load()
            if not callable(loaded):
                raise InvalidArgumentError(
                    f"entry point {ep.value!r} for tier {name!r} is not callable"
                )
            return loaded  # type: ignore[no-any-return]
    raise UnknownTierError(f"unknown tier {name!r}; known tiers: {tier_names()}")


def replay_model(name: str) -> Callable[..., Any]:
    """The class that models the built-in tier ``name`` in the bookkeeping replay
    (:class:`tiering.lab.replay.CacheModel`), built from the tier's layout. Raises
    UnknownTierError if ``name`` has none or its module cannot be imported."""
    if name not in _REPLAY_MODELS:
        raise UnknownTierError(
            f"tier {name!r} has no replay model; these do: {sorted(_REPLAY_MODELS)}"
        )
    return _imported(name, _REPLAY_MODELS[name])  # type: ignore[no-any-return]


def _imported(name: str, where: str) -> Any:
    """The attribute ``where`` (``module:attribute``) names, for the tier ``name``."""
    module, _, attribute = where.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except ImportError as exc:
        raise UnknownTierError(f"tier {name!r} ({where}) cannot be imported: {exc}") from exc
