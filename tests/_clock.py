"""A clock that only the test moves: what write budgets count on in tests."""

from __future__ import annotations


class FakeClock:
    """Seconds, starting at ``now``; a test sets or advances ``now`` itself."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
