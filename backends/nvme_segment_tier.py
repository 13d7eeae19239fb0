"""Deprecated module name: ``NVMeSegmentTier`` is :class:`backends.nvme.NVMeTier`."""

from backends.nvme import NVMeTier as NVMeSegmentTier
from backends.nvme_space import MOVE_BYTES_PER_JOB

__all__ = ["MOVE_BYTES_PER_JOB", "NVMeSegmentTier"]
