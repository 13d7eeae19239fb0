"""Argument checks shared by the engine's modules; each raises InvalidArgumentError."""

from __future__ import annotations

import operator

from tiering.errors import InvalidArgumentError


def positive_int(name: str, value: object) -> int:
    """``value`` as an int if it is an integer (not a bool) greater than zero.

    Raises:
        InvalidArgumentError: naming ``name`` and the value otherwise.
    """
    if not isinstance(value, bool):
        try:
            number = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if number > 0:
                return number
    raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
