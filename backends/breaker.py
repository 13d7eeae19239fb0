"""A circuit breaker for a remote tier, sans-I/O: it decides, the tier does the calls.
It keeps a tier from stalling the engine on a dead server: the tier answers misses and
fails stores at once while it is open."""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum
from typing import Self

from pydantic import model_validator

from tiering.options import Options, PositiveInt, Seconds


class BreakerState(Enum):
    """Where a :class:`CircuitBreaker` is."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"

    def __str__(self) -> str:
        return self.value


class BreakerOptions(Options):
    """A :class:`CircuitBreaker`'s options, as a tier takes them."""

    breaker_failures: PositiveInt = 3
    breaker_backoff_s: Seconds = 1.0
    breaker_max_backoff_s: Seconds = 30.0

    @model_validator(mode="after")
    def _backoff_in_order(self) -> Self:
        if self.breaker_max_backoff_s < self.breaker_backoff_s:
            raise ValueError(
                f"breaker_max_backoff_s = {self.breaker_max_backoff_s!r} is below "
                f"breaker_backoff_s = {self.breaker_backoff_s!r}"
            )
        return self


class CircuitBreaker:
    """Counts connection failures and says whether the next call may go.

    Closed, calls go through; after ``breaker_failures`` connection failures in a row it
    opens, and :meth:`allow` is False until ``breaker_backoff_s`` has passed, then True
    for exactly one probe at a time (half-open). :meth:`succeeded` closes it and resets
    the back-off; :meth:`failed` during a probe reopens it for twice as long, up to
    ``breaker_max_backoff_s``."""

    def __init__(
        self,
        options: BreakerOptions | None = None,
        /,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = BreakerOptions() if options is None else options
        self._clock = clock
        self.state = BreakerState.CLOSED
        """Closed, open, or half-open (a probe is out); an open breaker whose back-off
        has passed still reads open until :meth:`allow` lets the probe go."""
        self._in_a_row = 0
        self._current_backoff = self.options.breaker_backoff_s
        self._retry_at = 0.0

    def allow(self) -> bool:
        """True if a call may go now (closed, or the one probe of a half-open breaker)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and self._clock() >= self._retry_at:
            self.state = BreakerState.HALF_OPEN
            return True
        return False

    def succeeded(self) -> None:
        """A call reached the server: close, and forget earlier failures."""
        self.state = BreakerState.CLOSED
        self._in_a_row = 0
        self._current_backoff = self.options.breaker_backoff_s

    def failed(self) -> None:
        """A call could not reach the server (refused, reset, timed out)."""
        if self.state is BreakerState.HALF_OPEN:
            self._current_backoff = min(
                self.options.breaker_max_backoff_s, self._current_backoff * 2
            )
            self._open()
            return
        self._in_a_row += 1
        if self.state is BreakerState.CLOSED and self._in_a_row >= self.options.breaker_failures:
            self._open()

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self._retry_at = self._clock() + self._current_backoff

    def __repr__(self) -> str:
        return f"<CircuitBreaker {self.state}, {self._in_a_row} failures in a row>"
