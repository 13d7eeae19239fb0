"""Settings for the threads that move bytes off the event loop: every thread pool of the
engine (device copies, tier I/O) starts its threads with :func:`init_io_worker`."""

from __future__ import annotations

import contextlib
import os
import threading

IO_WORKER_NICENESS = 5
"""How much lower than the loop thread the I/O workers are scheduled (Linux nice)."""

STAGING_BYTES = 32 << 20
"""The default staging buffer of an I/O thread that stages copies (device copies, NVMe
records under a framework's tier)."""


def init_io_worker() -> None:
    """Configure the calling thread as a bulk I/O worker: one torch intra-op thread and a
    lower scheduling priority (docs/architecture.md#the-event-loop-rule), both for this
    thread alone; best effort, never raises."""
    with contextlib.suppress(Exception):
        import torch

        torch.set_num_threads(1)
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + IO_WORKER_NICENESS
        )
