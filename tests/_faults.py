"""Fault injection for file-backed tiers: make chosen system calls fail, fall short or
stall; and which threads made them.

:class:`FaultInjector` is an :class:`~backends.nvme.os_calls.OsCalls` that passes every
call to a real one unless a rule says otherwise. Rules match a call by operation name
and, optionally, by a substring of the path involved (for calls on a file descriptor,
the path it was opened with) and, for writes, by the key of a block record header they
carry. A rule can raise an ``OSError`` with a chosen errno (ENOSPC, EIO, ...), make a
read or write transfer fewer bytes than asked (a real, shorter transfer), make
``statvfs`` report a chosen amount of free space, or make a call SLOW: hold it until the
test opens a gate (:meth:`FaultInjector.hold`) or sleep a given time first
(:meth:`FaultInjector.delay`); a slow call then runs for real. Tests use it where a real
faulty device cannot be had; it is safe to use from several worker threads at once.

Example::

    faults = FaultInjector()
    faults.fail("pwritev", errno.ENOSPC)          # the disk is full, for every write
    faults.fail("preadv", errno.EIO, path="ab12", times=1)  # one file, once
    gate = faults.hold("pwritev", key=key)          # that key's write waits ...
    ...                                             # ... (gate.reached is set when it does)
    gate.open()                                     # ... until here
    tier = NVMeTier(view, block_bytes, root=..., namespace=..., capacity_bytes=...,
                os_calls=faults)
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from backends.nvme.os_calls import REAL_OS, OsCalls
from tiering.errors import InvalidArgumentError
from tiering.tiers.block_record import MAGIC

OPERATIONS = frozenset(
    {
        "open",
        "close",
        "pwritev",
        "preadv",
        "fstat",
        "fdatasync",
        "fsync",
        "allocate",
        "replace",
        "unlink",
        "statvfs",
    }
)
_TRANSFERS = frozenset({"pwritev", "preadv"})
_TENANT_LENGTH_OFFSET = 56
"""Where a block record header holds its tenant's length; the tenant, then the key,
follow from ``_KEY_OFFSET`` (see tiering/tiers/block_record.py)."""
_KEY_OFFSET = 76


@dataclass(slots=True)
class Fault:
    """One rule. ``times`` None means forever; ``after`` matching calls pass first.

    A rule made by :meth:`FaultInjector.hold` has a ``gate``: a matching call sets
    ``reached``, then blocks until the gate is opened (:meth:`open`), then runs. A rule
    made by :meth:`FaultInjector.delay` sleeps ``delay_s`` before the call runs.
    """

    op: str
    path: str | None = None
    key: bytes | None = None
    errno: int | None = None
    max_bytes: int | None = None
    free_bytes: int | None = None
    delay_s: float | None = None
    gate: threading.Event | None = None
    reached: threading.Event = field(default_factory=threading.Event)
    times: int | None = None
    after: int = 0
    hits: int = 0

    def open(self) -> None:
        """Let every call held by this rule, and every later matching call, go on."""
        if self.gate is not None:
            self.gate.set()

    def wait_reached(self, timeout: float) -> bool:
        """Block until a call has matched this rule (True) or ``timeout`` s passed."""
        return self.reached.wait(timeout)

    def _matches(self, op: str, path: str | None, buffers: Sequence[memoryview]) -> bool:
        if op != self.op or (self.times is not None and self.times <= 0):
            return False
        if self.key is not None and not any(_is_header_of(b, self.key) for b in buffers):
            return False
        return self.path is None or (path is not None and self.path in path)


class FaultInjector(OsCalls):
    """An ``OsCalls`` that injects the faults its rules describe; see the module doc."""

    def __init__(self, inner: OsCalls = REAL_OS) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._rules: list[Fault] = []
        self._fd_paths: dict[int, str] = {}
        self.calls: Counter[str] = Counter()
        """How many times each operation was called (faulty or not)."""
        self.threads: defaultdict[str, set[str]] = defaultdict(set)
        """The names of the threads that called each operation."""

    # -- rules -----------------------------------------------------------------------

    def fail(
        self,
        op: str,
        err: int,
        *,
        path: str | None = None,
        key: bytes | None = None,
        times: int | None = None,
        after: int = 0,
    ) -> Fault:
        """Make ``op`` raise ``OSError(err)`` on matching calls; with ``key``, only the
        writes that carry a block record header of ``key``.

        Raises:
            InvalidArgumentError: unknown operation, or a non-positive ``times``.
        """
        return self._add(Fault(op, path=path, key=key, errno=err, times=times, after=after))

    def short_read(
        self, *, max_bytes: int, path: str | None = None, times: int | None = None
    ) -> Fault:
        """Make matching ``preadv`` calls read at most ``max_bytes`` bytes."""
        return self._add(Fault("preadv", path=path, max_bytes=max_bytes, times=times))

    def short_write(
        self, *, max_bytes: int, path: str | None = None, times: int | None = None
    ) -> Fault:
        """Make matching ``pwritev`` calls write at most ``max_bytes`` bytes."""
        return self._add(Fault("pwritev", path=path, max_bytes=max_bytes, times=times))

    def hold(
        self,
        op: str,
        *,
        path: str | None = None,
        key: bytes | None = None,
        times: int | None = 1,
        after: int = 0,
    ) -> Fault:
        """Make matching calls block, in the calling thread, until the rule is opened;
        ``key`` as for :meth:`fail`.

        The returned rule's ``reached`` is set as a call starts waiting; ``open()`` lets
        it (and later matching calls) run for real. :meth:`remove` and :meth:`clear`
        open the gates of the rules they drop, so no thread is left waiting. ``times``
        defaults to 1: one call is held.

        Raises:
            InvalidArgumentError: unknown operation, or a non-positive ``times``.
        """
        gate = threading.Event()
        return self._add(Fault(op, path=path, key=key, gate=gate, times=times, after=after))

    def delay(
        self,
        op: str,
        seconds: float,
        *,
        path: str | None = None,
        times: int | None = None,
        after: int = 0,
    ) -> Fault:
        """Make matching calls sleep ``seconds`` (in the calling thread), then run.

        Raises:
            InvalidArgumentError: unknown operation, non-positive ``times``, or
                ``seconds`` not a finite number >= 0.
        """
        if (
            not isinstance(seconds, int | float)
            or isinstance(seconds, bool)
            or not 0 <= seconds < float("inf")
        ):
            raise InvalidArgumentError(f"seconds must be a finite number >= 0, got {seconds!r}")
        return self._add(Fault(op, path=path, delay_s=float(seconds), times=times, after=after))

    def report_free_bytes(self, free: int, *, path: str | None = None) -> Fault:
        """Make ``statvfs`` report ``free`` bytes available (everything else is real)."""
        return self._add(Fault("statvfs", path=path, free_bytes=free))

    def remove(self, fault: Fault) -> None:
        """Drop one rule (opening its gate); calls behave normally again where it matched."""
        with self._lock:
            self._rules = [rule for rule in self._rules if rule is not fault]
        fault.open()

    def clear(self) -> None:
        """Drop every rule, opening every gate."""
        with self._lock:
            dropped, self._rules = self._rules, []
        for rule in dropped:
            rule.open()

    def _add(self, fault: Fault) -> Fault:
        if fault.op not in OPERATIONS:
            raise InvalidArgumentError(
                f"unknown operation {fault.op!r}; choose one of {sorted(OPERATIONS)}"
            )
        if fault.times is not None and fault.times <= 0:
            raise InvalidArgumentError(f"times must be positive or None, got {fault.times}")
        if fault.max_bytes is not None and fault.max_bytes < 0:
            raise InvalidArgumentError(f"max_bytes must be >= 0, got {fault.max_bytes}")
        with self._lock:
            self._rules.append(fault)
        return fault

    def _fire(self, op: str, path: str | None, buffers: Sequence[memoryview] = ()) -> Fault | None:
        """Count the call; return the rule that applies to it, raising its error if any."""
        with self._lock:
            self.calls[op] += 1
            self.threads[op].add(threading.current_thread().name)
            for rule in self._rules:
                if not rule._matches(op, path, buffers):
                    continue
                if rule.after > 0:
                    rule.after -= 1
                    continue
                rule.hits += 1
                if rule.times is not None:
                    rule.times -= 1
                break
            else:
                return None
        rule.reached.set()
        # Outside the lock: a held or sleeping call must not stall the other threads.
        if rule.gate is not None:
            rule.gate.wait()
        if rule.delay_s:
            time.sleep(rule.delay_s)
        if rule.errno is not None:
            raise OSError(rule.errno, f"{os.strerror(rule.errno)} (injected)", path)
        return rule

    def _path_of(self, fd: int) -> str | None:
        with self._lock:
            return self._fd_paths.get(fd)

    # -- calls -----------------------------------------------------------------------

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        self._fire("open", path)
        fd = self._inner.open(path, flags, mode)
        with self._lock:
            self._fd_paths[fd] = path
        return fd

    def close(self, fd: int) -> None:
        path = self._path_of(fd)
        with self._lock:
            self._fd_paths.pop(fd, None)
        self._inner.close(fd)
        self._fire("close", path)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        rule = self._fire("pwritev", self._path_of(fd), buffers)
        return self._inner.pwritev(fd, _limit(buffers, rule), offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        rule = self._fire("preadv", self._path_of(fd))
        return self._inner.preadv(fd, _limit(buffers, rule), offset)

    def fstat(self, fd: int) -> os.stat_result:
        self._fire("fstat", self._path_of(fd))
        return self._inner.fstat(fd)

    def fdatasync(self, fd: int) -> None:
        self._fire("fdatasync", self._path_of(fd))
        self._inner.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        self._fire("fsync", self._path_of(fd))
        self._inner.fsync(fd)

    def allocate(self, fd: int, offset: int, length: int) -> None:
        self._fire("allocate", self._path_of(fd))
        self._inner.allocate(fd, offset, length)

    def replace(self, src: str, dst: str) -> None:
        self._fire("replace", dst)
        self._inner.replace(src, dst)

    def unlink(self, path: str) -> None:
        self._fire("unlink", path)
        self._inner.unlink(path)

    def statvfs(self, path: str) -> os.statvfs_result:
        rule = self._fire("statvfs", path)
        real = self._inner.statvfs(path)
        if rule is None or rule.free_bytes is None:
            return real
        available = rule.free_bytes // real.f_frsize
        fields = list(real)
        fields[3] = max(fields[3], available)  # f_bfree >= f_bavail
        fields[4] = available
        return os.statvfs_result(fields)


def _is_header_of(buffer: memoryview, key: bytes) -> bool:
    """Whether ``buffer`` starts with a block record header naming ``key``."""
    if buffer.nbytes < _KEY_OFFSET or buffer[: len(MAGIC)] != MAGIC:
        return False
    tenant = buffer[_TENANT_LENGTH_OFFSET : _TENANT_LENGTH_OFFSET + 2]
    start = _KEY_OFFSET + int.from_bytes(tenant, "little")
    return buffer[start : start + len(key)] == key


def _limit(buffers: Sequence[memoryview], rule: Fault | None) -> Sequence[memoryview]:
    if rule is None or rule.max_bytes is None:
        return buffers
    left = rule.max_bytes
    limited: list[memoryview] = []
    for buffer in buffers:
        if left <= 0:
            break
        piece = buffer if buffer.nbytes <= left else buffer[:left]
        limited.append(piece)
        left -= piece.nbytes
    return limited
