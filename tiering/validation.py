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


def hash_list(name: str, value: object) -> list[bytes]:
    """``value`` as a new list of bytes (block hashes).

    Raises:
        InvalidArgumentError: naming ``name`` and the value, if ``value`` is one bytes
            object, not iterable, or holds something that is not bytes.
    """
    if isinstance(value, bytes | bytearray | memoryview | str):
        raise InvalidArgumentError(
            f"{name} must be a sequence of bytes hashes, got one {type(value).__name__} "
            f"{value!r:.60}; wrap a single hash in a list"
        )
    try:
        hashes = list(value)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgumentError(
            f"{name} must be an iterable of bytes, got {value!r:.60}"
        ) from None
    for h in hashes:
        if type(h) is not bytes:
            raise InvalidArgumentError(f"{name} must hold bytes, got {type(h).__name__} {h!r:.60}")
    return hashes


def device_id_list(name: str, value: object, limit: int) -> list[int]:
    """``value`` as a new list of distinct ints in ``[0, limit)`` (device block ids).

    Raises:
        InvalidArgumentError: naming ``name`` and the value, if ``value`` is not an
            iterable of ints, an id is out of range, or an id repeats.
    """
    if isinstance(value, bytes | bytearray | str):
        raise InvalidArgumentError(f"{name} must be a sequence of ints, got {value!r:.60}")
    try:
        ids = list(value)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgumentError(
            f"{name} must be an iterable of ints, got {value!r:.60}"
        ) from None
    for i, d in enumerate(ids):
        if type(d) is not int:
            if isinstance(d, bool):
                raise InvalidArgumentError(f"{name} must hold ints, got {d!r}")
            try:
                ids[i] = d = operator.index(d)
            except TypeError:
                raise InvalidArgumentError(
                    f"{name} must hold ints, got {type(d).__name__} {d!r:.60}"
                ) from None
        if not 0 <= d < limit:
            raise InvalidArgumentError(
                f"{name}: {d} is outside the device KV cache (0..{limit - 1})"
            )
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        for d in ids:
            if d in seen:
                raise InvalidArgumentError(f"{name} repeats {d}; each device block is named once")
            seen.add(d)
    return ids
