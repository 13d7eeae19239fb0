"""Settings for the threads that move bytes off the event loop.

Every thread pool of the engine (device copies, tier I/O) starts its threads with
:func:`init_io_worker`, so that bulk copies never compete with the loop thread on
equal terms: the loop stays responsive even when the cores are busy copying.
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
      would take the cores the loop needs. OpenMP's thread count is per calling
      thread, so the serving framework's own threads are unaffected.
    * A lower scheduling priority (``IO_WORKER_NICENESS``): on a busy machine the
      loop thread wins the core, so its lag stays low while copies run at full speed
      on otherwise idle cores. Linux applies ``setpriority`` to one thread when given
      its thread id; raising niceness needs no privilege.
    """
    with contextlib.suppress(Exception):
        import torch

        torch.set_num_threads(1)
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + IO_WORKER_NICENESS
        )
