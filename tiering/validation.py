"""Argument checks shared by the engine's modules: each raises InvalidArgumentError naming
the argument and the value."""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from tiering.errors import InvalidArgumentError


def positive_int(name: str, value: object, *, allow_zero: bool = False) -> int:
    """``value`` as an int if it is an integer (not a bool) above zero (or zero, with
    ``allow_zero``)."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = -1  # refused below
    if (number > 0 or (allow_zero and number == 0)) and not isinstance(value, bool):
        return number
    bound = "non-negative" if allow_zero else "positive"
    raise InvalidArgumentError(f"{name} must be a {bound} int, got {value!r}")


def as_block_hashes(
    block_hashes: Iterable[bytes], name: str = "block hashes"
) -> list[bytes] | tuple[bytes, ...]:
    """``block_hashes`` as a list or tuple of bytes; else InvalidArgumentError naming ``name``."""
    hashes = block_hashes if isinstance(block_hashes, list | tuple) else list(block_hashes)
    if set(map(type, hashes)) <= {bytes}:  # the common case, checked at C speed
        return hashes
    for h in hashes:
        if not isinstance(h, bytes):
            raise InvalidArgumentError(f"{name} must hold bytes, got {type(h).__name__} {h!r:.60}")
    return hashes


def hash_list(name: str, value: object) -> list[bytes]:
    """``value`` as a new list of bytes (block hashes); one bytes object is refused."""
    if isinstance(value, bytes | bytearray | memoryview | str):
        raise InvalidArgumentError(
            f"{name} must be a sequence of bytes hashes, got one {type(value).__name__} "
            f"{value!r:.60}; wrap a single hash in a list"
        )
    hashes = as_list(name, value, "bytes")
    as_block_hashes(hashes, name)
    return hashes


def as_list(name: str, value: object, what: str) -> list[Any]:
    """``value`` as a new list, if it is iterable."""
    try:
        return list(value)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgumentError(
            f"{name} must be an iterable of {what}, got {value!r:.60}"
        ) from None


def device_id_list(name: str, value: object, limit: int) -> list[int]:
    """``value`` as a new list of distinct ints in ``[0, limit)`` (device block ids)."""
    ids = as_index_list(name, value)
    check_index_range(name, ids, limit, unique=True)
    return ids


def as_index_list(name: str, values: object) -> list[int]:
    """``values`` (a sized iterable, not str or bytes) as a list of ints (``operator.index``;
    bools refused)."""
    if isinstance(values, str | bytes) or not hasattr(values, "__len__"):
        raise InvalidArgumentError(f"{name} must be a sequence of ints, got {values!r}")
    out: list[int] = []
    for value in values:  # type: ignore[attr-defined]
        if type(value) is not int:
            try:
                if isinstance(value, bool):
                    raise TypeError
                value = operator.index(value)
            except TypeError:
                raise InvalidArgumentError(f"{name} must hold ints, got {value!r}") from None
        out.append(value)
    return out


def check_index_range(name: str, values: Sequence[int], limit: int, *, unique: bool) -> None:
    """Raise unless every value is in ``[0, limit)`` (and, if ``unique``, none repeats)."""
    for value in values:
        if not 0 <= value < limit:
            raise InvalidArgumentError(f"{name}: {value} is outside 0..{limit - 1}")
    if unique:
        check_distinct(name, values)


def check_distinct(name: str, values: Sequence[Hashable]) -> None:
    """Raise unless no value repeats (naming the first seen twice, bytes in hex)."""
    if len(set(values)) == len(values):
        return
    seen: set[Hashable] = set()
    for value in values:
        if value in seen:
            shown = value.hex() if isinstance(value, bytes) else value
            raise InvalidArgumentError(f"{name}: {shown} appears twice; each block is named once")
        seen.add(value)


def check_offload_key(key: object) -> None:
    """Raise unless ``key`` (a tier's offload key) is bytes."""
    if not isinstance(key, bytes):
        raise InvalidArgumentError(f"keys must be bytes, got {type(key).__name__}")


def real(name: str, value: object, bound: str, within: Callable[[float], bool]) -> float:
    """``value`` as a float if it is a real number (not a bool) that ``within`` accepts;
    else InvalidArgumentError saying that ``name`` must be ``bound``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not within(value):
        raise InvalidArgumentError(f"{name} must be {bound}, got {value!r}")
    return float(value)


def seconds(name: str, value: object, *, allow_zero: bool) -> float:
    """``value`` as seconds: a finite, non-negative (or positive) real number."""
    bound = f"a {'non-negative' if allow_zero else 'positive'} finite number of seconds"
    return real(name, value, bound, lambda s: 0 <= s < math.inf and (allow_zero or s > 0))


def check_host_memory(num_blocks: int, block_bytes: int) -> None:
    """Refuse a CPU tier larger than this machine's memory before allocating anything."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if num_blocks * block_bytes > total:
        raise InvalidArgumentError(
            f"num_cpu_blocks={num_blocks} needs {num_blocks * block_bytes} bytes of host "
            f"memory ({block_bytes} per block); this machine has {total}"
        )
