"""The one lifecycle every long-lived object of kv-tiering goes through.

Engine, tiers and copier all move ``NEW -> OPEN -> CLOSING -> CLOSED`` and never back:
``OPEN`` once started (entered, or ``start()`` returned), ``CLOSING`` from the moment a
graceful or hard close begins (nothing new is admitted), ``CLOSED`` once every task,
thread and buffer it owns has been released.
"""

from __future__ import annotations

import enum


class Lifecycle(enum.Enum):
    """Where an engine, tier or copier is in its life; only ever moves forward."""

    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"

    @property
    def accepting(self) -> bool:
        """True only while new work is admitted (``OPEN``)."""
        return self is Lifecycle.OPEN

    def __str__(self) -> str:
        return self.value


__all__ = ["Lifecycle"]
