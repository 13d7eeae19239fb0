"""The NVMe tier in the bookkeeping replay (:class:`tiering.lab.replay.CacheModel`): the
tier's own :class:`~backends.nvme.segment_index.SegmentIndex`, driven as the tier drives
it, without bytes. The replay finds it by the tier's name
(:func:`tiering.tiers.registry.replay_model`)."""

from __future__ import annotations

from collections.abc import Sequence

from backends.nvme.segment_index import SegmentIndex, key_digest


class SegmentLog:
    """The keys an NVMe tier of ``capacity_records`` records, ``records_per_segment`` to a
    segment, holds: touches and loads mark keys used; a store job makes room with the
    index's own ``plan_room``, moving at most ``moves_per_job`` records, and an evicted
    segment writes ``hot_fraction`` of its recent uses again."""

    __slots__ = ("_index", "_moves_per_job")

    def __init__(
        self,
        capacity_records: int,
        records_per_segment: int,
        hot_fraction: float,
        moves_per_job: int,
    ) -> None:
        self._index = SegmentIndex(
            capacity_records,
            records_per_segment=records_per_segment,
            writer="0",
            hot_fraction=hot_fraction,
        )
        self._moves_per_job = moves_per_job

    def __contains__(self, key: bytes) -> bool:
        return key_digest(key) in self._index

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark the keys the tier holds used."""
        self._index.touch(list(map(key_digest, hashes)))

    loaded = touch  # a load marks its keys used

    def add(self, hashes: Sequence[bytes]) -> None:
        """One store job of keys the tier lacks."""
        index = self._index
        wanted = list(dict.fromkeys(map(key_digest, hashes)))
        plan = index.plan_room(len(wanted), most_moves=self._moves_per_job)
        for digest, placement in zip(wanted[: plan.fit], plan.placed[: plan.fit], strict=True):
            index.commit(digest, placement)
        for (_, _, digest), placement in zip(plan.moves, plan.placed[plan.fit :], strict=True):
            if digest in index:  # stored again meanwhile: the newer record wins
                index.abandon(placement)
            else:
                index.commit(digest, placement)
