"""One typed configuration for an engine, its secondary tiers, a replay and its metrics.

A :class:`TieringConfig` is a tree of frozen dataclasses. It comes from a TOML file
(:func:`load_config`) or from code, optionally with command-line overrides applied
(:func:`with_overrides`; one ``--set section.field=value`` each, read by
:func:`parse_override`), and :func:`to_toml` writes one back. Every way in checks the
whole tree before anything is returned: a :class:`~tiering.errors.ConfigError` names the
field by its path (``engine.write_policy``, ``tiers[0].capacity_bytes``), the bad value
and, for a file, the file; a config is never half-applied. Tier options are checked
against the registered tier's constructor (names, annotated types, required options)
when the config is built, not when the engine opens. :func:`engine_from_config` (also
``TieringEngine.from_config``) builds the engine a config describes.

The file format and every field, with defaults: ``docs/config.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import re
import tomllib
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, NoneType, UnionType
from typing import Any, ClassVar, Literal, TypeVar

from tiering import registry
from tiering.cli_args import parse_size
from tiering.device import KVCaches, kv_block_bytes
from tiering.engine import TieringEngine
from tiering.errors import ConfigError, UnknownTierError
from tiering.policies import policy_names

SECTIONS = ("engine", "tiers", "replay", "synthetic", "metrics")
"""The top-level sections of a config file, in the order :func:`to_toml` writes them."""

_ENGINE_SUPPLIED = frozenset({"namespace"})
"""Tier options the engine passes itself when a spec leaves them out (see TierStack)."""

_NONE_WORDS = ("none", "")
"""Override text that unsets a field that may be None."""

_BOOL_WORDS = {
    "true": True,
    "yes": True,
    "on": True,
    "1": True,
    "false": False,
    "no": False,
    "off": False,
    "0": False,
}

_METRIC_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class _Unset:
    """The type of :data:`_UNSET` and :data:`_NO_FIT` (distinct sentinels)."""


_UNSET = _Unset()  # no value to show in an error message
_NO_FIT = _Unset()  # a value does not fit a type


@dataclass(frozen=True)
class _Text:
    """A value written as text (a command-line override): converted to its field's type
    when the config is built, instead of being required to have that type already."""

    text: str


# ---------------------------------------------------------------------------- field checks

_Check = Callable[[Any], str | None]
"""A field's value check: the reason it is bad, or None."""


def _positive(value: int | float | None) -> str | None:
    return None if value is None or value > 0 else "must be positive"


def _non_negative(value: int | float) -> str | None:
    return None if value >= 0 else "must not be negative"


def _finite_positive(value: float) -> str | None:
    return None if math.isfinite(value) and value > 0 else "must be a positive finite number"


def _finite_non_negative(value: float) -> str | None:
    if math.isfinite(value) and value >= 0:
        return None
    return "must be a non-negative finite number"


def _known_policy(value: str) -> str | None:
    names = policy_names()
    return None if value in names else f"unknown eviction policy; choose one of {names}"


def _pace(value: str | float) -> str | None:
    return None if value == "max" else _finite_positive(float(value))


def _port(value: int | None) -> str | None:
    return None if value is None or 0 <= value <= 65535 else "must be a port, 0..65535"


def _metric_prefix(value: str) -> str | None:
    if _METRIC_PREFIX.fullmatch(value):
        return None
    return "must be a Prometheus metric name prefix ([a-zA-Z_:][a-zA-Z0-9_:]*)"


def _option(default: Any, *, check: _Check | None = None, size: bool = False) -> Any:
    """A dataclass field with a value check and, with ``size``, size strings ("64GiB")
    accepted for it. Typed Any so it fits any field annotation."""
    return field(default=default, metadata={"check": check, "size": size})


# ---------------------------------------------------------------------------- sections


class _Section:
    """A config section: checks and normalizes its fields on construction.

    Float fields given an int hold the float, size fields given a size string hold the
    bytes; anything else that does not fit raises :class:`ConfigError` naming
    ``SECTION.field`` and the value.
    """

    SECTION: ClassVar[str]

    def __post_init__(self) -> None:
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        for name, value in _checked_fields(type(self), given, self.SECTION).items():
            object.__setattr__(self, name, value)
        self._check_whole()

    def _check_whole(self) -> None:
        """Checks across fields, after each field is checked (none by default)."""


_S = TypeVar("_S", bound=_Section)


@dataclass(frozen=True)
class EngineConfig(_Section):
    """The engine's own options (the arguments of :class:`~tiering.engine.TieringEngine`).

    The CPU tier's size is ``cpu_blocks`` slots or ``cpu_bytes`` bytes (the slots that
    fit, at the KV cache's block size, when the engine is built): exactly one is set.

    Raises:
        ConfigError: a field of the wrong type or value, or not exactly one of
            ``cpu_blocks`` and ``cpu_bytes``.
    """

    SECTION: ClassVar[str] = "engine"

    cpu_blocks: int | None = _option(None, check=_positive)
    cpu_bytes: int | None = _option(None, check=_positive, size=True)
    policy: str = _option("lru", check=_known_policy)
    write_policy: Literal["write_through", "write_back"] = _option("write_through")
    block_size: int = _option(16, check=_positive)
    cache_identity: str = _option("")
    enable_events: bool = _option(False)
    tier_timeout: float = _option(30.0, check=_finite_positive)
    room_timeout: float = _option(5.0, check=_finite_non_negative)
    close_timeout: float = _option(10.0, check=_finite_non_negative)

    def _check_whole(self) -> None:
        if self.cpu_blocks is None and self.cpu_bytes is None:
            raise ConfigError(
                "engine.cpu_blocks / engine.cpu_bytes: the CPU tier needs a size; set exactly "
                "one of them, got neither",
                field="engine.cpu_blocks",
            )
        if self.cpu_blocks is not None and self.cpu_bytes is not None:
            raise ConfigError(
                f"engine.cpu_blocks = {self.cpu_blocks!r}, engine.cpu_bytes = "
                f"{self.cpu_bytes!r}: set exactly one of them, got both",
                field="engine.cpu_blocks",
            )


@dataclass(frozen=True)
class ReplayConfig(_Section):
    """How ``tiering replay`` replays a trace (or the synthetic workload) through an engine.

    ``pace`` is ``"max"`` (as fast as the engine goes) or a speed-up factor over the
    trace's own timestamps (1.0 = real time, 2.0 = twice as fast).

    Raises:
        ConfigError: a field of the wrong type or value.
    """

    SECTION: ClassVar[str] = "replay"

    trace: str | None = _option(None)
    limit: int | None = _option(None, check=_positive)
    pace: Literal["max"] | float = _option("max", check=_pace)
    device_blocks: int | None = _option(None, check=_positive)
    block_bytes: int = _option(64 << 10, check=_positive, size=True)
    verify: bool = _option(True)
    settle: bool = _option(False)
    full_blocks_only: bool = _option(False)
    tenants: int = _option(1, check=_positive)
    nodes: int = _option(1, check=_positive)
    router: Literal["round-robin", "affinity", "least-loaded", "kv-aware"] = _option("round-robin")
    transport: Literal["direct", "zmq"] = _option("direct")


@dataclass(frozen=True)
class SyntheticConfig(_Section):
    """The built-in synthetic workload (multi-turn chat sessions sharing system prompts),
    replayed when ``replay.trace`` is unset; the arguments of
    :func:`tiering.workloads.synthetic_requests`.

    Raises:
        ConfigError: a field of the wrong type or value.
    """

    SECTION: ClassVar[str] = "synthetic"

    sessions: int = _option(200, check=_positive)
    turns_per_session: int = _option(4, check=_positive)
    system_prompts: int = _option(8, check=_positive)
    system_prompt_blocks: int = _option(6, check=_non_negative)
    user_blocks_per_turn: int = _option(2, check=_non_negative)
    reply_blocks_per_turn: int = _option(1, check=_non_negative)
    rate_per_s: float = _option(20.0, check=_finite_positive)
    think_time_s: float = _option(20.0, check=_finite_positive)
    seed: int = _option(0)


@dataclass(frozen=True)
class MetricsConfig(_Section):
    """Where metrics are exported: a Prometheus endpoint on ``port`` (None: not served;
    0: any free port), every metric's name starting with ``prefix``.

    Raises:
        ConfigError: a field of the wrong type or value.
    """

    SECTION: ClassVar[str] = "metrics"

    port: int | None = _option(None, check=_port)
    prefix: str = _option("kv_tiering", check=_metric_prefix)


@dataclass(frozen=True)
class TierConfig:
    """One secondary tier: its registered ``type`` name and its constructor's options.

    On construction the tier class is found through :mod:`tiering.registry`, and every
    option is checked against its constructor: the name must be a parameter (of it or of
    the base classes it forwards ``**kwargs`` to), the value must fit the parameter's
    annotation (an int given for a float is held as a float; a size string such as
    ``"500GiB"`` is held as bytes for an option whose name ends in ``_bytes``), and the
    constructor's required options must be present (``namespace`` excepted: the engine
    supplies it). ``options`` is a read-only mapping.

    Raises:
        ConfigError: naming ``tier.type`` or ``tier.OPTION`` and the value (in a
            :class:`TieringConfig` built from a file or overrides: ``tiers[i].OPTION``).
    """

    type: str
    options: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        options = _checked_tier(self.type, self.options, "tier")
        object.__setattr__(self, "options", MappingProxyType(options))

    def spec(self) -> dict[str, object]:
        """The tier spec the engine and :func:`tiering.registry.make_tier` take:
        ``{"type": name, **options}``, as a new dict."""
        return {"type": self.type, **self.options}


@dataclass(frozen=True)
class TieringConfig:
    """The whole configuration: the engine, its secondary tiers (fastest first), a
    replay, the synthetic workload and metrics.

    Raises:
        ConfigError: a section is not of its config class (``tiers`` may be any
            iterable of :class:`TierConfig`; it is held as a tuple).
    """

    engine: EngineConfig
    tiers: tuple[TierConfig, ...] = ()
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        for name, cls in (
            ("engine", EngineConfig),
            ("replay", ReplayConfig),
            ("synthetic", SyntheticConfig),
            ("metrics", MetricsConfig),
        ):
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise _invalid(name, f"expected a {cls.__name__}", value)
        if isinstance(self.tiers, str | bytes | Mapping) or not isinstance(self.tiers, Iterable):
            raise _invalid("tiers", "expected a sequence of TierConfig", self.tiers)
        tiers = tuple(self.tiers)
        for i, tier in enumerate(tiers):
            if not isinstance(tier, TierConfig):
                raise _invalid(f"tiers[{i}]", "expected a TierConfig", tier)
        object.__setattr__(self, "tiers", tiers)


# ---------------------------------------------------------------------------- public API


def load_config(
    path: str | os.PathLike[str], overrides: Mapping[str, object] | None = None
) -> TieringConfig:
    """The config in the TOML file at ``path``, with ``overrides`` (as
    :func:`with_overrides` takes them) applied before it is checked, so an override can
    supply what the file lacks (``engine.cpu_blocks``, say).

    Every section (``[engine]``, ``[[tiers]]``, ``[replay]``, ``[synthetic]``,
    ``[metrics]``) and every key is optional except the CPU tier's size; a missing one
    takes its default. A relative path the file gives (``replay.trace``, a tier's
    ``root`` or ``*_file`` option) is taken relative to the file's directory, wherever
    the program runs; one an override gives stays as given (relative to the current
    directory).

    Raises:
        ConfigError: the file cannot be read or is not TOML, a section or key is
            unknown, or a value is bad; the message starts with the file's path and
            names the field and the value.
    """
    source = os.fspath(path)
    try:
        with open(path, "rb") as file:
            text = file.read().decode("utf-8")
    except OSError as exc:
        raise ConfigError(
            f"{source}: cannot read the config file: {exc.strerror or exc}", source=source
        ) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text: {exc}", source=source) from exc
    directory = os.path.dirname(os.path.abspath(source))
    return config_from_toml(text, source=source, overrides=overrides, relative_to=directory)


def config_from_toml(
    text: str,
    *,
    source: str | None = None,
    overrides: Mapping[str, object] | None = None,
    relative_to: str | os.PathLike[str] | None = None,
) -> TieringConfig:
    """The config written in TOML ``text``, as :func:`load_config` reads a file;
    ``source`` (a file name) starts every error message. With ``relative_to``, the
    relative paths ``text`` gives (``replay.trace``, a tier's ``root`` or ``*_file``
    option) are joined to it; the overrides' are left as given.

    Raises:
        ConfigError: as :func:`load_config`.
    """
    prefix = f"{source}: " if source else ""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{prefix}not valid TOML: {exc}", source=source) from exc
    if relative_to is not None:
        _resolve_paths(raw, os.fspath(relative_to))
    try:
        if overrides:
            _apply_overrides(raw, overrides)
        return _from_raw(raw)
    except ConfigError as exc:
        if source is None:
            raise
        raise ConfigError(f"{prefix}{exc}", field=exc.field, source=source) from None


def with_overrides(config: TieringConfig, overrides: Mapping[str, object]) -> TieringConfig:
    """A new config: ``config`` with each ``path -> value`` of ``overrides`` set.

    A path is ``section.field`` (``engine.policy``, ``replay.pace``) or
    ``tiers.INDEX.option`` (``tiers.0.capacity_bytes``, ``tiers.1.type``); an index one
    past the last tier adds a tier (which then needs a ``type``). A str value is text
    converted to the field's type (``"2.0"`` for a float, ``"true"``/``"false"`` for a
    bool, ``"64GiB"`` for a size, ``"none"`` or ``""`` to unset a field that may be
    None); any other value must already have the field's type. All overrides are
    applied, then the whole config is checked: ``config`` is never changed, and a bad
    override returns nothing.

    Raises:
        ConfigError: a path names no section, field or tier, or a value is bad; the
            message names the field and the value.
    """
    if not isinstance(config, TieringConfig):
        raise _invalid("config", "expected a TieringConfig", config)
    raw = _to_raw(config)
    _apply_overrides(raw, overrides)
    return _from_raw(raw)


def parse_override(text: str) -> tuple[str, str]:
    """``"engine.policy=arc"`` as ``("engine.policy", "arc")``: one ``--set`` option.

    The path is what precedes the first ``=`` (surrounding blanks dropped); the value is
    the rest, converted later by :func:`with_overrides`. Usable as an argparse ``type``.

    Raises:
        ConfigError: no ``=``, or the path is empty or not dotted names.
    """
    path, equals, value = text.partition("=")
    path = path.strip()
    if not equals or not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)+", path):
        raise ConfigError(
            f"override {text!r}: expected SECTION.FIELD=VALUE (e.g. engine.policy=arc or "
            "tiers.0.capacity_bytes=64GiB)",
            field=path,
        )
    return path, value.strip()


def to_toml(config: TieringConfig) -> str:
    """``config`` as a TOML document that :func:`load_config` reads back to an equal
    config: every field is written (defaults too), except fields that are None.

    Raises:
        ConfigError: a tier option holds a value TOML cannot write (an object set from
            code, such as an EvictionPolicy instance); the message names it.
    """
    raw = _to_raw(config)
    blocks: list[str] = []
    for section in SECTIONS:
        if section == "tiers":
            for i, tier in enumerate(raw["tiers"]):
                body = _toml_lines(tier, f"tiers[{i}]")
                blocks.append("\n".join(["[[tiers]]", *body]))
        else:
            blocks.append("\n".join([f"[{section}]", *_toml_lines(raw[section], section)]))
    return "\n\n".join(blocks) + "\n"


def engine_from_config(config: TieringConfig, kv_caches: KVCaches) -> TieringEngine:
    """The engine ``config`` describes over ``kv_caches``, not yet entered (use it as
    ``async with``). ``engine.cpu_bytes`` becomes as many CPU slots as fit, at the
    block size of ``kv_caches``; the tiers are built from their specs when it opens.

    Raises:
        ConfigError: ``config`` is not a TieringConfig, or ``engine.cpu_bytes`` holds
            no block of this KV cache.
        InvalidArgumentError: ``kv_caches`` is malformed or the CPU tier would not fit
            in this machine's memory (as :class:`~tiering.engine.TieringEngine` raises).
    """
    if not isinstance(config, TieringConfig):
        raise _invalid("config", "expected a TieringConfig", config)
    engine = config.engine
    if engine.cpu_blocks is not None:
        num_cpu_blocks = engine.cpu_blocks
    else:
        assert engine.cpu_bytes is not None  # EngineConfig sets exactly one
        block_bytes = kv_block_bytes(kv_caches)
        num_cpu_blocks = engine.cpu_bytes // block_bytes
        if num_cpu_blocks == 0:
            raise _invalid(
                "engine.cpu_bytes",
                f"holds no block of this KV cache ({block_bytes} bytes per block)",
                engine.cpu_bytes,
            )
    return TieringEngine(
        kv_caches,
        num_cpu_blocks,
        policy=engine.policy,
        secondary_tiers=[tier.spec() for tier in config.tiers],
        write_policy=engine.write_policy,
        block_size=engine.block_size,
        enable_events=engine.enable_events,
        cache_identity=engine.cache_identity,
        tier_timeout=engine.tier_timeout,
        room_timeout=engine.room_timeout,
        close_timeout=engine.close_timeout,
    )


# ---------------------------------------------------------------------------- raw trees
# A raw tree is what TOML parses to: {"engine": {...}, "tiers": [{...}], ...}, where
# overrides put _Text values. Building one into dataclasses is the only way a config is
# made from outside data, so a file, overrides and both together are checked alike.


def _from_raw(raw: Mapping[str, object]) -> TieringConfig:
    for key, value in raw.items():
        if key not in SECTIONS:
            raise _invalid(key, f"unknown section; the sections are {', '.join(SECTIONS)}", value)
    tiers_raw = raw.get("tiers", [])
    if not isinstance(tiers_raw, list | tuple):
        raise _invalid("tiers", "expected an array of tables ([[tiers]])", tiers_raw)
    return TieringConfig(
        engine=_build(EngineConfig, raw.get("engine", {})),
        tiers=tuple(_build_tier(tier, f"tiers[{i}]") for i, tier in enumerate(tiers_raw)),
        replay=_build(ReplayConfig, raw.get("replay", {})),
        synthetic=_build(SyntheticConfig, raw.get("synthetic", {})),
        metrics=_build(MetricsConfig, raw.get("metrics", {})),
    )


def _build(cls: type[_S], raw: object) -> _S:
    if not isinstance(raw, Mapping):
        raise _invalid(cls.SECTION, "expected a table", raw)
    return cls(**_checked_fields(cls, raw, cls.SECTION))


def _build_tier(raw: object, path: str) -> TierConfig:
    if not isinstance(raw, Mapping):
        raise _invalid(path, "expected a table of tier options", raw)
    options = dict(raw)
    name = options.pop("type", _UNSET)
    if isinstance(name, _Text):
        name = name.text
    if name is _UNSET:
        raise ConfigError(
            f"{path}.type: every tier needs a type; known tiers: {registry.tier_names()}",
            field=f"{path}.type",
        )
    return TierConfig(name, _checked_tier(name, options, path))  # type: ignore[arg-type]


def _to_raw(config: TieringConfig) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for section in SECTIONS:
        if section == "tiers":
            raw["tiers"] = [tier.spec() for tier in config.tiers]
            continue
        value = getattr(config, section)
        raw[section] = {
            f.name: getattr(value, f.name)
            for f in dataclasses.fields(value)
            if getattr(value, f.name) is not None
        }
    return raw


def _resolve_paths(raw: dict[str, Any], directory: str) -> None:
    """Join the relative paths of a parsed file to ``directory`` (in place): the
    ``replay.trace`` field, and every tier option named ``root`` or ending in ``_file``.
    Values of another type are left for the checks to refuse."""

    def joined(value: object) -> object:
        if isinstance(value, str) and value and not os.path.isabs(value):
            return os.path.join(directory, value)
        return value

    replay = raw.get("replay")
    if isinstance(replay, dict) and "trace" in replay:
        replay["trace"] = joined(replay["trace"])
    tiers = raw.get("tiers")
    for tier in tiers if isinstance(tiers, list) else []:
        if isinstance(tier, dict):
            for option, value in tier.items():
                if option == "root" or option.endswith("_file"):
                    tier[option] = joined(value)


def _apply_overrides(raw: dict[str, Any], overrides: Mapping[str, object]) -> None:
    """Set each override in ``raw`` (a tree this module owns); str values as _Text."""
    if not isinstance(overrides, Mapping):
        raise _invalid("overrides", "expected a mapping of path to value", overrides)
    for path, value in overrides.items():
        if not isinstance(path, str):
            raise _invalid(repr(path), "an override path must be a str", value)
        given = _Text(value) if isinstance(value, str) else value
        parts = path.split(".")
        section = parts[0]
        if section not in SECTIONS:
            raise _invalid(
                path, f"unknown section {section!r}; the sections are {', '.join(SECTIONS)}", value
            )
        if section != "tiers":
            if len(parts) != 2 or not parts[1]:
                raise _invalid(path, f"expected {section}.FIELD", value)
            table = raw.setdefault(section, {})
            if not isinstance(table, dict):
                raise _invalid(section, "expected a table", table)
            table[parts[1]] = given
            continue
        tiers = raw.setdefault("tiers", [])
        if len(parts) != 3 or not parts[1].isdecimal() or not parts[2]:
            raise _invalid(path, "expected tiers.INDEX.OPTION (e.g. tiers.0.capacity_bytes)", value)
        if not isinstance(tiers, list):
            raise _invalid("tiers", "expected an array of tables ([[tiers]])", tiers)
        index = int(parts[1])
        if index > len(tiers):
            raise _invalid(
                path,
                f"there are {len(tiers)} tiers; an override may change one or add "
                f"tiers.{len(tiers)}",
                value,
            )
        if index == len(tiers):
            tiers.append({})
        if not isinstance(tiers[index], dict):
            raise _invalid(f"tiers[{index}]", "expected a table of tier options", tiers[index])
        tiers[index][parts[2]] = given


# ---------------------------------------------------------------------------- checking


def _checked_fields(
    cls: type[_Section], given: Mapping[str, object], path: str
) -> dict[str, object]:
    """The fields ``given`` sets, each converted to its annotated type and checked.

    Raises:
        ConfigError: a key that is no field of ``cls``, or a value that does not fit.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = _section_hints(cls)
    out: dict[str, object] = {}
    for key, value in given.items():
        where = f"{path}.{key}"
        if key not in fields:
            raise _invalid(where, f"unknown key; [{path}] takes {', '.join(fields)}", value)
        metadata = fields[key].metadata
        converted = _coerce(where, value, hints[key], size=metadata.get("size", False))
        check: _Check | None = metadata.get("check")
        if converted is not None and check is not None:
            why = check(converted)
            if why is not None:
                raise _invalid(where, why, value)
        out[key] = converted
    return out


@functools.cache
def _section_hints(cls: type[_Section]) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _checked_tier(name: object, options: object, path: str) -> dict[str, object]:
    """``options`` for the tier registered as ``name``, each converted and checked
    against the tier's constructor (see :class:`TierConfig`).

    Raises:
        ConfigError: an unknown tier, an unknown option, a value that does not fit, or a
            required option left out.
    """
    if isinstance(name, _Text):
        name = name.text
    if not isinstance(name, str) or not name:
        raise _invalid(f"{path}.type", "expected the name of a registered tier", name)
    if not isinstance(options, Mapping):
        raise _invalid(path, "expected a mapping of tier options", options)
    try:
        factory = registry.tier_factory(name)
    except UnknownTierError as exc:
        raise _invalid(f"{path}.type", str(exc), name) from None
    parameters, open_ended, required = _tier_parameters(factory)
    out: dict[str, object] = {}
    for key, value in options.items():
        where = f"{path}.{key}"
        if not isinstance(key, str):
            raise _invalid(f"{path}[{key!r}]", "an option name must be a str", value)
        if key == "type":
            raise _invalid(where, "the tier's type is set once, as TierConfig.type", value)
        if key in parameters:
            hint = parameters[key]
        elif open_ended:
            hint = Any
        else:
            raise _invalid(
                where,
                f"tier {name!r} takes no option {key!r}; it takes {', '.join(sorted(parameters))}",
                value,
            )
        out[key] = _coerce(where, value, hint, size=key.endswith("_bytes"))
    for needed in required:
        if needed not in out:
            raise ConfigError(
                f"{path}.{needed}: tier {name!r} needs this option; it is missing",
                field=f"{path}.{needed}",
            )
    return out


@functools.lru_cache(maxsize=64)
def _tier_parameters(factory: Callable[..., object]) -> tuple[dict[str, Any], bool, list[str]]:
    """The options ``factory`` takes: ``(annotation by name, open_ended, required)``.

    For a class, its ``__init__`` and, while each forwards ``**kwargs``, the base
    classes' ones; the first two positional arguments (the host pool view and the block
    size) are the engine's. ``open_ended``: some ``**kwargs`` could not be followed, so
    unknown names cannot be refused. Unresolvable annotations accept any value.
    """
    is_class = isinstance(factory, type)
    derived = getattr(factory, "DERIVED_OPTIONS", frozenset())  # the tier sets them itself
    functions = (
        [vars(c)["__init__"] for c in factory.__mro__ if "__init__" in vars(c)]  # type: ignore[attr-defined]
        if is_class
        else [factory]
    )
    engine_positional = 3 if is_class else 2  # (self,) primary_kv_view, block_bytes
    parameters: dict[str, Any] = {}
    required: list[str] = []
    for depth, function in enumerate(functions):
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            return parameters, True, required
        try:
            hints = typing.get_type_hints(function)
        except (NameError, TypeError, AttributeError, SyntaxError):
            hints = {}
        forwards = False
        for index, parameter in enumerate(signature.parameters.values()):
            kind = parameter.kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                forwards = True
                continue
            if (
                kind is inspect.Parameter.VAR_POSITIONAL
                or kind is inspect.Parameter.POSITIONAL_ONLY
            ):
                continue
            if index < engine_positional and kind is not inspect.Parameter.KEYWORD_ONLY:
                continue
            if parameter.name in derived:
                continue
            # The outermost signature wins: a subclass may narrow a base's parameter.
            parameters.setdefault(parameter.name, hints.get(parameter.name, Any))
            if (
                depth == 0
                and parameter.default is inspect.Parameter.empty
                and parameter.name not in _ENGINE_SUPPLIED
            ):
                required.append(parameter.name)
        if not forwards:
            return parameters, False, required
    return parameters, True, required


def _coerce(path: str, value: object, hint: Any, *, size: bool) -> object:
    """``value`` as ``hint`` describes it (text converted, ints widened to floats, size
    strings read as bytes when ``size``).

    Raises:
        ConfigError: naming ``path`` and the value, if it does not fit.
    """
    is_text = isinstance(value, _Text)
    raw: object = value.text if isinstance(value, _Text) else value
    if size and isinstance(raw, str):
        if is_text and _fits_none(hint) and raw.strip().lower() in _NONE_WORDS:
            return None
        try:
            raw = int(raw.strip(), 10) if raw.strip().isdecimal() else parse_size(raw)
        except ValueError as exc:
            raise _invalid(path, f"expected a size such as 64GiB or 4096 ({exc})", value) from None
        is_text = False
    fitted = _fit(raw, hint, is_text)
    if fitted is _NO_FIT:
        raise _invalid(path, f"expected {_describe(hint)}", value)
    return fitted


def _fits_none(hint: Any) -> bool:
    return hint is NoneType or (
        typing.get_origin(hint) in (typing.Union, UnionType) and NoneType in typing.get_args(hint)
    )


def _rank(hint: Any) -> int:
    """The order a union's members are tried in: text "1" is an int before a float or
    a str, "true" a bool before a str."""
    order: list[Any] = [NoneType, bool, int, float]
    if hint in order:
        return order.index(hint)
    if typing.get_origin(hint) is Literal:
        return len(order)
    return len(order) + (1 if hint is str else 2)


def _fit(value: object, hint: Any, is_text: bool) -> object:
    """``value`` converted to ``hint``, or :data:`_NO_FIT`. Text (``is_text``) is parsed;
    other values must have the type already (an int is widened to a float)."""
    origin = typing.get_origin(hint)
    if hint is Any or hint is object:
        return _parse_any(value) if is_text else value  # type: ignore[arg-type]
    if origin in (typing.Union, UnionType):
        for member in sorted(typing.get_args(hint), key=_rank):
            fitted = _fit(value, member, is_text)
            if fitted is not _NO_FIT:
                return fitted
        return _NO_FIT
    if origin is Literal:
        for choice in typing.get_args(hint):
            fitted = _fit(value, type(choice), is_text)
            if fitted is not _NO_FIT and type(fitted) is type(choice) and fitted == choice:
                return choice
        return _NO_FIT
    if is_text:
        assert isinstance(value, str)
        return _fit_text(value, hint)
    if hint is NoneType:
        return None if value is None else _NO_FIT
    if hint is bool:
        return value if isinstance(value, bool) else _NO_FIT
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO_FIT
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value) if math.isfinite(value) else _NO_FIT
        return _NO_FIT
    if hint is str:
        return value if isinstance(value, str) else _NO_FIT
    target = origin if origin is not None else hint
    if target is os.PathLike:
        return value if isinstance(value, os.PathLike) else _NO_FIT
    if isinstance(target, type):
        try:
            return value if isinstance(value, target) else _NO_FIT
        except TypeError:  # a protocol that isinstance cannot check
            return _NO_FIT
    return _NO_FIT  # a callable or another typing construct: no config value is one


def _fit_text(text: str, hint: Any) -> object:
    word = text.strip().lower()
    if hint is NoneType:
        return None if word in _NONE_WORDS else _NO_FIT
    if hint is bool:
        return _BOOL_WORDS.get(word, _NO_FIT)
    if hint is int:
        try:
            return int(text.strip(), 10)
        except ValueError:
            return _NO_FIT
    if hint is float:
        try:
            number = float(text)
        except ValueError:
            return _NO_FIT
        return number if math.isfinite(number) else _NO_FIT
    if hint is str or hint is os.PathLike or typing.get_origin(hint) is os.PathLike:
        return text
    return _NO_FIT


def _parse_any(text: str) -> object:
    """Text for an option of unknown type: a TOML value if it reads as one ("3",
    "true", "[1, 2]"), else the text itself."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if hint is Any or hint is object:
        return "any value"
    if origin in (typing.Union, UnionType):
        parts = [_describe(member) for member in sorted(typing.get_args(hint), key=_rank)]
        return " or ".join(dict.fromkeys(parts))
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in typing.get_args(hint))
    names = {
        NoneType: "none",
        bool: "true or false",
        int: "an integer",
        float: "a finite number",
        str: "a string",
    }
    if hint in names:
        return names[hint]
    if hint is os.PathLike or origin is os.PathLike:
        return "a path"
    name = getattr(hint, "__name__", None) or str(hint)
    return f"{name} (which a config cannot hold)"


def _invalid(path: str, why: str, value: object = _UNSET) -> ConfigError:
    shown = "" if value is _UNSET else f" = {_show(value)}"
    return ConfigError(f"{path}{shown}: {why}", field=path)


def _show(value: object) -> str:
    text = repr(value.text if isinstance(value, _Text) else value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------------- TOML output


def _toml_lines(table: Mapping[str, object], path: str) -> list[str]:
    return [
        f"{_toml_key(key)} = {_toml_value(value, f'{path}.{key}')}" for key, value in table.items()
    ]


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_value(value: object, path: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value)  # inf, -inf and Python's float syntax are all TOML floats
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, os.PathLike):
        return _toml_string(os.fspath(value))
    if isinstance(value, list | tuple):
        items = ", ".join(_toml_value(item, f"{path}[{i}]") for i, item in enumerate(value))
        return f"[{items}]"
    if isinstance(value, Mapping):
        items = ", ".join(
            f"{_toml_key(str(key))} = {_toml_value(item, f'{path}.{key}')}"
            for key, item in value.items()
        )
        return "{" + items + "}"
    raise _invalid(path, "cannot be written as TOML", value)


def _toml_string(text: str) -> str:
    out = ['"']
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:  # control characters must be escaped
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


__all__ = [
    "SECTIONS",
    "EngineConfig",
    "MetricsConfig",
    "ReplayConfig",
    "SyntheticConfig",
    "TierConfig",
    "TieringConfig",
    "config_from_toml",
    "engine_from_config",
    "load_config",
    "parse_override",
    "to_toml",
    "with_overrides",
]
