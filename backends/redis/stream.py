"""Several jobs' pipelines on one link at once: the Redis tier's data path on its own
connections.

A job's bytes move in pipelines (:class:`Pipeline`), built one at a time as they are
sent. A stream is one thread and one link (:class:`Link`: a connection to one server,
or one per node of a cluster): it sends the next pipelines (of this job, then of the
next ones queued) while the server still answers earlier ones, up to ``window``
pipelines on the wire, and reads their replies in the order sent. So the server works
on one job while the thread lands and verifies the last one's blocks, and a job costs
no hand-off to a pool thread. At most ``window`` pipelines (each at most the tier's
``pipeline_bytes`` of payload) are on the wire per stream.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple, Protocol

from backends.redis.connection import Command, Expected
from backends.redis.control import CLIENT_ERRORS, RedisConnectionError, detached
from backends.redis.resp import Sink
from tiering.tiers.io_threads import init_io_worker


class Pipeline(NamedTuple):
    """One pipelined round trip of a job: its ``commands`` (on the keys ``names``, one
    per command), where their replies land (``sinks``, ``expected``: as
    :meth:`RespConnection.round_trip` takes them), and ``answer``, called with the
    replies in order. ``independent``: the commands may run in any order, each on a
    connection of its own (a link may spread them); else in order, on one."""

    names: Sequence[bytes]
    commands: Sequence[Command]
    sinks: Sequence[Sink | None] | None
    expected: Sequence[Expected] | None
    answer: Callable[[list[Any]], None]
    independent: bool = False


class Link(Protocol):
    """A stream's connection(s): sends a pipeline, then reads its replies (in the order
    sent); raises the client's error, after which it is of no further use."""

    def send(self, pipeline: Pipeline) -> Any:
        """Send ``pipeline``; returns what :meth:`receive` needs to read its replies."""
        ...

    def receive(self, pipeline: Pipeline, sent: Any) -> list[Any]:
        """The replies of ``pipeline``, in its commands' order."""
        ...

    def stale(self) -> bool:
        """Whether the idle link is of no further use (the server closed it)."""
        ...

    def close(self) -> None: ...


class StreamWork(Protocol):
    """A job's work on a stream: its pipelines, built as they are sent, then its end."""

    def pipelines(self) -> Iterator[Pipeline]:
        """The job's pipelines; each is built when the stream is about to send it."""
        ...

    def finish(self) -> Any:
        """Called once, on the stream's thread, after every pipeline sent was answered
        or the job failed: releases what the job holds; returns the job's outcome."""
        ...


class _Entry:
    __slots__ = ("call", "deliver", "on_wire", "pipelines", "sent_all", "work")

    def __init__(self, work: StreamWork, deliver: Callable[[Any], None]) -> None:
        self.work, self.deliver = work, deliver
        self.call: Future[None] = Future()
        self.pipelines: Iterator[Pipeline] | None = None  # None: not begun, or ended
        self.on_wire = 0
        self.sent_all = False


class RespStream:
    """One link (made by ``open_link()`` when first needed, and again after a failure)
    and the thread (named ``name``) that carries the jobs given to :meth:`submit`, in
    order, up to ``window`` pipelines on the wire.

    A link's failure fails every job with a pipeline sent on it (the jobs not begun go
    on, on a new link); a job's end is delivered once its work finished."""

    def __init__(self, open_link: Callable[[], Link], *, window: int, name: str) -> None:
        self._open_link, self._window, self._name = open_link, max(1, window), name
        self._queue: deque[_Entry] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        # Jobs given and jobs ended: each counter written by one thread only (the
        # giver's, the stream's), so their difference needs no lock.
        self._given = 0
        self._ended = 0

    def submit(self, work: StreamWork, deliver: Callable[[Any], None]) -> Future[None]:
        """Queue ``work``; ``deliver(outcome)`` follows on the stream's thread (the
        value ``work.finish()`` returned, or the client's error, detached). The future
        returned ends when the stream is done with the job; cancelling it before the
        job began withdraws the job (nothing is delivered). RuntimeError once closed."""
        entry = _Entry(work, deliver)
        with self._wake:
            if self._closed:
                raise RuntimeError("the stream is closed")
            self._queue.append(entry)
            self._given += 1
            self._wake.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
        return entry.call

    def load(self) -> int:
        """Jobs given and not yet ended, begun or not (read without the lock: for
        choosing the least busy stream, not for deciding anything that must be exact)."""
        return self._given - self._ended

    def close(self) -> None:
        """Stop once the jobs begun are done; the jobs still queued fail as closed."""
        with self._wake:
            self._closed = True
            self._wake.notify()

    def _serve(self) -> None:
        init_io_worker()
        link: Link | None = None
        active: deque[_Entry] = deque()  # begun, with pipelines left to send
        on_wire: deque[tuple[_Entry, Pipeline, Any]] = deque()  # sent, replies unread
        reading: _Entry | None = None  # whose replies are being read
        while True:
            with self._wake:
                while not (self._queue or active or on_wire or self._closed):
                    self._wake.wait()
                if self._closed and not (active or on_wire):
                    break
                while self._queue and not self._closed:
                    entry = self._queue.popleft()
                    if entry.call.set_running_or_notify_cancel():
                        active.append(entry)
                    else:  # withdrawn
                        self._ended += 1
            try:
                while active and len(on_wire) < self._window:
                    entry = active[0]
                    if entry.pipelines is None:
                        entry.pipelines = entry.work.pipelines()
                    pipeline = next(entry.pipelines, None)
                    if pipeline is None:
                        active.popleft()
                        entry.sent_all = True
                        if not entry.on_wire:
                            self._end(entry)
                        continue
                    if link is None or (not on_wire and link.stale()):
                        if link is not None:
                            link.close()
                        link = self._open_link()
                    on_wire.append((entry, pipeline, link.send(pipeline)))
                    entry.on_wire += 1
                if on_wire:
                    assert link is not None
                    reading, pipeline, sent = on_wire.popleft()
                    reading.on_wire -= 1
                    pipeline.answer(link.receive(pipeline, sent))
                    entry, reading = reading, None
                    if entry.sent_all and not entry.on_wire:
                        self._end(entry)
            except BaseException as exc:  # every job on this link fails with it
                if link is not None:
                    link.close()
                    link = None
                error = detached(exc) if isinstance(exc, CLIENT_ERRORS) else exc
                failed = {entry for entry, _, _ in on_wire}
                failed.update(entry for entry in active if entry.pipelines is not None)
                if reading is not None:
                    failed.add(reading)
                    reading = None
                on_wire.clear()
                for entry in failed:
                    if entry in active:
                        active.remove(entry)
                    self._end(entry, error)
        if link is not None:
            link.close()
        with self._wake:
            left, self._queue = list(self._queue), deque()
        for entry in left:
            if entry.call.set_running_or_notify_cancel():
                self._end(entry, RedisConnectionError("the redis tier is closed"))

    def _end(self, entry: _Entry, error: BaseException | None = None) -> None:
        """Finish ``entry``'s work (releasing what it holds) and deliver its outcome."""
        try:
            outcome = entry.work.finish()
        except BaseException as exc:
            outcome = exc
        entry.pipelines = None  # its generator, and the views it holds, go now
        self._ended += 1
        entry.deliver(outcome if error is None else error)
        entry.call.set_result(None)


__all__ = ["Link", "Pipeline", "RespStream", "StreamWork"]
