"""The one lifecycle every long-lived object of kv-tiering goes through.

Engine, tiers and copier all move ``NEW -> OPEN -> CLOSING -> CLOSED`` and never back:
``OPEN`` once started (entered, or ``start()`` returned), ``CLOSING`` from the moment a
graceful or hard close begins (nothing new is admitted), ``CLOSED`` once its work is
answered and its threads and buffers are released (a task it cancelled may still be
unwinding on the loop for an iteration).
"""

from __future__ import annotations

import enum


class Lifecycle(enum.Enum):
    """Where an engine, tier or copier is in its life; only ever moves forward."""

    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"

    def __str__(self) -> str:
        return self.value


__all__ = ["Lifecycle"]
