"""Settings for the threads that move bytes off the event loop: every thread pool of the
engine (device copies, tier I/O) starts its threads with :func:`init_io_worker`.
"""

from __future__ import annotations

import contextlib
import os
import threading

IO_WORKER_NICENESS = 5
"""How much lower than the loop thread the I/O workers are scheduled (Linux nice)."""


def init_io_worker() -> None:
    """Configure the calling thread as a bulk I/O worker; best effort, never raises.

    * One torch intra-op thread: a copy is memory-bound, and torch's OpenMP threads
      would take the cores the loop needs (the count is per thread: the framework's
      own threads keep theirs).
    * A lower scheduling priority, so that on a busy machine the loop thread wins the
      core (Linux applies ``setpriority`` to the one thread its id names).
    """
    with contextlib.suppress(Exception):
        import torch

        torch.set_num_threads(1)
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + IO_WORKER_NICENESS
        )
