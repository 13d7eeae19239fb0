"""LatencyHistogram: buckets, cumulative counts, quantile estimates."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiering.errors import InvalidArgumentError
from tiering.observe.latency import DEFAULT_BOUNDS, LatencyHistogram


def test_default_bounds_are_1_2_5_steps_from_10us_to_100s() -> None:
    assert DEFAULT_BOUNDS[:4] == (1e-5, 2e-5, 5e-5, 1e-4)
    assert DEFAULT_BOUNDS[-3:] == (20.0, 50.0, 100.0)
    assert len(DEFAULT_BOUNDS) == 22
    assert all(
        b / a == pytest.approx(2.0) or b / a == pytest.approx(2.5)
        for a, b in pairwise(DEFAULT_BOUNDS)
    )


def test_an_observation_on_a_bound_counts_in_that_bucket() -> None:
    hist = LatencyHistogram()
    hist.observe(1e-5)
    hist.observe(2e-5)
    hist.observe(2.000001e-5)
    snap = hist.snapshot()
    assert snap.cumulative[:3] == (1, 2, 3)
    assert snap.cumulative[-1] == snap.count == 3


def test_large_and_negative_observations() -> None:
    hist = LatencyHistogram((0.001, 0.01))
    hist.observe(5.0)  # beyond the last bound: +Inf only
    hist.observe(-1.0)  # a clock step back: counts as 0
    snap = hist.snapshot()
    assert snap.cumulative == (1, 1, 2)
    assert snap.sum == 5.0 and snap.max == 5.0 and snap.count == 2


def test_quantile_interpolates_inside_the_bucket_and_never_exceeds_the_max() -> None:
    hist = LatencyHistogram()
    for _ in range(100):
        hist.observe(3e-5)  # bucket (2e-5, 5e-5]
    snap = hist.snapshot()
    assert snap.quantile(0.5) == pytest.approx(2.5e-5)  # halfway from 2e-5 to the max 3e-5
    assert snap.quantile(1.0) == pytest.approx(3e-5)


def test_quantile_in_the_inf_bucket_is_bounded_by_the_max() -> None:
    hist = LatencyHistogram((1.0,))
    hist.observe(0.5)
    hist.observe(7.0)
    snap = hist.snapshot()
    assert snap.quantile(0.5) == pytest.approx(1.0)  # rank 1 of the 1 in [0, 1]: its top
    assert snap.quantile(1.0) == pytest.approx(7.0)
    assert 1.0 <= snap.quantile(0.75) <= 7.0


def test_a_snapshot_does_not_change_afterwards() -> None:
    hist = LatencyHistogram()
    hist.observe(0.001)
    snap = hist.snapshot()
    hist.observe(0.002)
    assert snap.count == 1 and snap.cumulative[-1] == 1 and hist.snapshot().count == 2


def test_empty_histogram() -> None:
    snap = LatencyHistogram().snapshot()
    assert snap.count == 0 and snap.sum == 0.0 and set(snap.cumulative) == {0}
    assert math.isnan(snap.quantile(0.5)) and snap.count == 0


@pytest.mark.parametrize("q", [0, -0.1, 1.5, "0.5", math.nan])
def test_quantile_outside_0_1_is_refused(q: object) -> None:
    with pytest.raises(InvalidArgumentError, match="quantile"):
        LatencyHistogram().snapshot().quantile(q)  # type: ignore[arg-type]


@pytest.mark.parametrize("bounds", [(), (0.0, 1.0), (1.0, 1.0), (2.0, 1.0), (math.inf,), ("1",)])
def test_bad_bounds_are_refused(bounds: tuple[object, ...]) -> None:
    with pytest.raises(InvalidArgumentError, match="bounds"):
        LatencyHistogram(bounds)  # type: ignore[arg-type]


@given(
    values=st.lists(
        st.floats(min_value=0.0, max_value=500.0, allow_nan=False, allow_infinity=False),
        min_size=1,
        max_size=200,
    ),
    q=st.floats(min_value=0.001, max_value=1.0),
)
def test_the_estimate_lies_in_the_bucket_of_the_true_quantile(
    values: list[float], q: float
) -> None:
    hist = LatencyHistogram()
    for v in values:
        hist.observe(v)
    snap = hist.snapshot()
    assert snap.count == len(values)
    assert snap.sum == pytest.approx(sum(values))
    assert snap.max == max(values)
    for i, bound in enumerate(DEFAULT_BOUNDS):
        assert snap.cumulative[i] == sum(1 for v in values if v <= bound)
    true = sorted(values)[math.ceil(q * len(values)) - 1]
    b = next((i for i, bound in enumerate(DEFAULT_BOUNDS) if true <= bound), len(DEFAULT_BOUNDS))
    lower = DEFAULT_BOUNDS[b - 1] if b else 0.0
    upper = min(DEFAULT_BOUNDS[b] if b < len(DEFAULT_BOUNDS) else math.inf, snap.max)
    estimate = snap.quantile(q)
    assert min(lower, upper) <= estimate <= upper
