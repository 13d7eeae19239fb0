"""Tier registry: names, mappings, factories, entry points and lazy imports."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest

from backends.example import ExampleSecondaryTier
from backends.memory import MemoryTier
from tiering.errors import InvalidArgumentError, UnknownTierError
from tiering.tiers import registry
from tiering.tiers.registry import make_tier, register_tier, tier_names
from tiering.tiers.tier_api import SecondaryTierManager

BLOCK = 32


@pytest.fixture
def view() -> memoryview:
    return memoryview(bytearray(4 * BLOCK))


@pytest.fixture
def clean_registrations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process's registrations as they were, after the test."""
    monkeypatch.setattr(registry, "_REGISTERED", dict(registry._REGISTERED))


def test_built_in_names_are_listed() -> None:
    assert {"example", "memory", "nvme"} <= set(tier_names())


def test_a_name_builds_the_built_in_tier(view: memoryview) -> None:
    tier = make_tier("example", view, BLOCK)
    assert isinstance(tier, ExampleSecondaryTier)
    assert tier.block_bytes == BLOCK and tier.num_primary_slots == 4


def test_a_mapping_passes_its_options_to_the_constructor(view: memoryview) -> None:
    tier = make_tier({"type": "memory", "max_blocks": 7, "max_inflight": 2}, view, BLOCK)
    assert isinstance(tier, MemoryTier)
    assert (tier.max_blocks, tier.max_inflight) == (7, 2)
    tier.shutdown()


def test_a_callable_spec_is_called_with_the_view_and_block_size(view: memoryview) -> None:
    seen: list[tuple[memoryview, int]] = []

    def factory(primary_kv_view: memoryview, block_bytes: int) -> SecondaryTierManager:
        seen.append((primary_kv_view, block_bytes))
        return ExampleSecondaryTier(primary_kv_view, block_bytes, max_blocks=3)

    tier = make_tier(factory, view, BLOCK)
    assert isinstance(tier, ExampleSecondaryTier) and tier.max_blocks == 3
    assert seen == [(view, BLOCK)]


def test_unknown_name_raises_listing_the_known_names(view: memoryview) -> None:
    with pytest.raises(UnknownTierError, match="unknown tier 'tape'") as info:
        make_tier("tape", view, BLOCK)
    assert "'memory'" in str(info.value) and "'example'" in str(info.value)


def test_unexpected_option_raises_naming_the_tier(view: memoryview) -> None:
    with pytest.raises(InvalidArgumentError, match=r"tier 'memory'.*colour"):
        make_tier({"type": "memory", "colour": "blue"}, view, BLOCK)


def test_option_rejected_by_the_tier_raises_naming_the_tier(view: memoryview) -> None:
    with pytest.raises(InvalidArgumentError, match=r"tier 'memory'.*max_blocks"):
        make_tier({"type": "memory", "max_blocks": -5}, view, BLOCK)


@pytest.mark.parametrize(
    "spec",
    [{"max_blocks": 3}, {"type": 5}, {"type": "example", 1: 2}, 42],
)
def test_malformed_spec_raises_invalid_argument(view: memoryview, spec: object) -> None:
    with pytest.raises(InvalidArgumentError):
        make_tier(spec, view, BLOCK)  # type: ignore[arg-type]


def test_factory_returning_a_non_tier_is_rejected(view: memoryview) -> None:
    with pytest.raises(InvalidArgumentError, match="not a SecondaryTierManager"):
        make_tier(lambda v, b: object(), view, BLOCK)  # type: ignore[arg-type,return-value]


@pytest.mark.usefixtures("clean_registrations")
def test_registered_factory_is_buildable_and_listed(view: memoryview) -> None:
    def custom(primary_kv_view: memoryview, block_bytes: int, *, size: int) -> SecondaryTierManager:
        return ExampleSecondaryTier(primary_kv_view, block_bytes, max_blocks=size)

    register_tier("custom", custom)
    assert "custom" in tier_names()
    tier = make_tier({"type": "custom", "size": 9}, view, BLOCK)
    assert isinstance(tier, ExampleSecondaryTier) and tier.max_blocks == 9


@pytest.mark.usefixtures("clean_registrations")
def test_registration_overrides_a_built_in(view: memoryview) -> None:
    tier = make_tier("memory", view, BLOCK)
    assert isinstance(tier, MemoryTier)
    tier.shutdown()
    register_tier("memory", lambda v, b: ExampleSecondaryTier(v, b))
    assert isinstance(make_tier("memory", view, BLOCK), ExampleSecondaryTier)


def test_register_rejects_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="non-empty str"):
        register_tier("", ExampleSecondaryTier)
    with pytest.raises(InvalidArgumentError, match="not callable"):
        register_tier("broken", 3)  # type: ignore[arg-type]
    assert "broken" not in tier_names()


def test_entry_points_of_the_group_are_buildable(
    view: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin = EntryPoint(
        name="plugin",
        value="backends.example:ExampleSecondaryTier",
        group=registry.ENTRY_POINT_GROUP,
    )
    monkeypatch.setattr(
        registry, "entry_points", lambda group: (plugin,) if group == plugin.group else ()
    )
    assert "plugin" in tier_names()
    tier = make_tier({"type": "plugin", "max_blocks": 2}, view, BLOCK)
    assert isinstance(tier, ExampleSecondaryTier) and tier.max_blocks == 2


def test_a_built_in_whose_module_is_missing_raises_unknown_tier(
    view: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(registry._BUILTINS, "ghost", "backends.no_such_module:Ghost")
    with pytest.raises(UnknownTierError, match=r"'ghost'.*cannot be imported"):
        make_tier("ghost", view, BLOCK)


def test_importing_tiering_imports_no_backend() -> None:
    code = (
        "import sys, tiering, tiering.tiers.registry, tiering.tiers.actor; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'backends'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.usefixtures("clean_registrations")
def test_engine_defaults_reach_only_tiers_whose_options_declare_them(view: memoryview) -> None:
    seen: dict[str, object] = {}

    def custom(primary_kv_view: memoryview, block_bytes: int, **options: object) -> MemoryTier:
        seen.update(options)  # a factory without typed options checks its own
        return MemoryTier(primary_kv_view, block_bytes)

    register_tier("custom", custom)
    make_tier({"type": "custom", "size": "9"}, view, BLOCK, defaults={"namespace": "n"}).shutdown()
    assert seen == {"size": "9"}  # as given, and no namespace

    memory = make_tier({"type": "memory"}, view, BLOCK, defaults={"namespace": "n"})
    memory.shutdown()  # MemoryOptions declares no namespace: none was passed, none refused


def test_a_named_tiers_options_are_checked_and_converted_before_it_is_built(
    view: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[object] = []
    monkeypatch.setattr(MemoryTier, "__init__", lambda self, *a, **k: built.append(k))
    with pytest.raises(InvalidArgumentError, match=r"tier 'memory'.*max_blocks = 'x'"):
        make_tier({"type": "memory", "max_blocks": "x"}, view, BLOCK)
    assert built == []  # refused before the tier existed

    with pytest.raises(InvalidArgumentError, match=r"capacity_bytes = '5 parsecs'"):
        registry.check_options("nvme", {"root": "/x", "capacity_bytes": "5 parsecs"})
    checked = registry.check_options(
        "nvme", {"root": "/x", "capacity_bytes": "2MiB"}, defaults={"namespace": "n", "x": 1}
    )
    assert checked == {"namespace": "n", "root": "/x", "capacity_bytes": 2 << 20}


def test_the_replay_finds_a_tiers_model_by_name_and_names_the_tiers_that_have_one() -> None:
    from backends.nvme.replay_model import SegmentLog

    assert registry.replay_model("nvme") is SegmentLog
    with pytest.raises(UnknownTierError, match=r"'memory' has no replay model.*\['nvme'\]"):
        registry.replay_model("memory")
