"""What one job of the Redis tier sends and how it reads the answers: its pipelines,
built one at a time (on the thread that sends them), and its end.

The same work runs on a stream (:mod:`backends.redis.stream`: several jobs' pipelines
on one link, to a server or a cluster's nodes) or one pipeline after another on a
thread of the tier's pool (redis-py's data path). Either way a job's views of the host pool are
released by :meth:`finish`, and nothing of the job outlives it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from backends.redis.control import ResponseError
from backends.redis.landing import CORRUPT, REFUSED, BlockLanding, LandingBuffers
from backends.redis.stream import Pipeline
from tiering.security.encryption import BlockCipher
from tiering.tiers.block_record import compact_header, payload_checksum, record_binding


class JobShape:
    """What every job of one tier is made with: ``slot(block_id)`` (a view of the
    host pool), the key ``prefix``, the ``record`` keywords its headers carry, the
    ``cipher`` (None: plain), blocks ``per_pipeline``, the ``SET`` options
    (``expiry``), this thread's sealing buffers (``seal_buffers()``), the buffers sealed
    loads land in (``landing_buffers``) and ``delete(names)`` for values that are no
    blocks."""

    __slots__ = (
        "cipher", "delete", "expiry", "landing_buffers", "per_pipeline", "prefix", "record",
        "seal_buffers", "slot",
    )  # fmt: skip

    def __init__(
        self,
        *,
        slot: Callable[[int], memoryview],
        prefix: bytes,
        record: dict[str, Any],
        cipher: BlockCipher | None,
        per_pipeline: int,
        expiry: tuple[Any, ...],
        seal_buffers: Callable[[], list[memoryview]],
        landing_buffers: LandingBuffers,
        delete: Callable[[list[bytes]], None],
    ) -> None:
        self.slot, self.prefix, self.record, self.cipher = slot, prefix, record, cipher
        self.per_pipeline, self.expiry = per_pipeline, expiry
        self.seal_buffers, self.landing_buffers = seal_buffers, landing_buffers
        self.delete = delete


class StoreWork:
    """A store: every block written as one string (header, then the payload straight
    from its slot, or with a cipher sealed into the thread's buffer). :meth:`finish`
    returns the keys the server refused, with why."""

    def __init__(self, shape: JobShape, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        self._shape, self._keys, self._block_ids = shape, keys, block_ids
        self._views: list[memoryview] = []
        self.failed: dict[bytes, str] = {}

    def pipelines(self) -> Iterator[Pipeline]:
        shape, keys, block_ids = self._shape, self._keys, self._block_ids
        cipher, record = shape.cipher, shape.record
        sealed = shape.seal_buffers() if cipher is not None else []
        for start in range(0, len(keys), shape.per_pipeline):
            stop = start + shape.per_pipeline
            batch = keys[start:stop]
            names: list[bytes] = []
            commands: list[tuple[Any, ...]] = []
            for i, (key, block_id) in enumerate(zip(batch, block_ids[start:stop], strict=True)):
                value = shape.slot(block_id)
                self._views.append(value)
                binding = record_binding(record["ns_digest"], record["tenant"], key)
                if cipher is None:
                    seal, checksum = None, payload_checksum(value, binding)
                else:
                    # The buffer is free again once this pipeline is sent: the next
                    # one is built after that.
                    seal, checksum = cipher.seal_into(value, sealed[i], binding), None
                    value = sealed[i][: value.nbytes]
                header = compact_header(key=key, checksum=checksum, seal=seal, **record)
                names.append(shape.prefix + key)
                commands.append(("SET", names[-1], (header, value), *shape.expiry))
            # Each SET stands alone (a key given twice in a job keeps either of its
            # values, each a whole, verifiable record): the link may spread them.
            yield Pipeline(names, commands, None, None, self._answered(batch), independent=True)

    def _answered(self, batch: Sequence[bytes]) -> Callable[[list[Any]], None]:
        def answer(replies: list[Any]) -> None:
            for key, reply in zip(batch, replies, strict=True):
                if isinstance(reply, ResponseError):
                    self.failed[key] = f"{REFUSED} the store: {reply}"

        return answer

    def finish(self) -> dict[bytes, str]:
        # The client's own frames, kept in reference cycles after an error, may still
        # name these views: released, they no longer pin the host pool.
        for view in self._views:
            view.release()
        self._views.clear()
        return self.failed


class LoadWork:
    """A load: every block read straight into its slot (:class:`BlockLanding`; a sealed
    one into a landing buffer, opened into the slot) and verified. :meth:`finish`
    deletes the corrupt values (and values of another type) from the server and returns
    why each failed key failed."""

    def __init__(self, shape: JobShape, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        self._shape, self._keys, self._block_ids = shape, keys, block_ids
        self._landings: list[BlockLanding] = []
        self._corrupt: list[bytes] = []
        self.failed: dict[bytes, str] = {}

    def pipelines(self) -> Iterator[Pipeline]:
        shape, keys, block_ids = self._shape, self._keys, self._block_ids
        for start in range(0, len(keys), shape.per_pipeline):
            stop = start + shape.per_pipeline
            batch = [
                BlockLanding(
                    key, shape.slot(block_id), shape.record, shape.cipher, shape.landing_buffers
                )
                for key, block_id in zip(keys[start:stop], block_ids[start:stop], strict=True)
            ]
            self._landings += batch
            names = [shape.prefix + landing.key for landing in batch]
            commands = [("GET", name) for name in names]
            sinks, expected = [x.sink for x in batch], [x.expected for x in batch]
            yield Pipeline(names, commands, sinks, expected, self._answered(batch))

    def _answered(self, batch: list[BlockLanding]) -> Callable[[list[Any]], None]:
        def answer(values: list[Any]) -> None:
            for landing, value in zip(batch, values, strict=True):
                why = landing.verify(value)
                if why:
                    self.failed[landing.key] = why
                    if why.startswith(CORRUPT):
                        self._corrupt.append(self._shape.prefix + landing.key)

        return answer

    def finish(self) -> dict[bytes, str]:
        for landing in self._landings:
            landing.release()
        self._landings.clear()
        corrupt, self._corrupt = self._corrupt, []
        if corrupt:
            self._shape.delete(corrupt)
        return self.failed


__all__ = ["JobShape", "LoadWork", "StoreWork"]
