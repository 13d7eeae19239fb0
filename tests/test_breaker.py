"""The circuit breaker of remote tiers (``backends.breaker``), with a stepped clock."""

from __future__ import annotations

import pytest

from backends.breaker import BreakerOptions, BreakerState, CircuitBreaker
from tiering.errors import InvalidArgumentError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, **options: float) -> CircuitBreaker:
    values = {"breaker_failures": 2, "breaker_backoff_s": 1.0, **options}
    return CircuitBreaker(BreakerOptions.check(values), clock=clock)


def test_it_opens_after_failures_in_a_row_and_refuses_until_the_back_off() -> None:
    clock = Clock()
    b = breaker(clock)
    b.failed()
    assert b.allow() and b.state is BreakerState.CLOSED
    b.failed()
    assert b.state is BreakerState.OPEN and not b.allow()
    clock.now += 0.99
    assert not b.allow()


def test_a_success_between_failures_resets_the_count() -> None:
    b = breaker(Clock())
    b.failed()
    b.succeeded()
    b.failed()
    assert b.state is BreakerState.CLOSED


def test_after_the_back_off_one_probe_goes_and_its_success_closes_it() -> None:
    clock = Clock()
    b = breaker(clock)
    b.failed()
    b.failed()
    clock.now += 1.0
    assert b.allow() and b.state is BreakerState.HALF_OPEN
    assert not b.allow()  # one probe at a time
    b.succeeded()
    assert b.state is BreakerState.CLOSED and b.allow()


def test_a_failed_probe_reopens_it_for_twice_as_long_up_to_the_cap() -> None:
    clock = Clock()
    b = breaker(clock, breaker_max_backoff_s=3.0)
    b.failed()
    b.failed()
    for wait in (1.0, 2.0, 3.0, 3.0):  # doubled each time, capped
        clock.now += wait - 0.01
        assert not b.allow()
        clock.now += 0.01
        assert b.allow()
        b.failed()
    assert b.state is BreakerState.OPEN


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"breaker_failures": 0}, "breaker_failures"),
        ({"breaker_backoff_s": 0}, "breaker_backoff_s"),
        ({"breaker_backoff_s": float("inf")}, "breaker_backoff_s"),
        ({"breaker_backoff_s": 5.0, "breaker_max_backoff_s": 1.0}, "breaker_max_backoff_s"),
    ],
)
def test_a_bad_option_is_named(options: dict, named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        BreakerOptions.check(options)


def test_without_options_it_opens_after_three_failures_for_one_second() -> None:
    clock = Clock()
    b = CircuitBreaker(clock=clock)
    for _ in range(3):
        assert b.state is BreakerState.CLOSED
        b.failed()
    assert not b.allow()
    clock.now += 1.0
    assert b.allow() and b.state is BreakerState.HALF_OPEN
