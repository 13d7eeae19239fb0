"""Which prefixes a pool's hit policy lets SGLang restore (tiering.integrations.sglang_pools):
the sans-I/O core of ``batch_exists_v2``, against SGLang's definitions read literally."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiering.errors import InvalidArgumentError
from tiering.integrations.sglang_pools import block_group_pages, restorable_prefixes

presence = st.lists(st.booleans(), max_size=60)


@given(presence, st.integers(min_value=0, max_value=12))
def test_trailing_pages_need_the_window_before_the_prefix_end(
    present: list[bool], window: int
) -> None:
    need = max(1, window)  # SGLang reads an empty window as one page
    expected = {p for p in range(1, len(present) + 1)
                if all(present[max(0, p - need) : p])}  # fmt: skip
    assert restorable_prefixes(present, "trailing_pages", window) == expected


@given(presence, st.integers(min_value=0, max_value=12))
def test_all_pages_need_every_page_of_the_prefix(present: list[bool], window: int) -> None:
    expected = {p for p in range(1, len(present) + 1) if all(present[:p])}
    assert restorable_prefixes(present, "all_pages", window) == expected


@given(presence, st.integers(min_value=1, max_value=16))
def test_block_groups_gate_nothing_and_report_their_leading_whole_blocks(
    present: list[bool], block: int
) -> None:
    assert restorable_prefixes(present, "block_groups", 0) == set(range(1, len(present) + 1))
    whole = block_group_pages(present, block)
    assert whole % block == 0 and all(present[:whole])
    following = present[whole : whole + block]
    assert len(following) < block or not all(following)  # the next block is not whole


def test_an_unknown_policy_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgumentError, match=r"hit_policy.*'newest'"):
        restorable_prefixes([True], "newest", 1)
