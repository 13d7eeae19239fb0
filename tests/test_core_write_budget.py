"""The write budget's token bucket (tiering/core/write_budget.py), on a fake clock; that no
minute writes more than it allows: tests/test_core_admission.py, through a tier's gate."""

from __future__ import annotations

import pytest

from tests._clock import FakeClock
from tiering.core.write_budget import WriteBudget
from tiering.errors import InvalidArgumentError


def test_a_steady_offer_above_the_budget_gets_the_budget() -> None:
    clock = FakeClock()
    budget = WriteBudget(10 * 512, 512, clock)  # ten blocks a second
    taken = 0
    for _ in range(600):  # a minute of 30 blocks offered every 0.1 s
        clock.now += 0.1
        fit = min(30, budget.available())
        budget.spend(fit)
        taken += fit
    assert 600 <= taken <= 610  # the minute's budget, and at most a second saved before it


def test_spending_past_the_budget_is_paid_back_before_anything_more() -> None:
    clock = FakeClock()
    budget = WriteBudget(2 * 512, 512, clock)
    budget.spend(10)  # a flush of ten blocks: eight below the bucket's two
    clock.now += 3.9
    assert budget.available() == 0
    clock.now += 1.1  # 5 s: ten blocks earned, the bucket back at its two
    assert budget.available() == 2


def test_a_clock_going_back_earns_nothing() -> None:
    clock = FakeClock()
    budget = WriteBudget(512, 512, clock)
    assert budget.available() == 1
    budget.spend(1)
    clock.now -= 100
    assert budget.available() == 0


@pytest.mark.parametrize(
    ("bytes_per_s", "block_bytes"), [(0, 512), (float("inf"), 512), (True, 512), (10, 0)]
)
def test_a_bad_budget_is_refused_naming_it(bytes_per_s: float, block_bytes: int) -> None:
    name = "block_bytes" if block_bytes == 0 else "write_budget"
    with pytest.raises(InvalidArgumentError, match=name):
        WriteBudget(bytes_per_s, block_bytes)
