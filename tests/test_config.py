"""tiering.config: TOML in and out, overrides, errors that name the field, and the engine
built from a config (real tiers, a real block round trip)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BeforeValidator
from pydantic_core import PydanticUndefined

from tiering import InvalidArgumentError, TieringEngine
from tiering.config import (
    EngineConfig,
    MetricsConfig,
    ReplayConfig,
    SyntheticConfig,
    TierConfig,
    TieringConfig,
    config_from_toml,
    load_config,
    parse_override,
    to_toml,
    with_overrides,
)
from tiering.core.policies import policy_names
from tiering.errors import ConfigError
from tiering.options import Options, Size
from tiering.tiers import registry

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def doc_example() -> str:
    """The example file in docs/config.md, verbatim: the first ```toml block."""
    blocks = re.findall(r"```toml\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)
    assert blocks, "docs/config.md has no ```toml block"
    return blocks[0]


def write(tmp_path: Path, text: str, name: str = "kv-tiering.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------- loading


def test_the_documented_example_loads_as_described(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, doc_example()))

    assert config.engine == EngineConfig(
        cpu_bytes=64 << 30,
        policy="arc",
        write_policy="write_back",
        cache_identity="llama-3.1-8b@rev1",
        enable_events=True,
    )
    assert [tier.spec() for tier in config.tiers] == [
        {"type": "memory", "max_blocks": 4096},
        {
            "type": "nvme",
            "root": "/mnt/nvme/kv-cache",
            "capacity_bytes": 500 << 30,
            "fsync": "batch",
        },
    ]
    assert config.replay == ReplayConfig(
        trace=str(tmp_path / "traces" / "conversation.jsonl"),  # the file's directory's
        limit=10000,
        pace=2.0,
        block_bytes=128 << 10,
    )
    assert config.synthetic == SyntheticConfig()
    assert config.metrics == MetricsConfig(port=9400)


def test_the_documented_policies_are_every_built_in_one() -> None:
    text = DOC.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| `policy` |"))
    documented = re.findall(r"`([a-z0-9-]+)`", row.split("|")[3])
    assert sorted(documented) == sorted(policy_names())


def test_a_file_with_only_the_cpu_size_takes_every_default(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[engine]\ncpu_blocks = 64\n"))

    assert config == TieringConfig(engine=EngineConfig(cpu_blocks=64))
    assert config.engine.policy == "lru"
    assert config.engine.write_policy == "write_through"
    assert config.tiers == ()
    assert config.replay.pace == "max"
    assert config.replay.block_bytes == 64 << 10
    assert config.metrics == MetricsConfig(port=None, prefix="kv_tiering")


def test_a_file_round_trips_through_to_toml(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, doc_example()))

    again = load_config(write(tmp_path, to_toml(config), "again.toml"))

    assert again == config
    assert to_toml(again) == to_toml(config)


def test_ints_given_for_floats_are_held_as_floats() -> None:
    config = config_from_toml("[engine]\ncpu_blocks = 1\ntier_timeout = 3\n[replay]\npace = 2\n")

    assert config.engine.tier_timeout == 3.0 and type(config.engine.tier_timeout) is float
    assert config.replay.pace == 2.0 and type(config.replay.pace) is float


def test_tier_options_are_read_only() -> None:
    tier = TierConfig("memory", {"max_blocks": 8})

    with pytest.raises(TypeError):
        tier.options["max_blocks"] = 9  # type: ignore[index]
    assert tier.spec() == {"type": "memory", "max_blocks": 8}


_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)
_finite = st.floats(min_value=0.001, max_value=1e6, allow_nan=False, allow_infinity=False)
_sizes = st.integers(min_value=1, max_value=1 << 50)

_configs = st.builds(
    TieringConfig,
    engine=st.one_of(
        st.builds(EngineConfig, cpu_blocks=st.integers(1, 1 << 30)),
        st.builds(EngineConfig, cpu_bytes=_sizes),
    ).flatmap(
        lambda engine: st.builds(
            EngineConfig,
            cpu_blocks=st.just(engine.cpu_blocks),
            cpu_bytes=st.just(engine.cpu_bytes),
            policy=st.sampled_from(["lru", "arc", "s3fifo"]),
            write_policy=st.sampled_from(["write_through", "write_back"]),
            block_size=st.integers(1, 1024),
            cache_identity=st.text(),  # quotes, backslashes, control characters, emoji
            enable_events=st.booleans(),
            tier_timeout=_finite,
            room_timeout=_finite,
            close_timeout=_finite,
        )
    ),
    tiers=st.lists(
        st.one_of(
            st.builds(
                TierConfig,
                st.just("memory"),
                st.fixed_dictionaries({"max_blocks": st.integers(1, 1 << 20)}),
            ),
            st.builds(
                TierConfig,
                st.just("nvme"),
                st.fixed_dictionaries(
                    {"root": st.text(min_size=1), "capacity_bytes": _sizes},
                    optional={
                        "fsync": st.sampled_from(["none", "batch", "always"]),
                        "hot_fraction": st.floats(0, 1),
                        "o_direct": st.booleans(),
                    },
                ),
            ),
        ),
        max_size=3,
    ).map(tuple),
    replay=st.builds(
        ReplayConfig,
        trace=st.none() | st.text(),
        limit=st.none() | st.integers(1, 10**9),
        pace=st.just("max") | _finite,
        device_blocks=st.none() | st.integers(1, 1 << 20),
        block_bytes=_sizes,
        verify=st.booleans(),
        full_blocks_only=st.booleans(),
    ),
    synthetic=st.builds(
        SyntheticConfig,
        sessions=st.integers(1, 10**6),
        system_prompt_blocks=st.integers(0, 100),
        rate_per_s=_finite,
    ),
    metrics=st.builds(
        MetricsConfig,
        port=st.none() | st.integers(0, 65535),
        prefix=st.from_regex(r"[a-z_][a-z0-9_:]{0,20}", fullmatch=True),
    ),
)


@settings(max_examples=150, deadline=None)
@given(_configs)
def test_to_toml_then_loading_gives_an_equal_config(config: TieringConfig) -> None:
    assert config_from_toml(to_toml(config)) == config


# ---------------------------------------------------------------------------- errors

_ENGINE = "[engine]\ncpu_blocks = 8\n"


@pytest.mark.parametrize(
    ("text", "field", "value"),
    [
        pytest.param(_ENGINE + "block_size = '16'\n", "engine.block_size", "'16'", id="wrong-type"),
        pytest.param(
            _ENGINE + "write_policy = 'sometimes'\n",
            "engine.write_policy",
            "'sometimes'",
            id="bad-choice",
        ),
        pytest.param(_ENGINE + "polcy = 'arc'\n", "engine.polcy", "'arc'", id="unknown-key"),
        pytest.param(_ENGINE + "policy = 'mru'\n", "engine.policy", "'mru'", id="unknown-policy"),
        pytest.param(_ENGINE + "room_timeout = -1\n", "engine.room_timeout", "-1", id="negative"),
        pytest.param(_ENGINE + "[replays]\nlimit = 3\n", "replays", "{'limit': 3}", id="section"),
        pytest.param(_ENGINE + "replay = 3\n", "engine.replay", "3", id="key-not-section"),
        pytest.param(_ENGINE + "[[tiers]]\ntype = 'nvmx'\n", "tiers[0].type", "'nvmx'", id="tier"),
        pytest.param(
            _ENGINE + "[[tiers]]\ntype = 'nvme'\nroot = '/x'\ncapacty_bytes = 1\n",
            "tiers[0].capacty_bytes",
            "1",
            id="tier-option",
        ),
        pytest.param(
            _ENGINE + "[[tiers]]\ntype = 'memory'\n[[tiers]]\ntype = 'memory'\nmax_blocks = 'x'\n",
            "tiers[1].max_blocks",
            "'x'",
            id="tier-option-type",
        ),
        pytest.param(
            _ENGINE + "[[tiers]]\ntype = 'nvme'\nroot = '/x'\ncapacity_bytes = '5 parsecs'\n",
            "tiers[0].capacity_bytes",
            "'5 parsecs'",
            id="tier-size-string",
        ),
        pytest.param(
            _ENGINE + "[[tiers]]\ntype = 'nvme'\nroot = '/x'\ncapacity_bytes = 1\nclock = 1\n",
            "tiers[0].clock",
            "1",
            id="tier-option-no-config-can-hold",
        ),
        pytest.param(
            "[engine]\ncpu_bytes = '64 GiBs'\n", "engine.cpu_bytes", "'64 GiBs'", id="size"
        ),
        pytest.param(
            "[engine]\ncpu_blocks = 8\ncpu_bytes = '1GiB'\n",
            "engine.cpu_blocks",
            "8",
            id="both-cpu-sizes",
        ),
        pytest.param("[engine]\npolicy = 'arc'\n", "engine.cpu_blocks", "neither", id="neither"),
        pytest.param("", "engine.cpu_blocks", "neither", id="empty-file"),
        pytest.param(_ENGINE + "[replay]\npace = 0\n", "replay.pace", "0", id="pace-zero"),
        pytest.param(_ENGINE + "[replay]\npace = 'fast'\n", "replay.pace", "'fast'", id="pace"),
        pytest.param(_ENGINE + "[metrics]\nport = 70000\n", "metrics.port", "70000", id="port"),
        pytest.param(_ENGINE + "tiers = 3\n", "engine.tiers", "3", id="tiers-in-engine"),
        pytest.param("tiers = 3\n" + _ENGINE, "tiers", "3", id="tiers-not-array"),
    ],
)
def test_every_error_names_the_file_the_field_and_the_value(
    tmp_path: Path, text: str, field: str, value: str
) -> None:
    path = write(tmp_path, text)

    with pytest.raises(ConfigError) as caught:
        load_config(path)

    message = str(caught.value)
    assert message.startswith(f"{path}: "), message
    assert field in message, message
    assert value in message, message
    assert caught.value.field.startswith(field.split(".")[0]), caught.value.field
    assert caught.value.source == str(path)
    assert isinstance(caught.value, InvalidArgumentError)  # one class for callers to catch


def test_a_required_tier_option_left_out_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, _ENGINE + "[[tiers]]\ntype = 'nvme'\nroot = '/x'\n")

    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity_bytes: tier 'nvme' needs"):
        load_config(path)


def test_a_tier_without_a_type_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, _ENGINE + "[[tiers]]\nmax_blocks = 3\n")

    with pytest.raises(ConfigError, match=r"tiers\[0\]\.type = None: every tier needs a type"):
        load_config(path)


def test_a_file_that_is_not_toml_or_not_there_is_a_config_error(tmp_path: Path) -> None:
    broken = write(tmp_path, "[engine\ncpu_blocks = 8\n")
    with pytest.raises(ConfigError, match=re.escape(f"{broken}: not valid TOML")):
        load_config(broken)
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: EngineConfig(cpu_blocks=0), "engine.cpu_blocks = 0"),
        (lambda: EngineConfig(cpu_blocks=True), "engine.cpu_blocks = True"),
        (lambda: EngineConfig(cpu_blocks=1, write_policy="x"), "engine.write_policy = 'x'"),
        (lambda: ReplayConfig(device_blocks=2.5), "replay.device_blocks = 2.5"),
        (lambda: SyntheticConfig(rate_per_s=float("inf")), "synthetic.rate_per_s = inf"),
        (lambda: MetricsConfig(prefix="9lives"), "metrics.prefix = '9lives'"),
        (lambda: TierConfig("memory", {"max_block": 3}), "tier.max_block = 3"),
        (lambda: TierConfig("nope"), "tier.type = 'nope'"),
        (lambda: TieringConfig(engine=None), "engine = None"),  # type: ignore[arg-type]
        (
            lambda: TieringConfig(EngineConfig(cpu_blocks=1), tiers=("memory",)),  # type: ignore[arg-type]
            "tiers[0] = 'memory'",
        ),
    ],
)
def test_configs_built_in_code_are_checked_too(build: Any, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build()
    assert str(caught.value).startswith(field), str(caught.value)


def test_size_strings_are_read_in_code_as_in_files() -> None:
    assert EngineConfig(cpu_bytes="2MiB").cpu_bytes == 2 << 20  # type: ignore[arg-type]
    tier = TierConfig("nvme", {"root": "/x", "capacity_bytes": "1.5G", "min_free_bytes": 0})
    assert tier.options["capacity_bytes"] == 3 << 29
    assert tier.options["min_free_bytes"] == 0


def _options_models() -> dict[str, type[Options]]:
    """Every typed options model of the config: each built-in tier's and each section's."""
    models: dict[str, type[Options]] = {}
    for name in registry.tier_names():
        if (model := registry.tier_options(name)) is not None:
            models[f"tier {name}"] = model
    sections = (EngineConfig, ReplayConfig, SyntheticConfig, MetricsConfig)
    return models | {f"[{section.WHERE}]": section for section in sections}


def _before_validators(annotation: Any, metadata: Sequence[object] = ()) -> list[object]:
    """The functions of every BeforeValidator on a field's type (in a union's members too)."""
    found = [item.func for item in metadata if isinstance(item, BeforeValidator)]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        base, *inner = typing.get_args(annotation)
        return found + _before_validators(base, inner)
    if origin in (typing.Union, types.UnionType):
        return found + [f for arg in typing.get_args(annotation) for f in _before_validators(arg)]
    return found


def test_every_bytes_option_takes_a_size_string_through_the_one_size_validator() -> None:
    checked = []
    for owner, model in _options_models().items():
        for name, field in model.model_fields.items():
            if name.endswith("_bytes"):
                found = _before_validators(field.annotation, field.metadata)
                assert found == [Size.__metadata__[0].func], f"{owner} {name}"
                checked.append(name)
    assert {"cpu_bytes", "block_bytes", "capacity_bytes", "pipeline_bytes"} <= set(checked)


def test_the_redis_tiers_pipeline_bytes_takes_a_size_string(tmp_path: Path) -> None:
    tier = TierConfig("redis", {"url": "redis://127.0.0.1:6379/0", "pipeline_bytes": "2MiB"})
    assert tier.options["pipeline_bytes"] == 2 << 20
    path = write(tmp_path, "[engine]\ncpu_blocks = 8\n[[tiers]]\ntype = 'redis'\n"
                 "url = 'redis://127.0.0.1:6379/0'\npipeline_bytes = '512KiB'\n")  # fmt: skip
    assert load_config(path).tiers[0].options["pipeline_bytes"] == 512 << 10


# ---------------------------------------------------------------------------- overrides


@pytest.fixture
def base() -> TieringConfig:
    return config_from_toml(doc_example())


@pytest.mark.parametrize(
    ("path", "text", "read", "expected"),
    [
        ("engine.policy", "lru", lambda c: c.engine.policy, "lru"),
        ("engine.block_size", "32", lambda c: c.engine.block_size, 32),
        ("engine.enable_events", "false", lambda c: c.engine.enable_events, False),
        ("engine.enable_events", "On", lambda c: c.engine.enable_events, True),
        ("engine.cpu_bytes", "1GiB", lambda c: c.engine.cpu_bytes, 1 << 30),
        ("engine.tier_timeout", "2.5", lambda c: c.engine.tier_timeout, 2.5),
        ("engine.room_timeout", "0", lambda c: c.engine.room_timeout, 0.0),
        ("replay.pace", "2.0", lambda c: c.replay.pace, 2.0),
        ("replay.pace", "max", lambda c: c.replay.pace, "max"),
        ("replay.trace", "none", lambda c: c.replay.trace, None),
        ("replay.limit", "", lambda c: c.replay.limit, None),
        ("replay.block_bytes", "256K", lambda c: c.replay.block_bytes, 256 << 10),
        ("synthetic.seed", "-7", lambda c: c.synthetic.seed, -7),
        ("metrics.port", "none", lambda c: c.metrics.port, None),
        ("synthetic.rate_per_s", "5", lambda c: c.synthetic.rate_per_s, 5.0),
        ("tiers.0.max_blocks", "64", lambda c: c.tiers[0].options["max_blocks"], 64),
        ("tiers.0.policy", "arc", lambda c: c.tiers[0].options["policy"], "arc"),
        (
            "tiers.1.capacity_bytes",
            "64GiB",
            lambda c: c.tiers[1].options["capacity_bytes"],
            64 << 30,
        ),
        ("tiers.1.min_free_bytes", "0", lambda c: c.tiers[1].options["min_free_bytes"], 0),
        ("tiers.1.o_direct", "none", lambda c: c.tiers[1].options["o_direct"], None),
        ("tiers.1.o_direct", "true", lambda c: c.tiers[1].options["o_direct"], True),
        ("tiers.1.hot_fraction", "1", lambda c: c.tiers[1].options["hot_fraction"], 1.0),
        ("tiers.2.type", "example", lambda c: c.tiers[2].type, "example"),
    ],
)
def test_an_override_converts_text_to_the_fields_type(
    base: TieringConfig, path: str, text: str, read: Any, expected: object
) -> None:
    changed = with_overrides(base, {path: text})

    value = read(changed)
    assert value == expected and type(value) is type(expected)


def test_overrides_change_nothing_else_and_never_the_original(base: TieringConfig) -> None:
    before = to_toml(base)

    changed = with_overrides(base, {"engine.cpu_bytes": "none", "engine.cpu_blocks": "128"})

    assert to_toml(base) == before
    assert changed.engine.cpu_blocks == 128 and changed.engine.cpu_bytes is None
    assert changed.tiers == base.tiers and changed.replay == base.replay
    assert changed.engine.policy == base.engine.policy


def test_values_that_are_not_text_must_have_the_fields_type(base: TieringConfig) -> None:
    assert with_overrides(base, {"replay.limit": 5, "replay.pace": 3}).replay.limit == 5
    with pytest.raises(ConfigError, match=r"replay\.limit = 5\.0: Input should be a valid integer"):
        with_overrides(base, {"replay.limit": 5.0})


def test_an_override_may_add_a_tier_that_then_needs_a_type(base: TieringConfig) -> None:
    added = with_overrides(base, {"tiers.2.max_blocks": "8", "tiers.2.type": "memory"})
    assert added.tiers[2] == TierConfig("memory", {"max_blocks": 8})

    with pytest.raises(ConfigError, match=r"tiers\[2\]\.type = None: every tier needs a type"):
        with_overrides(base, {"tiers.2.max_blocks": "8"})


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"engine.block_size": "sixteen"}, "engine.block_size = 'sixteen'"),
        ({"engine.polcy": "arc"}, "engine.polcy = 'arc': unknown key"),
        ({"engine": "arc"}, "engine = 'arc'"),
        ({"engine.policy.name": "arc"}, "engine.policy.name = 'arc'"),
        ({"engnie.policy": "arc"}, "engnie.policy = 'arc': unknown section"),
        ({"replay.pace": "-1"}, "replay.pace = '-1'"),
        ({"replay.verify": "maybe"}, "replay.verify = 'maybe'"),
        ({"tiers.5.type": "memory"}, "tiers.5.type = 'memory': there are 2 tiers"),
        ({"tiers.x.type": "memory"}, "tiers.x.type = 'memory'"),
        ({"tiers.1.capacity_bytes": "lots"}, "tiers[1].capacity_bytes = 'lots'"),
        ({"tiers.1.capacty_bytes": "1G"}, "tiers[1].capacty_bytes = '1G'"),
        ({"tiers.1.type": "memory"}, "tiers[1].root = '/mnt/nvme/kv-cache'"),
        ({"engine.cpu_blocks": "64"}, "engine.cpu_blocks = 64, engine.cpu_bytes"),
    ],
)
def test_a_bad_override_is_named_and_nothing_is_applied(
    base: TieringConfig, overrides: dict[str, str], named: str
) -> None:
    batch = {"engine.policy": "s3fifo", **overrides}  # a good one first: not applied either

    with pytest.raises(ConfigError) as caught:
        with_overrides(base, batch)

    assert str(caught.value).startswith(named), str(caught.value)
    assert base.engine.policy == "arc"


_PATHS = (
    "[engine]\ncpu_blocks = 8\n\n[[tiers]]\ntype = 'nvme'\nroot = 'kv'\ncapacity_bytes = 4096\n"
    "\n[[tiers]]\ntype = 'nvme'\nroot = '/abs/kv'\ncapacity_bytes = 4096\n"
    "\n[replay]\ntrace = 'traces/t.jsonl'\n"
)


def test_relative_paths_in_a_file_are_taken_from_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "configs").mkdir()
    write(tmp_path / "configs", _PATHS)
    monkeypatch.chdir(tmp_path)  # another directory than the file's

    config = load_config("configs/kv-tiering.toml")

    assert config.replay.trace == str(tmp_path / "configs" / "traces" / "t.jsonl")
    assert config.tiers[0].options["root"] == str(tmp_path / "configs" / "kv")
    assert config.tiers[1].options["root"] == "/abs/kv"  # an absolute path stays


def test_a_tiers_file_options_are_taken_from_the_files_directory(tmp_path: Path) -> None:
    pytest.importorskip("redis", reason="pip install 'kv-tiering[redis]'")
    text = (
        "[engine]\ncpu_blocks = 8\n\n[[tiers]]\ntype = 'redis'\nurl = 'rediss://127.0.0.1:6390/0'\n"
        "tls_ca_file = 'ca.pem'\n"
    )
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")  # checked: a file

    config = load_config(write(tmp_path, text))

    assert config.tiers[0].options["tls_ca_file"] == str(tmp_path / "ca.pem")


def test_paths_given_as_overrides_stay_relative_to_the_current_directory(tmp_path: Path) -> None:
    path = write(tmp_path, _PATHS)

    config = load_config(path, {"replay.trace": "mine.jsonl", "tiers.0.root": "here"})

    assert config.replay.trace == "mine.jsonl"
    assert config.tiers[0].options["root"] == "here"


def test_load_config_applies_overrides_before_checking(tmp_path: Path) -> None:
    path = write(tmp_path, "[engine]\npolicy = 'arc'\n")  # no CPU size: invalid alone

    config = load_config(path, {"engine.cpu_blocks": "32"})

    assert config.engine == EngineConfig(cpu_blocks=32, policy="arc")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: engine.block_size = '0'")):
        load_config(path, {"engine.cpu_blocks": "32", "engine.block_size": "0"})


@pytest.mark.filterwarnings("ignore:eviction policy 'prefix-lfu' is retired:DeprecationWarning")
def test_the_retired_policy_name_in_a_file_or_an_override_means_adaptive(tmp_path: Path) -> None:
    path = write(tmp_path, "[engine]\ncpu_blocks = 32\npolicy = 'prefix-lfu'\n")
    assert load_config(path).engine.policy == "adaptive"
    overridden = load_config(
        write(tmp_path, "[engine]\ncpu_blocks = 32\n", "b.toml"), {"engine.policy": "prefix-lfu"}
    )
    assert overridden.engine.policy == "adaptive"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("engine.policy=arc", ("engine.policy", "arc")),
        (" tiers.0.capacity_bytes = 64GiB ", ("tiers.0.capacity_bytes", "64GiB")),
        ("replay.trace=a=b.jsonl", ("replay.trace", "a=b.jsonl")),
        ("replay.limit=", ("replay.limit", "")),
    ],
)
def test_parse_override_splits_at_the_first_equals(text: str, expected: tuple[str, str]) -> None:
    assert parse_override(text) == expected


@pytest.mark.parametrize("text", ["engine.policy", "=arc", "policy=arc", "engine..policy=arc"])
def test_parse_override_refuses_what_is_no_override(text: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(repr(text))):
        parse_override(text)


def test_to_toml_refuses_an_option_toml_cannot_hold() -> None:
    from tiering.core.policies import LRUPolicy

    config = TieringConfig(
        EngineConfig(cpu_blocks=4), (TierConfig("memory", {"policy": LRUPolicy()}),)
    )

    with pytest.raises(ConfigError, match=r"tiers\[0\]\.policy = <"):
        to_toml(config)


# ---------------------------------------------------------------------------- the engine


def _kv() -> torch.Tensor:
    return torch.randn(8, 4, 64).half()  # 8 device blocks of 512 bytes


def _engine_config(tmp_path: Path) -> TieringConfig:
    """The documented example, shrunk to this test: CPU, memory and NVMe under tmp_path."""
    return with_overrides(
        config_from_toml(doc_example()),
        {
            "engine.cpu_bytes": "2KiB",  # 4 slots of 512 bytes
            "engine.write_policy": "write_through",
            "tiers.0.max_blocks": "16",
            "tiers.1.root": str(tmp_path / "nvme"),
            "tiers.1.capacity_bytes": "64MiB",
            "tiers.1.min_free_bytes": "0",
        },
    )


async def test_from_config_builds_an_engine_that_round_trips_a_block_through_nvme(
    tmp_path: Path,
) -> None:
    config = _engine_config(tmp_path)
    kv = _kv()
    keys = [bytes([i]) * 8 for i in range(3)]
    stored = kv[[0, 1, 2]].clone()

    async with TieringEngine.from_config(config, kv) as engine:
        assert engine.statistics().capacity_blocks == 4  # cpu_bytes / 512
        assert engine.write_policy == "write_through" and engine.enable_events
        job = engine.store(keys, [0, 1, 2])
        assert (await job).success
        assert await job.cascaded
        assert engine.tiers[1].statistics().used_blocks == 3

    # A new engine from the same config: the CPU and memory tiers start empty, so the
    # blocks can only come back from the NVMe tier's files.
    kv[[0, 1, 2]] = 0
    async with TieringEngine.from_config(config, kv) as again:
        assert again.lookup(keys) == 3
        result = await again.load(keys, [5, 6, 7])
        assert result.success
        assert torch.equal(kv[[5, 6, 7]], stored)
        assert again.tiers[0].statistics().used_blocks == 0


def test_cpu_bytes_that_hold_no_block_are_named(tmp_path: Path) -> None:
    config = with_overrides(_engine_config(tmp_path), {"engine.cpu_bytes": "256"})

    with pytest.raises(ConfigError, match=r"engine\.cpu_bytes = 256: holds no block"):
        TieringEngine.from_config(config, _kv())


def test_the_config_does_not_import_the_engine() -> None:
    code = "import sys, tiering.config; assert 'tiering.engine' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_from_config_refuses_what_is_not_a_config() -> None:
    with pytest.raises(ConfigError, match="config = "):
        TieringEngine.from_config({"engine": {"cpu_blocks": 4}}, _kv())  # type: ignore[arg-type]


def test_an_option_a_tier_computes_itself_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="takes no option 'file_bytes'"):
        TierConfig("nvme", {"root": "/tmp/x", "capacity_bytes": 1 << 20, "file_bytes": 4096})


# ---------------------------------------------------------------------------- the docs' tables


def _type_name(annotation: Any, metadata: Sequence[object] = ()) -> str:
    """An option's type as docs/config.md writes it (``size`` for a Size)."""
    if any(isinstance(item, BeforeValidator) for item in metadata):
        return "size"
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        base, *inner = typing.get_args(annotation)
        return _type_name(base, inner)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(member) for member in typing.get_args(annotation))
    if origin is typing.Literal:
        return " \\| ".join(f'"{choice}"' for choice in typing.get_args(annotation))
    if annotation is type(None):
        return "none"
    return str(getattr(origin or annotation, "__name__", annotation))


def _default_text(name: str, default: object) -> str:
    if default is PydanticUndefined:
        return "required"
    if default is None:
        return "none"
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    if isinstance(default, str):
        return f'`"{default}"`'
    if isinstance(default, int) and name.endswith("_mode"):
        return f"`0o{default:o}`"
    if callable(default):
        return f"`{default.__module__}.{default.__name__}`"
    return f"`{default}`"


@pytest.mark.parametrize(
    ("tier", "model"),
    [
        ("memory", "backends.memory:MemoryOptions"),
        ("example", "backends.example:ExampleOptions"),
        ("nvme", "backends.nvme.options:NVMeOptions"),
        ("redis", "backends.redis.tier:RedisOptions"),
    ],
)
def test_the_documented_option_tables_are_the_tiers_options(tier: str, model: str) -> None:
    module, _, name = model.partition(":")
    options = getattr(importlib.import_module(module), name)
    assert registry.tier_options(tier) is options
    text = DOC.read_text(encoding="utf-8")
    section = text.split(f"##### `{tier}`\n\n", 1)[1].split("\n\n", 1)[0]
    expected = ["| option | type | default |", "|---|---|---|"] + [
        f"| `{option}` | {_type_name(field.annotation, field.metadata)} | "
        f"{_default_text(option, field.default)} |"
        for option, field in options.model_fields.items()
    ]

    assert section.splitlines() == expected


# ---------------------------------------------------------------------------- the command line


def test_shortcut_options_come_after_the_file_and_before_set(tmp_path: Path) -> None:
    from tiering.cli import build_parser
    from tiering.commands._workload import cpu_shortcut, resolve_config
    from tiering.commands.replay import _tier_shortcuts

    path = write(tmp_path, "[engine]\ncpu_blocks = 8\npolicy = 'arc'\n[[tiers]]\ntype = 'memory'\n")
    line = ["replay", "--config", str(path), "--cpu", "64", "--nvme", str(tmp_path / "kv")]

    def resolved(*more: str) -> TieringConfig:
        args = build_parser("replay").parse_args([*line, *more])
        return resolve_config(args, cpu_shortcut(args.cpu), _tier_shortcuts(args))

    config = resolved()
    assert config.engine.cpu_blocks == 64 and config.engine.policy == "arc"  # over the file
    assert [tier.type for tier in config.tiers] == ["memory", "nvme"]  # added after its tiers
    assert config.tiers[1].options["capacity_bytes"] == 4 << 30  # --nvme-size's default

    config = resolved("--set", "engine.cpu_blocks=32", "--set", "tiers.1.capacity_bytes=8MiB")
    assert config.engine.cpu_blocks == 32  # --set over --cpu
    assert config.tiers[1].options["capacity_bytes"] == 8 << 20  # --set over --nvme-size
