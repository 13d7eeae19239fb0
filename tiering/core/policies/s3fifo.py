"""S3-FIFO eviction (Yang et al., SOSP'23, "FIFO queues are all you need for cache eviction")."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from tiering.core.policies.base import EvictionPolicy
from tiering.core.scheduler_api import BlockHash
from tiering.errors import BlockNotFoundError, InvalidArgumentError
from tiering.validation import real

_MAX_FREQ = 3  # the paper's 2-bit saturating counter
_PROMOTE_ABOVE = 1  # Algorithm 1, EVICTS: "if t.freq > 1 then insert t to M"
_ABSENT = object()


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Algorithm 1 of the paper): a small FIFO ``S`` filters one-hit keys before
    they reach the main FIFO ``M``; keys evicted from ``S`` unpromoted go to the ghost
    queue ``G``, and a ghost that returns joins ``M``. Counters saturate at 3.

    Deviations: a promotion from ``S`` clears the counter (as the authors' code does)
    and never evicts from ``M`` in the same step (the manager owns the resident total;
    later steps drain an over-full ``M``). Keys failing ``can_evict`` (assumed stable
    during a call) go to their queue's tail unchanged; ``S`` is given up once all its
    keys were stepped over, ``M`` after ``|M|`` in a row, so ``evict`` takes at most
    O(n + |S| + 4|M|) steps. ``G`` holds at most ``c - floor(small_ratio * c)`` keys (at
    least 1), oldest dropped first; no key is both resident and in ``G``."""

    name = "s3fifo"

    def __init__(self, small_ratio: float = 0.1) -> None:
        """``S`` targets ``small_ratio`` (in ``(0, 1)``, else InvalidArgumentError) of the tier."""
        super().__init__()
        self.small_ratio = real(
            "small_ratio", small_ratio, "a number in (0, 1)", lambda r: 0.0 < r < 1.0
        )
        self._small_target = 0.0
        self._ghost_capacity = 1
        # Queues are ordered oldest first: the head is examined next.
        self._small: OrderedDict[BlockHash, None] = OrderedDict()
        self._main: OrderedDict[BlockHash, None] = OrderedDict()
        self._ghost: OrderedDict[BlockHash, None] = OrderedDict()
        self._freq: dict[BlockHash, int] = {}

    def bind(self, capacity: int) -> None:
        super().bind(capacity)
        self._small_target = self.small_ratio * capacity
        self._ghost_capacity = max(1, capacity - int(self._small_target))

    def insert(self, key: BlockHash) -> None:
        """Admit ``key`` (to ``M`` if it is in ``G``, else to ``S``) with counter 0.
        Raises InvalidArgumentError if it is already resident."""
        freq = self._freq
        if key in freq:
            raise InvalidArgumentError(f"key {key!r} is already resident in the S3-FIFO policy")
        freq[key] = 0
        if self._ghost.pop(key, _ABSENT) is not _ABSENT:
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, keys: Sequence[BlockHash]) -> None:
        freq = self._freq
        get = freq.get
        for key in keys:
            count = get(key)
            if count is not None and count < _MAX_FREQ:
                freq[key] = count + 1

    def remove(self, key: BlockHash) -> None:
        """Forget resident ``key`` without a ghost entry (BlockNotFoundError if absent)."""
        if self._freq.pop(key, _ABSENT) is _ABSENT:
            raise BlockNotFoundError(f"key {key!r} is not resident in the S3-FIFO policy")
        if self._small.pop(key, _ABSENT) is _ABSENT:
            del self._main[key]

    def evict(self, n: int, can_evict: Callable[[BlockHash], bool]) -> list[BlockHash]:
        victims: list[BlockHash] = []
        if n <= 0:
            return victims
        small, main, ghost, freq = self._small, self._main, self._ghost, self._freq
        small_target = self._small_target
        # Keys stepped over in S only ever join its tail, so they form its suffix:
        # once they are all of S, S has nothing evictable left for this call.
        small_skipped = 0
        # Consecutive keys of M stepped over with M otherwise unchanged; |M| of them
        # in a row have visited every key of M.
        main_idle = 0
        wanted = n
        while wanted:
            if small_skipped < len(small) and (
                len(small) >= small_target or main_idle >= len(main)
            ):
                # S keeps precedence until it falls below its share while M is open.
                while small_skipped < len(small):
                    key = next(iter(small))
                    if not can_evict(key):
                        small.move_to_end(key)
                        small_skipped += 1
                        continue
                    del small[key]
                    if freq.pop(key) > _PROMOTE_ABOVE:
                        main[key] = None
                        freq[key] = 0
                        main_idle = 0
                        continue
                    ghost[key] = None
                    victims.append(key)
                    wanted -= 1
                    if not wanted or (len(small) < small_target and main_idle < len(main)):
                        break
            elif main_idle < len(main):
                # Nothing here changes S, so M keeps precedence until done or closed.
                while main_idle < len(main):
                    key = next(iter(main))
                    if not can_evict(key):
                        main.move_to_end(key)
                        main_idle += 1
                        continue
                    main_idle = 0
                    count = freq[key]
                    if count:
                        freq[key] = count - 1
                        main.move_to_end(key)
                        continue
                    del main[key]
                    del freq[key]
                    victims.append(key)
                    wanted -= 1
                    if not wanted:
                        break
            else:
                break
        excess = len(ghost) - self._ghost_capacity
        while excess > 0:
            ghost.popitem(last=False)
            excess -= 1
        return victims

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq
