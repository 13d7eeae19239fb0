"""One typed configuration (:class:`TieringConfig`) of an engine, its tiers, a replay and
its metrics: from TOML or code, with ``--set`` overrides, written back as TOML, checked
whole before anything is returned. Every field and default: docs/config.md."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal, Self

import tomli_w
from pydantic import AfterValidator, Field, model_validator

from tiering.core.policies import DEFAULT_POLICY, policy_name, policy_names
from tiering.errors import ConfigError, UnknownTierError
from tiering.options import Bytes, Count, Options, PositiveInt, Seconds, SecondsOrZero, Text, shown
from tiering.tiers import registry

SECTIONS = ("engine", "tiers", "replay", "synthetic", "metrics")
WORKLOADS = ("synthetic", "chat", "agent", "rag", "scan", "shift")  # workload_suite's families


def _known_policy(name: str) -> str:
    name = policy_name(name)  # a retired name: its replacement
    if name not in policy_names():
        raise ValueError(f"unknown eviction policy; choose one of {policy_names()}")
    return name


class _Section(Options):
    """A bad field raises ConfigError naming ``SECTION.field``."""

    ERROR = ConfigError
    UNKNOWN = "unknown key; [{where}] takes {fields}"

    def __init__(self, /, **values: Any) -> None:
        init = super().__init__
        self._validated(values, lambda v: init(**v), self.WHERE, None, None)


class EngineConfig(_Section):
    """The arguments of :class:`~tiering.engine.TieringEngine`; one CPU size is set."""

    WHERE = "engine"
    cpu_blocks: PositiveInt | None = None
    cpu_bytes: Bytes | None = None
    policy: Annotated[str, AfterValidator(_known_policy)] = DEFAULT_POLICY
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
            got = "neither" if self.cpu_blocks is None else "both"
            sizes = f"cpu_blocks = {self.cpu_blocks!r}, engine.cpu_bytes = {self.cpu_bytes!r}"
            raise ValueError(f"{sizes}: the CPU tier's size; set exactly one of them, got {got}")
        return self


class ReplayConfig(_Section):
    """How ``tiering replay`` replays a trace (or the synthetic workload)."""

    WHERE = "replay"
    trace: str | None = None
    workload: Literal[WORKLOADS] = "synthetic"  # type: ignore[valid-type]
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
    """The arguments of :func:`tiering.lab.workloads.synthetic_requests`."""

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
    """A Prometheus endpoint on ``port`` (None: not served; 0: any free port)."""

    WHERE = "metrics"
    port: Annotated[int, Field(ge=0, le=65535)] | None = None
    prefix: str = Field("kv_tiering", pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


@dataclass(frozen=True)
class TierConfig:
    """A secondary tier's ``type`` and options, checked by :func:`tiering.tiers.registry.
    check_options`. Raises ConfigError naming ``tier.OPTION`` (or ``tiers[i].OPTION``)."""

    type: str
    options: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    where: InitVar[str] = "tier"  # the path errors name the tier by

    def __post_init__(self, where: str) -> None:
        if not isinstance(self.type, str) or not self.type:
            why = f"every tier needs a type; known tiers: {registry.tier_names()}"
            raise _invalid(f"{where}.type", why, self.type)
        stand_in = {"namespace": "config"}  # the engine supplies a tier's namespace
        try:
            got = registry.check_options(self.type, self.options, defaults=stand_in, where=where)
        except UnknownTierError as exc:
            raise _invalid(f"{where}.type", str(exc), self.type) from None
        object.__setattr__(self, "options", MappingProxyType({k: got[k] for k in self.options}))

    def spec(self) -> dict[str, object]:
        """``{"type": name, **options}`` as a new dict: what the engine builds it from."""
        return {"type": self.type, **self.options}


@dataclass(frozen=True)
class TieringConfig:
    """The sections and the tiers (fastest first; any iterable, held as a tuple), checked."""

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
    """The config in the TOML file at ``path`` (:func:`config_from_toml`, relative to the
    file's directory). Raises ConfigError starting with the file's path."""
    source = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
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
    """The config in TOML ``text``, ``add_tiers`` after its tiers and ``overrides`` (as
    :func:`with_overrides` takes them) applied, relative paths joined to ``relative_to``,
    then checked. Raises ConfigError naming ``source`` and the field."""
    prefix = f"{source}: " if source else ""
    try:
        raw = tomllib.loads(text)
        if relative_to is not None:
            _resolve_paths(raw, os.fspath(relative_to))
        if add_tiers and isinstance(raw.setdefault("tiers", []), list):
            raw["tiers"].extend(dict(tier) for tier in add_tiers)
        _apply_overrides(raw, overrides or {})
        return _from_raw(raw)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{prefix}not valid TOML: {exc}", source=source) from exc
    except ConfigError as exc:
        raise ConfigError(f"{prefix}{exc}", field=exc.field, source=source) from None


def with_overrides(config: TieringConfig, overrides: Mapping[str, object]) -> TieringConfig:
    """``config`` with each ``section.field`` or ``tiers.INDEX.option`` of ``overrides`` set
    (a str as text for the field's type), checked whole. Raises ConfigError naming it."""
    if not isinstance(config, TieringConfig):
        raise _invalid("config", "expected a TieringConfig", config)
    raw: dict[str, Any] = {name: getattr(config, name).model_dump() for name in _SECTIONS}
    raw["tiers"] = [tier.spec() for tier in config.tiers]
    _apply_overrides(raw, overrides)
    return _from_raw(raw)


def parse_override(text: str) -> tuple[str, str]:
    """``"engine.policy=arc"`` as ``("engine.policy", "arc")`` (one ``--set``), split at
    the first ``=``. Raises ConfigError without an ``=`` or a dotted path."""
    path, equals, value = (part.strip() for part in text.partition("="))
    if not equals or not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)+", path):
        why = "expected SECTION.FIELD=VALUE (e.g. engine.policy=arc or tiers.0.max_blocks=64)"
        raise ConfigError(f"override {text!r}: {why}", field=path)
    return path, value


def to_toml(config: TieringConfig) -> str:
    """``config`` as TOML that :func:`load_config` reads back to an equal config (None
    fields left out). Raises ConfigError naming a tier option TOML cannot hold."""
    tiers = [tier.spec() for tier in config.tiers]
    for i, key, value in ((i, k, v) for i, tier in enumerate(tiers) for k, v in tier.items()):
        try:
            tomli_w.dumps({key: value})
        except TypeError:
            raise _invalid(f"tiers[{i}].{key}", "cannot be written as TOML", value) from None
    sections = {name: getattr(config, name).model_dump(exclude_none=True) for name in _SECTIONS}
    return tomli_w.dumps({**sections, "tiers": tiers})


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
        options = {key: value for key, value in tier.items() if key != "type"}
        built.append(TierConfig(tier.get("type"), options, f"tiers[{i}]"))  # type: ignore[arg-type]
    return TieringConfig(tiers=tuple(built), **sections)


def _resolve_paths(raw: dict[str, Any], directory: str) -> None:
    """Join relative ``replay.trace``, tier ``root`` and ``*_file`` strs to ``directory``."""
    replay, tiers = raw.get("replay"), raw.get("tiers")
    for table in [replay, *(tiers if isinstance(tiers, list) else ())]:
        for key, value in table.items() if isinstance(table, dict) else ():
            named = key == "trace" if table is replay else key == "root" or key.endswith("_file")
            if named and isinstance(value, str) and value and not os.path.isabs(value):
                table[key] = os.path.join(directory, value)


def _apply_overrides(raw: dict[str, Any], overrides: Mapping[str, object]) -> None:
    """Set each override in ``raw`` (a tree this module owns); str values as Text."""
    if not isinstance(overrides, Mapping):
        raise _invalid("overrides", "expected a mapping of path to value", overrides)
    for path, value in overrides.items():
        section, *rest = str(path).split(".")
        if section not in SECTIONS:
            known = ", ".join(SECTIONS)
            raise _invalid(path, f"unknown section {section!r}; the sections are {known}", value)
        tiers = section == "tiers"
        table = raw.setdefault(section, [] if tiers else {})
        if len(rest) != 1 + tiers or not rest[-1] or (tiers and not rest[0].isdecimal()):
            shape = "tiers.INDEX.OPTION (e.g. tiers.0.root)" if tiers else f"{section}.FIELD"
            raise _invalid(path, f"expected {shape}", value)
        if tiers:
            count = len(table) if isinstance(table, list) else 0
            if not isinstance(table, list) or int(rest[0]) > count:
                why = f"there are {count} tiers; an override may change one or add tiers.{count}"
                raise _invalid(path, why, value)
            if int(rest[0]) == count:
                table.append({})
            table = table[int(rest[0])]
        if not isinstance(table, dict):
            raise _invalid(section, "expected a table", table)
        text = isinstance(value, str) and (section, rest[-1]) != ("tiers", "type")
        table[rest[-1]] = Text(value) if text else value


def _invalid(path: object, why: str, value: object) -> ConfigError:
    return ConfigError(f"{path} = {shown(value)}: {why}", field=str(path))
