"""Latency histograms with fixed, log-spaced buckets, sans-I/O: what the engine records
per job."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

from tiering.errors import InvalidArgumentError

DEFAULT_BOUNDS: tuple[float, ...] = (
    *(float(f"{m}e{e}") for e in range(-5, 2) for m in (1, 2, 5)),
    100.0,
)
"""Inclusive upper bounds (seconds) of the finite buckets, 1-2-5 steps from 10 µs to
100 s: a quantile estimate is off by at most a factor 2.5; above 100 s is ``+Inf``."""


@dataclass(frozen=True, slots=True)
class LatencySnapshot:
    """A reading of a :class:`LatencyHistogram`: ``cumulative[i]`` observations were
    ``<= bounds[i]`` seconds, the last (``+Inf``) all ``count``; ``sum``, ``max`` in s."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum: float
    count: int
    max: float

    def quantile(self, q: float) -> float:
        """The ``q``-quantile in seconds, interpolated linearly inside the bucket that
        holds the true one and never above ``max``; NaN for no observations. Raises
        InvalidArgumentError unless 0 < ``q`` <= 1."""
        if not isinstance(q, int | float) or not 0 < q <= 1:
            raise InvalidArgumentError(f"quantile must lie in (0, 1], got {q!r}")
        if not self.count:
            return math.nan
        rank = q * self.count
        cumulative = self.cumulative
        b = bisect_left(cumulative, rank)  # the first bucket reaching the rank
        below = cumulative[b - 1] if b else 0
        lower = self.bounds[b - 1] if b else 0.0
        upper = min(self.bounds[b], self.max) if b < len(self.bounds) else self.max
        lower = min(lower, upper)
        inside = cumulative[b] - below
        return min(upper, lower + (upper - lower) * (rank - below) / inside)  # rounding


class LatencyHistogram:
    """Counts observations in fixed buckets (a binary search and two additions each); not
    thread-safe. Raises InvalidArgumentError unless ``bounds`` are positive finite
    numbers, strictly ascending."""

    __slots__ = ("_bounds", "_counts", "_max", "_sum")

    def __init__(self, bounds: Sequence[float] = DEFAULT_BOUNDS) -> None:
        checked = tuple(bounds)
        if not checked or any(
            not isinstance(b, int | float) or not math.isfinite(b) or b <= 0 for b in checked
        ):
            raise InvalidArgumentError(
                f"bounds must be positive finite numbers, got {list(bounds)!r}"
            )
        if any(a >= b for a, b in pairwise(checked)):
            raise InvalidArgumentError(f"bounds must be strictly ascending, got {list(checked)!r}")
        self._bounds = tuple(float(b) for b in checked)
        self._counts = [0] * (len(checked) + 1)  # per bucket, the last one is +Inf
        self._sum = 0.0
        self._max = 0.0

    def observe(self, seconds: float) -> None:
        """Record one observation; a negative one (a clock that stepped back) counts as 0."""
        if seconds < 0:  # branches, not max(): this runs once per job
            seconds = 0.0
        self._counts[bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds
        if seconds > self._max:
            self._max = seconds

    def snapshot(self) -> LatencySnapshot:
        # One C-level copy first: the buckets are read together.
        cumulative = tuple(accumulate(list(self._counts)))
        return LatencySnapshot(self._bounds, cumulative, self._sum, cumulative[-1], self._max)

    def __repr__(self) -> str:
        snap = self.snapshot()
        if not snap.count:
            return "<LatencyHistogram empty>"
        p50, p99 = snap.quantile(0.5) * 1e6, snap.quantile(0.99) * 1e6
        return f"<LatencyHistogram n={snap.count} p50~{p50:.0f}µs p99~{p99:.0f}µs>"
