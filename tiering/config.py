"""One typed configuration (:class:`TieringConfig`) for an engine, its secondary tiers, a
replay and its metrics: from TOML or code, with ``--set`` overrides, written back as TOML,
checked whole before anything is returned (a :class:`~tiering.errors.ConfigError` names
the field's path, the value and the file). ``TieringEngine.from_config`` builds the
engine. The format, every field and its default: ``docs/config.md``.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from types import MappingProxyType
from typing import Annotated, Any, Literal, Self

import tomli_w
from pydantic import AfterValidator, Field, model_validator

from tiering import registry
from tiering.errors import ConfigError, UnknownTierError
from tiering.options import Bytes, Count, Options, PositiveInt, Seconds, SecondsOrZero, Text, shown
from tiering.policies import policy_names

SECTIONS = ("engine", "tiers", "replay", "synthetic", "metrics")
"""The top-level sections of a config file."""
_STAND_IN_NAMESPACE = "config"  # the engine supplies a tier's namespace


def _known_policy(name: str) -> str:
    if name not in policy_names():
        raise ValueError(f"unknown eviction policy; choose one of {policy_names()}")
    return name


class _Section(Options):
    """A config section, checked on construction: a bad field raises ConfigError
    naming ``SECTION.field`` and the value."""

    ERROR = ConfigError
    UNKNOWN = "unknown key; [{where}] takes {fields}"

    def __init__(self, /, **values: Any) -> None:
        cls = type(self)
        cls._validated(values, lambda v: super(_Section, self).__init__(**v), cls.WHERE, None, None)


class EngineConfig(_Section):
    """The arguments of :class:`~tiering.engine.TieringEngine`. The CPU tier's size is
    ``cpu_blocks`` slots or ``cpu_bytes`` bytes (the slots that fit, at the KV cache's
    block size): exactly one is set."""

    WHERE = "engine"
    cpu_blocks: PositiveInt | None = None
    cpu_bytes: Bytes | None = None
    policy: Annotated[str, AfterValidator(_known_policy)] = "lru"
    write_policy: Literal["write_through", "write_back"] = "write_through"
    block_size: PositiveInt = 16
    cache_identity: str = ""
    enable_events: bool = False
    tier_timeout: Seconds = 30.0
    room_timeout: SecondsOrZero = 5.0
    close_timeout: SecondsOrZero = 10.0

    @model_validator(mode="after")
    def _one_cpu_size(self) -> Self:
        if (self.cpu_blocks is None) == (self.cpu_bytes is None):
            raise ValueError(
                f"cpu_blocks = {self.cpu_blocks!r}, engine.cpu_bytes = {self.cpu_bytes!r}: "
                "the CPU tier's size; set exactly one of them, got "
                + ("neither" if self.cpu_blocks is None else "both")
            )
        return self


class ReplayConfig(_Section):
    """How ``tiering replay`` replays a trace (or the synthetic workload). ``pace`` is
    ``"max"`` (as fast as the engine goes) or a speed-up over the trace's timestamps."""

    WHERE = "replay"
    trace: str | None = None
    limit: PositiveInt | None = None
    pace: Literal["max"] | Seconds = "max"
    device_blocks: PositiveInt | None = None
    block_bytes: Bytes = 64 << 10
    verify: bool = True
    settle: bool = False
    full_blocks_only: bool = False
    tenants: PositiveInt = 1
    nodes: PositiveInt = 1
    router: Literal["round-robin", "affinity", "least-loaded", "kv-aware"] = "round-robin"
    transport: Literal["direct", "zmq"] = "direct"


class SyntheticConfig(_Section):
    """The arguments of :func:`tiering.workloads.synthetic_requests`, the workload
    replayed when ``replay.trace`` is unset."""

    WHERE = "synthetic"
    sessions: PositiveInt = 200
    turns_per_session: PositiveInt = 4
    system_prompts: PositiveInt = 8
    system_prompt_blocks: Count = 6
    user_blocks_per_turn: Count = 2
    reply_blocks_per_turn: Count = 1
    rate_per_s: Seconds = 20.0
    think_time_s: Seconds = 20.0
    seed: int = 0


class MetricsConfig(_Section):
    """A Prometheus endpoint on ``port`` (None: not served; 0: any free port), every
    metric's name starting with ``prefix``."""

    WHERE = "metrics"
    port: Annotated[int, Field(ge=0, le=65535)] | None = None
    prefix: str = Field("kv_tiering", pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


@dataclass(frozen=True)
class TierConfig:
    """One secondary tier: its registered ``type`` and its options, checked and
    converted by :func:`tiering.registry.check_options` (``namespace`` may be left out:
    the engine supplies it), held read-only. Raises ConfigError naming ``tier.OPTION``
    (``tiers[i].OPTION`` from a file or overrides) and the value."""

    type: str
    options: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    where: InitVar[str] = "tier"  # the path errors name the tier by

    def __post_init__(self, where: str) -> None:
        if not isinstance(self.type, str) or not self.type:
            raise _invalid(f"{where}.type", "expected the name of a registered tier", self.type)
        try:
            supplied = {"namespace": _STAND_IN_NAMESPACE}
            checked = registry.check_options(
                self.type, self.options, defaults=supplied, where=where
            )
        except UnknownTierError as exc:
            raise _invalid(f"{where}.type", str(exc), self.type) from None
        options = MappingProxyType({key: checked[key] for key in self.options})
        object.__setattr__(self, "options", options)

    def spec(self) -> dict[str, object]:
        """``{"type": name, **options}`` as a new dict: what the engine builds it from."""
        return {"type": self.type, **self.options}


@dataclass(frozen=True)
class TieringConfig:
    """The engine, its secondary tiers (fastest first; any iterable of
    :class:`TierConfig`, held as a tuple), a replay, the synthetic workload and metrics.
    Raises ConfigError for a section that is not of its config class."""

    engine: EngineConfig
    tiers: tuple[TierConfig, ...] = ()
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise _invalid(name, f"expected a {cls.__name__}", getattr(self, name))
        if isinstance(self.tiers, str | bytes | Mapping) or not isinstance(self.tiers, Iterable):
            raise _invalid("tiers", "expected a sequence of TierConfig", self.tiers)
        for i, tier in enumerate(tiers := tuple(self.tiers)):
            if not isinstance(tier, TierConfig):
                raise _invalid(f"tiers[{i}]", "expected a TierConfig", tier)
        object.__setattr__(self, "tiers", tiers)


_SECTIONS = {cls.WHERE: cls for cls in (EngineConfig, ReplayConfig, SyntheticConfig, MetricsConfig)}


def load_config(
    path: str | os.PathLike[str],
    overrides: Mapping[str, object] | None = None,
    *,
    add_tiers: Sequence[Mapping[str, object]] = (),
) -> TieringConfig:
    """The config in the TOML file at ``path``, as :func:`config_from_toml` reads it; a
    relative path in the file (``replay.trace``, a tier's ``root`` or ``*_file``
    option) is taken from the file's directory. Raises ConfigError (also for a file
    that cannot be read), the message starting with the file's path."""
    source = os.fspath(path)
    try:
        with open(path, "rb") as file:
            text = file.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = f"cannot read the config file: {getattr(exc, 'strerror', None) or exc}"
        raise ConfigError(f"{source}: {why}", source=source) from exc
    directory = os.path.dirname(os.path.abspath(source))
    return config_from_toml(
        text, source=source, overrides=overrides, relative_to=directory, add_tiers=add_tiers
    )


def config_from_toml(
    text: str,
    *,
    source: str | None = None,
    overrides: Mapping[str, object] | None = None,
    relative_to: str | os.PathLike[str] | None = None,
    add_tiers: Sequence[Mapping[str, object]] = (),
) -> TieringConfig:
    """The config in TOML ``text``, with ``add_tiers`` (tier tables) after its tiers,
    then ``overrides`` (as :func:`with_overrides` takes them, staying as given) applied
    before anything is checked: an override may supply what the text lacks. Every key
    is optional but the CPU tier's size. The text's relative paths are joined to
    ``relative_to``. Raises ConfigError naming ``source``, the field and the value."""
    prefix = f"{source}: " if source else ""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{prefix}not valid TOML: {exc}", source=source) from exc
    if relative_to is not None:
        _resolve_paths(raw, os.fspath(relative_to))
    try:
        if add_tiers and isinstance(raw.setdefault("tiers", []), list):
            raw["tiers"].extend(dict(tier) for tier in add_tiers)
        _apply_overrides(raw, overrides or {})
        return _from_raw(raw)
    except ConfigError as exc:
        if source is None:
            raise
        raise ConfigError(f"{prefix}{exc}", field=exc.field, source=source) from None


def with_overrides(config: TieringConfig, overrides: Mapping[str, object]) -> TieringConfig:
    """A new config: ``config`` with each ``path -> value`` of ``overrides`` set, then
    checked whole (``config`` never changes).

    A path is ``section.field`` or ``tiers.INDEX.option`` (an index one past the last
    tier adds one, which then needs a ``type``). A str value is text converted to the
    field's type (``"2.0"``, ``"on"``, ``"64GiB"``; ``"none"`` or ``""`` unsets a field
    whose default is None); any other value must have the field's type. Raises
    ConfigError naming the path and the value."""
    if not isinstance(config, TieringConfig):
        raise _invalid("config", "expected a TieringConfig", config)
    raw: dict[str, Any] = {name: getattr(config, name).model_dump() for name in _SECTIONS}
    raw["tiers"] = [tier.spec() for tier in config.tiers]
    _apply_overrides(raw, overrides)
    return _from_raw(raw)


def parse_override(text: str) -> tuple[str, str]:
    """``"engine.policy=arc"`` as ``("engine.policy", "arc")``: one ``--set`` option,
    split at the first ``=``, blanks dropped (an argparse ``type``). Raises ConfigError
    without an ``=`` or for a path that is not dotted names."""
    path, equals, value = text.partition("=")
    if not equals or not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)+", path.strip()):
        raise ConfigError(
            f"override {text!r}: expected SECTION.FIELD=VALUE (e.g. engine.policy=arc or "
            "tiers.0.capacity_bytes=64GiB)",
            field=path.strip(),
        )
    return path.strip(), value.strip()


def to_toml(config: TieringConfig) -> str:
    """``config`` as TOML that :func:`load_config` reads back to an equal config: every
    field but those that are None. Raises ConfigError naming a tier option TOML cannot
    hold (an object set from code)."""
    tiers = [tier.spec() for tier in config.tiers]
    for i, tier in enumerate(tiers):
        for key, value in tier.items():
            try:
                tomli_w.dumps({key: value})
            except TypeError:
                raise _invalid(f"tiers[{i}].{key}", "cannot be written as TOML", value) from None
    sections = {name: getattr(config, name).model_dump(exclude_none=True) for name in _SECTIONS}
    return tomli_w.dumps({**sections, "tiers": tiers})


# A raw tree is what TOML parses to ({"engine": {...}, "tiers": [{...}], ...}), with Text
# where overrides put text: a file, overrides and both together are checked alike.


def _from_raw(raw: Mapping[str, object]) -> TieringConfig:
    for key, value in raw.items():
        if key not in SECTIONS:
            raise _invalid(key, f"unknown section; the sections are {', '.join(SECTIONS)}", value)
    sections = {}
    for name, cls in _SECTIONS.items():
        if not isinstance(table := raw.get(name, {}), Mapping):
            raise _invalid(name, "expected a table", table)
        sections[name] = cls(**table)
    if not isinstance(tiers := raw.get("tiers", []), list | tuple):
        raise _invalid("tiers", "expected an array of tables ([[tiers]])", tiers)
    built = []
    for i, tier in enumerate(tiers):
        if not isinstance(tier, Mapping):
            raise _invalid(f"tiers[{i}]", "expected a table of tier options", tier)
        if "type" not in tier:
            known = registry.tier_names()
            message = f"tiers[{i}].type: every tier needs a type; known tiers: {known}"
            raise ConfigError(message, field=f"tiers[{i}].type")
        options = {key: value for key, value in tier.items() if key != "type"}
        built.append(TierConfig(tier["type"], options, f"tiers[{i}]"))
    return TieringConfig(tiers=tuple(built), **sections)


def _resolve_paths(raw: dict[str, Any], directory: str) -> None:
    """Join the relative paths of a parsed file to ``directory``, in place: the
    ``replay.trace`` field and every tier option named ``root`` or ending in ``_file``
    (a value of another type is left for the checks to refuse)."""
    tiers = raw["tiers"] if isinstance(raw.get("tiers"), list) else []
    places = [(raw.get("replay"), "trace")]
    places += [
        (tier, key)
        for tier in tiers
        for key in (tier if isinstance(tier, dict) else ())
        if key == "root" or key.endswith("_file")
    ]
    for table, key in places:
        value = table.get(key) if isinstance(table, dict) else None
        if isinstance(value, str) and value and not os.path.isabs(value):
            table[key] = os.path.join(directory, value)  # type: ignore[index]


def _apply_overrides(raw: dict[str, Any], overrides: Mapping[str, object]) -> None:
    """Set each override in ``raw`` (a tree this module owns); str values as Text."""
    if not isinstance(overrides, Mapping):
        raise _invalid("overrides", "expected a mapping of path to value", overrides)
    for path, value in overrides.items():
        section, *rest = str(path).split(".")
        if section not in SECTIONS:
            known = ", ".join(SECTIONS)
            raise _invalid(path, f"unknown section {section!r}; the sections are {known}", value)
        table = raw.setdefault(section, [] if section == "tiers" else {})
        if section == "tiers":
            if len(rest) != 2 or not rest[0].isdecimal() or not rest[1]:
                raise _invalid(path, "expected tiers.INDEX.OPTION (e.g. tiers.0.root)", value)
            if not isinstance(table, list) or int(rest[0]) > len(table):
                count = len(table) if isinstance(table, list) else 0
                why = f"there are {count} tiers; an override may change one or add tiers.{count}"
                raise _invalid(path, why, value)
            if int(rest[0]) == len(table):
                table.append({})
            table = table[int(rest[0])]
        elif len(rest) != 1 or not rest[0]:
            raise _invalid(path, f"expected {section}.FIELD", value)
        if not isinstance(table, dict):
            raise _invalid(section, "expected a table", table)
        text = isinstance(value, str) and (section, rest[-1]) != ("tiers", "type")
        table[rest[-1]] = Text(value) if text else value


def _invalid(path: object, why: str, value: object) -> ConfigError:
    return ConfigError(f"{path} = {shown(value)}: {why}", field=str(path))


__all__ = [
    "SECTIONS",
    "EngineConfig",
    "MetricsConfig",
    "ReplayConfig",
    "SyntheticConfig",
    "TierConfig",
    "TieringConfig",
    "config_from_toml",
    "load_config",
    "parse_override",
    "to_toml",
    "with_overrides",
]
