"""The NVMe tier: blocks in append-only segment files on a local disk, an index
checkpointed beside them, recovery after a crash, and the offline scans of a root."""

from backends.nvme.options import NVMeOptions
from backends.nvme.tier import NVMeTier

__all__ = ["NVMeOptions", "NVMeTier"]
