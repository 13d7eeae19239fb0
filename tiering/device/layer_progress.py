"""Per-layer readiness of a load into the device KV cache, so that a model's forward
waits for its own layer only (docs/architecture.md#layer-by-layer-loads)."""

from __future__ import annotations

import threading
from typing import Protocol

from tiering.errors import InvalidArgumentError, TransferError
from tiering.validation import as_index_list, check_index_range, positive_int


class LayerMarker(Protocol):
    """A layer's copies enqueued on a stream: ``query`` is True once they have run;
    ``wait`` makes the caller's current stream wait for them, without blocking the host."""

    def query(self) -> bool: ...
    def wait(self) -> None: ...


class LayerProgress:
    """Readiness of each of ``num_layers`` layers of one load (layer ``i`` is the
    KV cache's ``i``-th tensor; a one-tensor cache has one layer).

    Thread-safe: the copy backend marks layers from its threads or the event loop, a
    forward waits from any thread. A layer is *ready* once marked; a failure fails every
    layer not marked yet, which :meth:`wait` then raises as TransferError (recompute
    rather than read half-copied bytes). Marks and failures after the first settle a
    layer change nothing. Raises InvalidArgumentError for a ``num_layers`` below 1."""

    __slots__ = ("_cond", "_events", "_marked", "error", "num_layers")

    def __init__(self, num_layers: int) -> None:
        self.num_layers = positive_int("num_layers", num_layers)
        self._cond = threading.Condition()
        self._marked = [False] * num_layers
        self._events: list[LayerMarker | None] = [None] * num_layers  # None: landed
        self.error: TransferError | None = None
        """Why the layers not marked failed; None unless the load failed."""

    @property
    def started(self) -> bool:
        """True once a layer is marked or the load failed: a load takes a fresh one."""
        with self._cond:
            return self.error is not None or any(self._marked)

    def ready(self, layer: int) -> bool:
        """True once ``layer``'s copies have landed (its marker has fired); never blocks."""
        index = self._index(layer)
        with self._cond:
            if not self._marked[index]:
                return False
            event = self._events[index]
        return event is None or bool(event.query())

    def done(self) -> bool:
        """True once every layer is marked or the load failed (nothing more will change)."""
        with self._cond:
            return self.error is not None or all(self._marked)

    def wait(self, layer: int, timeout: float | None = None) -> None:
        """Return once ``layer`` may be read: on CPU its bytes are in place; on CUDA the
        current stream waits for its copies (:meth:`LayerMarker.wait`). Blocks the calling
        thread (never call it on the event loop's thread while a copy is pending).
        Raises TransferError if the load failed before the layer was marked, TimeoutError
        if ``timeout`` seconds pass first."""
        index = self._index(layer)
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._marked[index] or self.error is not None, timeout
            ):
                raise TimeoutError(f"layer {index} was not ready within {timeout} s")
            if not self._marked[index]:
                assert self.error is not None
                raise self.error
            event = self._events[index]
        if event is not None:
            event.wait()

    def mark(self, layer: int, event: LayerMarker | None = None) -> None:
        """The backend's call: ``layer``'s copies have landed (``event`` None) or are
        enqueued before the marker ``event`` on a copy stream."""
        index = self._index(layer)
        with self._cond:
            if self._marked[index] or self.error is not None:
                return
            self._marked[index] = True
            self._events[index] = event
            self._cond.notify_all()

    def mark_all(self) -> None:
        """Every layer has landed (a backend that copies whole blocks at once)."""
        with self._cond:
            if self.error is not None:
                return
            self._marked = [True] * self.num_layers
            self._cond.notify_all()

    def fail(self, error: BaseException | str) -> None:
        """Fail every layer not marked yet; ``error`` is the cause (a string: the reason)."""
        with self._cond:
            if self.error is not None or all(self._marked):
                return
            if isinstance(error, TransferError):
                failure = error
            else:
                failure = TransferError(f"the layer-by-layer load failed: {error}")
                if isinstance(error, BaseException):
                    failure.__cause__ = error
            self.error = failure
            self._cond.notify_all()

    def _index(self, layer: object) -> int:
        (index,) = as_index_list("layer", (layer,))
        check_index_range("layer", (index,), self.num_layers, unique=False)
        return index

    def __repr__(self) -> str:
        with self._cond:
            marked = sum(self._marked)
            state = "failed" if self.error is not None and marked < self.num_layers else "ok"
        return f"<LayerProgress {marked}/{self.num_layers} layers marked, {state}>"


def check_progress(progress: object, num_layers: int) -> LayerProgress | None:
    """``progress`` if it is None or a LayerProgress of ``num_layers`` layers on which
    nothing is marked or failed yet; else InvalidArgumentError naming it."""
    if progress is None:
        return None
    if not isinstance(progress, LayerProgress):
        raise InvalidArgumentError(f"progress must be a LayerProgress, got {progress!r}")
    if progress.num_layers != num_layers:
        raise InvalidArgumentError(
            f"progress counts {progress.num_layers} layers but the KV cache has "
            f"{num_layers} tensors"
        )
    if progress.started:
        raise InvalidArgumentError(f"progress is in use already: {progress!r}")
    return progress
