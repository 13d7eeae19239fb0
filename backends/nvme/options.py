"""The NVMe tier's options, :class:`NVMeOptions` (``NVMeTier.Options``): the single
source for its constructor, the registry, the config, ``--set`` and docs/config.md."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from backends.nvme.segments import GIL_PAUSE_BYTES
from tiering.options import ActorOptions, Bytes, PositiveInt, SecondsOrZero, Size, secret
from tiering.security.encryption import Keyring


def _mode(required: int, allowed: int) -> AfterValidator:
    def check(mode: int) -> int:
        if mode & required != required or mode & ~allowed:
            raise ValueError(
                f"must include 0o{required:o} and stay within 0o{allowed:o} (nobody but the "
                f"owner may write), got 0o{mode:o}"
            )
        return mode

    return AfterValidator(check)


def _an_object(value: object) -> object:
    if isinstance(value, str | bytes | int | float | list | dict):
        raise ValueError("must be an object such as OsCalls, which a config cannot hold")
    return value


class NVMeOptions(ActorOptions):
    """The NVMe tier's options (docs/nvme.md says what each does)."""

    root: str | os.PathLike[str]
    namespace: str = Field(min_length=1)
    capacity_bytes: Bytes
    min_free_bytes: Size = Field(1 << 30, ge=0)
    fsync: Literal["none", "batch", "always"] = "batch"
    o_direct: bool | None = None
    max_inflight_bytes: Bytes = 256 << 20
    enospc_retry_s: SecondsOrZero = 5.0
    encryption: str | Keyring | None = secret(None)
    file_mode: Annotated[int, _mode(0o600, 0o644)] = 0o600
    dir_mode: Annotated[int, _mode(0o700, 0o755)] = 0o700
    os_calls: Annotated[Any, AfterValidator(_an_object)] = Field(
        None, description="the OS calls (a test double); None: the real ones"
    )
    clock: Callable[[], float] = time.monotonic
    segment_bytes: Bytes | None = None
    checkpoint_every: PositiveInt = 16384
    hot_fraction: float = Field(0.25, ge=0, le=1)
    gil_pause_bytes: Size = Field(GIL_PAUSE_BYTES, ge=0)
    staging_bytes: Size = Field(0, ge=0)
    drive_writes_per_day: float | None = Field(None, gt=0, allow_inf_nan=False)
