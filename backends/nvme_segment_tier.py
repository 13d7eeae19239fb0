"""Deprecated module name: the NVMe tier is :class:`backends.nvme.NVMeTier`.

``NVMeSegmentTier`` stays importable from here for code written before the two layouts
became one tier.
"""

from __future__ import annotations

from backends.nvme import NVMeTier
from backends.nvme_space import MOVE_BYTES_PER_JOB

NVMeSegmentTier = NVMeTier

__all__ = ["MOVE_BYTES_PER_JOB", "NVMeSegmentTier"]
