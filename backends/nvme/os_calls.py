"""The operating-system layer of the NVMe tier: :class:`OsCalls` (every system call of
the blocking code, so tests can inject faults), direct I/O, owner locks, private roots
(docs/security.md), and how the loop awaits file-system operations (:func:`fs_call`)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal, TypeVar

import aiofiles.os

from tiering.errors import InvalidArgumentError

FsyncPolicy = Literal["none", "batch", "always"]
_T = TypeVar("_T")

ALIGNMENT = 4096  # of buffer addresses, file offsets and lengths for O_DIRECT

OWNERS_DIR = "owners"
PROBE_PREFIX = ".odirect-probe."
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # a link in a root is never followed

_FALLOCATE: Any
try:  # the C library's, with errno kept; None where it lacks one
    _FALLOCATE = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).fallocate
    _FALLOCATE.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
except (OSError, AttributeError):
    _FALLOCATE = None


class OsCalls:
    """The system calls the blocking core makes, as methods a test can override."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        """``os.open``, never through a link, close-on-exec, created files private (0600)."""
        return os.open(path, flags | _O_NOFOLLOW | _O_CLOEXEC, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def allocate(self, fd: int, offset: int, length: int) -> None:
        """Allocate ``length`` bytes of ``fd`` from ``offset`` (``fallocate``, off the GIL);
        nothing where it is lacking; OSError if it fails (ENOSPC, EIO...)."""
        if _FALLOCATE is None or _FALLOCATE(fd, 0, offset, length) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise OSError(err, os.strerror(err))

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def statvfs(self, path: str) -> os.statvfs_result:
        return os.statvfs(path)


REAL_OS = OsCalls()


def free_bytes(statvfs: os.statvfs_result) -> int:
    """Bytes an unprivileged writer can still use; 0 when the inodes are exhausted."""
    if statvfs.f_files and not statvfs.f_favail:
        return 0
    return statvfs.f_bavail * statvfs.f_frsize


def write_all(os_calls: OsCalls, fd: int, buffers: list[memoryview], offset: int) -> None:
    """Write every byte of ``buffers`` at ``offset`` with ``pwritev``, resuming after
    short writes; OSError if one fails or makes no progress (EIO)."""
    total = sum(buffer.nbytes for buffer in buffers)
    written = 0
    while written < total:
        done = os_calls.pwritev(fd, buffers, offset + written)
        if done <= 0:
            raise OSError(errno.EIO, "write made no progress")
        written += done
        buffers = advance_buffers(buffers, done)


def fsync_dir(os_calls: OsCalls, directory: str) -> None:
    """Make ``directory``'s entries durable (``fsync`` of the directory; OSError if not)."""
    fd = os_calls.open(directory, os.O_RDONLY)
    try:
        os_calls.fsync(fd)
    finally:
        os_calls.close(fd)


def probe_o_direct(directory: str, os_calls: OsCalls = REAL_OS) -> str | None:
    """None if a page written and read back with O_DIRECT in ``directory`` round-trips,
    else why not. OSErrors other than an O_DIRECT refusal propagate."""
    if not O_DIRECT:
        return "O_DIRECT is not available on this platform"
    path = os.path.join(directory, f"{PROBE_PREFIX}{os.getpid()}.{os.urandom(6).hex()}")
    page = memoryview(mmap.mmap(-1, ALIGNMENT))  # page-aligned, as O_DIRECT needs
    page[:8] = b"kvprobe!"
    try:
        fd = os_calls.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_DIRECT)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return f"open with O_DIRECT failed: {os.strerror(exc.errno)}"
        raise
    try:
        if os_calls.pwritev(fd, [page], 0) != ALIGNMENT:
            return "a direct write was short"
        page[:8] = bytes(8)
        if os_calls.preadv(fd, [page], 0) != ALIGNMENT or page[:8] != b"kvprobe!":
            return "a direct read did not return what was written"
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return f"direct I/O failed: {os.strerror(exc.errno)}"
        raise
    finally:
        os_calls.close(fd)
        os_calls.unlink(path)
    return None


class OwnerLock:
    """This writer's liveness lock: ``owners/<instance>.lock`` held with ``flock``,
    renamed into place already locked, so a starting writer never looks dead."""

    def __init__(self, namespace_dir: str, instance_id: str) -> None:
        self.instance_id = instance_id
        owners = os.path.join(namespace_dir, OWNERS_DIR)
        self.path = os.path.join(owners, f"{instance_id}.lock")
        staging = os.path.join(owners, f".{instance_id}.new")
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.replace(staging, self.path)
        except OSError:
            os.close(fd)
            os.unlink(staging)
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        """Remove the lock file and drop the lock; idempotent."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


def owner_alive(namespace_dir: str, instance_id: str) -> bool:
    """True if the writer ``instance_id`` still holds its lock (is running), or if that
    cannot be told: nothing of a writer that may be running is ever removed."""
    path = os.path.join(namespace_dir, OWNERS_DIR, f"{instance_id}.lock")
    try:
        fd = os.open(path, os.O_RDWR | _O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell (a lock file this user cannot open): assume it runs
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def advance_buffers(buffers: list[memoryview], done: int) -> list[memoryview]:
    """What is left of ``buffers`` after a vectored transfer moved ``done`` bytes."""
    rest: list[memoryview] = []
    for buffer in buffers:
        if done >= buffer.nbytes:
            done -= buffer.nbytes
            continue
        rest.append(buffer[done:] if done else buffer)
        done = 0
    return rest


def describe_os_error(exc: OSError) -> str:
    """An OSError as 'ENAME: message' for reasons and logs."""
    if exc.errno is None:
        return str(exc)
    return f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror or os.strerror(exc.errno)}"


def check_private(option: str, path: str) -> None:
    """InvalidArgumentError (naming ``option``, the path and the fault) unless ``path``
    is a directory of this user that nobody else may write to."""
    status = os.stat(path)
    if not stat.S_ISDIR(status.st_mode):
        raise InvalidArgumentError(f"{option}: {path!r} is not a directory")
    if status.st_uid != os.geteuid():
        raise InvalidArgumentError(
            f"{option}: {path!r} belongs to user {status.st_uid}, not to this process's "
            f"({os.geteuid()}): another user could read or replace the KV blocks in it"
        )
    if status.st_mode & 0o022:
        raise InvalidArgumentError(
            f"{option}: {path!r} has mode {stat.S_IMODE(status.st_mode):o}: others can write "
            "to it (plant or swap files); make it writable by its owner only (chmod go-w)"
        )


# What the OS answers when a path a user gave cannot hold a root's entries (no permission,
# read-only, a file in the way, /proc): the user's input, not a fault of the machine.
UNUSABLE_ROOT_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENOENT}
)


def check_root(path: str, *, option: str = "root", create: bool = False, mode: int = 0o700) -> None:
    """Check ``path`` as an NVMe root: a directory of this process's user that nobody
    else may write to; with ``create``, a missing root is made with ``mode``.
    InvalidArgumentError (naming ``option`` and the path) when it is missing (and not
    ``create``), not a directory, cannot be created (:data:`UNUSABLE_ROOT_ERRNOS`),
    another user's, or writable by others; OSError for any other failure."""
    if create:
        try:
            os.makedirs(path, mode=mode, exist_ok=True)
        except FileExistsError:  # something that is not a directory is in the way
            raise InvalidArgumentError(f"{option}: {path!r} is not a directory") from None
        except OSError as exc:
            if exc.errno not in UNUSABLE_ROOT_ERRNOS:
                raise
            raise InvalidArgumentError(
                f"{option}: {path!r} cannot be created: {exc.strerror}"
            ) from None
    try:
        check_private(option, path)
    except FileNotFoundError:
        raise InvalidArgumentError(f"{option}: {path!r} does not exist") from None


def private_opener(mode: int) -> Callable[[str, int], int]:
    """An ``opener`` for :func:`open` and ``aiofiles.open``: files it creates get
    ``mode``, and it never opens through a link."""

    def opener(path: str, flags: int) -> int:
        return os.open(path, flags | _O_NOFOLLOW, mode)

    return opener


async def fs_call(call: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
    """``call(*args, **kwargs)``, a file-system operation aiofiles does not name, awaited
    as aiofiles awaits its own: one hop to the loop's executor. Raises what ``call`` raises."""
    return await aiofiles.os.wrap(call)(*args, **kwargs)


async def to_the_end(work: Coroutine[Any, Any, _T]) -> _T:
    """Await ``work`` to its end even if the caller is cancelled meanwhile (for threads a
    cancellation cannot stop); the cancellation is raised once it ended."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation wins
        raise
