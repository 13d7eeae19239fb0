"""Which blocks a lower tier takes: its admission rule (sans-I/O). A rule sees every
request (:meth:`Admission.observe`) and picks, of the blocks offered to its tier, those
the tier writes (:meth:`Admission.admit`); a block it refuses is simply not written.

* ``all``: every block (what every tier did before admission existed).
* ``seen-twice``: a block only if two requests named it, counted in two generations of
  request counts (a new one every ``window`` x capacity observed keys; a count carried
  over is halved), as NVIDIA Dynamo's frequency filter admits to disk.
* ``adaptive``: ``all`` until the tier would be full or the tier above has turned over
  twice (its blocks' worth of distinct blocks seen twice over), then ``seen-twice``
  while refusing costs at most ``tolerance`` of the hits. Two SHARDS-style shadows of
  the tier (1 key in ``capacity // shadow_blocks``, by CRC-32), one under each of the two
  rules, replay the sampled keys a request finds below the tier above and score their
  decayed prefix hits; the tier above's sampled prefix hits, decayed alike, are the rest
  of the hits. A refusal costs hits only later (a block's next request misses after it
  left the tier above), so no evidence is taken before that could happen.

A tier's :class:`WriteGate` applies its rule and its write budget
(:mod:`tiering.core.write_budget`), keeps the blocks over the budget in a backlog, and
counts; :func:`make_gates` builds one per secondary tier, for the engine's job core and
the bookkeeping replay alike.
"""

from __future__ import annotations

import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tiering.core.policies.adaptive import Shadow
from tiering.core.scheduler_api import BlockHash
from tiering.core.write_budget import WriteBudget
from tiering.errors import InvalidArgumentError
from tiering.validation import positive_int, real

ADMISSIONS = ("all", "seen-twice", "adaptive")
"""The admission rules by name."""


class Admission:
    """The ``all`` rule, and the base of the others: every offered block is admitted.
    ``capacity_blocks`` is the tier's (None: unbounded)."""

    def __init__(self, capacity_blocks: int | None = None) -> None:
        if capacity_blocks is not None:
            positive_int("capacity_blocks", capacity_blocks)
        self.capacity_blocks = capacity_blocks

    def observe(self, hashes: Sequence[BlockHash], above: Callable[[BlockHash], bool]) -> None:
        """One request's blocks, in order; ``above(h)`` is True where the tier above
        holds ``h`` (the request does not look for it in this tier)."""

    def admit(self, keys: Sequence[BlockHash]) -> list[BlockHash]:
        """Of the blocks offered to the tier, those it writes, in order."""
        return list(keys)


class SeenTwice(Admission):
    """The ``seen-twice`` rule (see the module docstring); ``window`` is a positive int."""

    def __init__(self, capacity_blocks: int | None = None, window: int = 8) -> None:
        super().__init__(capacity_blocks)
        self.window = positive_int("window", window)
        self.counts: dict[BlockHash, int] = {}  # requests naming a key, this generation
        self._before: dict[BlockHash, int] = {}
        self._observed = 0

    def observe(self, hashes: Sequence[BlockHash], above: Callable[[BlockHash], bool]) -> None:
        counts, get, before = self.counts, self.counts.get, self._before.get
        unique = dict.fromkeys(hashes)
        for key in unique:
            count = get(key)
            counts[key] = count + 1 if count is not None else (before(key, 0) >> 1) + 1
        self._observed += len(unique)
        if self._observed >= self.window * (self.capacity_blocks or 1 << 20):
            self._observed, self._before, self.counts = 0, counts, {}

    def admit(self, keys: Sequence[BlockHash]) -> list[BlockHash]:
        get = self.counts.get
        return [key for key in keys if get(key, 0) >= 2]


class AdaptiveAdmission(SeenTwice):
    """The ``adaptive`` rule (see the module docstring). Raises InvalidArgumentError for
    a window, shadow size or horizon that is not a positive int, or a tolerance that is
    not a number in [0, 1). On an unbounded tier it admits everything."""

    def __init__(
        self,
        capacity_blocks: int | None = None,
        above_blocks: int | None = None,
        window: int = 8,
        shadow_blocks: int = 4096,
        horizon: int = 64,
        tolerance: float = 0.01,
    ) -> None:
        super().__init__(capacity_blocks, window)
        if above_blocks is not None:
            positive_int("above_blocks", above_blocks)
        # Distinct blocks still to see (as counted: one forgotten for two generations
        # counts again) until the tier above has turned over twice; None: never, or done.
        self._until_turned = 2 * above_blocks if above_blocks is not None else None
        self._turned = False
        positive_int("shadow_blocks", shadow_blocks)
        positive_int("horizon", horizon)
        self.tolerance = real("tolerance", tolerance, "a number in [0, 1)", lambda t: 0 <= t < 1)
        capacity = capacity_blocks or 1
        self._sample = max(1, capacity // shadow_blocks)
        size = max(1, capacity // self._sample)
        self._all, self._seen = (
            Shadow("lru", size, horizon),
            Shadow("lru+second-sight", size, horizon),
        )
        self._above_score = 0.0
        self._decay = self._all.decay
        self.refusing = False  # which rule leads: seen-twice (True) or all

    def observe(self, hashes: Sequence[BlockHash], above: Callable[[BlockHash], bool]) -> None:
        if self._until_turned is not None:  # before the counts take this request in
            get, before = self.counts.get, self._before.get
            fresh = sum(1 for k in dict.fromkeys(hashes) if get(k) is None and before(k) is None)
            self._until_turned -= fresh
            if self._until_turned <= 0:
                self._until_turned, self._turned = None, True
        super().observe(hashes, above)
        if self.capacity_blocks is None:
            return
        sample = self._sample
        sampled = hashes if sample == 1 else [h for h in hashes if zlib.crc32(h) % sample == 0]
        if not sampled:
            return
        lead = 0
        for key in sampled:  # the tier above's prefix hits
            if not above(key):
                break
            lead += 1
        self._above_score = self._above_score * self._decay ** len(sampled) + lead
        below = [h for h in sampled if not above(h)]
        if below:
            unique = list(dict.fromkeys(below))
            self._all.request(below, unique, self.counts)
            self._seen.request(below, unique, self.counts)
        everything, seen = self._all, self._seen
        cost = everything.score - seen.score  # the hits refusing loses
        settled = self._turned or len(everything.held) >= everything.capacity
        self.refusing = settled and cost <= self.tolerance * (self._above_score + everything.score)

    def admit(self, keys: Sequence[BlockHash]) -> list[BlockHash]:
        return super().admit(keys) if self.refusing else list(keys)


def make_admission(
    rule: object, capacity_blocks: int | None, above_blocks: int | None = None
) -> Admission:
    """The admission rule named ``rule`` (one of :data:`ADMISSIONS`) for a tier of
    ``capacity_blocks`` below a tier of ``above_blocks`` (None: unknown, so ``adaptive``
    waits for its own tier to fill); InvalidArgumentError naming ``admission`` otherwise."""
    if rule == "adaptive":
        return AdaptiveAdmission(capacity_blocks, above_blocks)
    if rule == "seen-twice":
        return SeenTwice(capacity_blocks)
    if rule == "all":
        return Admission(capacity_blocks)
    raise InvalidArgumentError(f"admission must be one of {', '.join(ADMISSIONS)}, got {rule!r}")


class WriteGate:
    """What one lower tier writes: of the blocks offered, those its ``rule`` admits, as
    many as its ``budget`` (None: unbounded) lets, blocks seen twice first. Blocks over
    the budget wait in a backlog of at most ``backlog_blocks`` (oldest dropped first) and
    are written at a later offer with budget to spare, if still ``writable`` then (in
    the CPU tier, not yet in the tier): seen-twice blocks before the others, the offer's
    before the backlog's (a request's newest blocks are the likeliest to come back), the
    backlog's oldest first. An offer without ``writable`` (write-back's victims,
    leaving the CPU tier) keeps no backlog. Counts each block offered: admitted (now, or
    later from the backlog: ``late_blocks``), refused by the rule, or over the budget."""

    def __init__(
        self, rule: Admission, budget: WriteBudget | None = None, backlog_blocks: int = 0
    ) -> None:
        self.rule = rule
        self.budget = budget
        self.backlog_blocks = backlog_blocks
        # Only a rule with an observe of its own needs to see the requests.
        self.observes = type(rule).observe is not Admission.observe
        self._counts = rule.counts if isinstance(rule, SeenTwice) else None
        # Over budget, oldest first: the blocks seen twice, and the others.
        self._twice: OrderedDict[BlockHash, None] = OrderedDict()
        self._once: OrderedDict[BlockHash, None] = OrderedDict()
        self.admitted_blocks = self.refused_blocks = self.over_budget_blocks = 0
        self.late_blocks = 0

    @property
    def backlog(self) -> int:
        """Blocks waiting for budget."""
        return len(self._twice) + len(self._once)

    def observe(self, hashes: Sequence[BlockHash], above: Callable[[BlockHash], bool]) -> None:
        """One request's blocks (:meth:`Admission.observe`); a waiting block it names a
        second time moves up the backlog."""
        self.rule.observe(hashes, above)
        once = self._once
        if once and self._counts is not None:
            get = self._counts.get
            for key in hashes:
                if key in once and get(key, 0) >= 2:
                    del once[key]
                    self._twice[key] = None

    def admit(
        self, keys: Sequence[BlockHash], writable: Callable[[BlockHash], bool] | None = None
    ) -> list[BlockHash]:
        """Of ``keys`` (offered now: ready in the CPU tier, lacking in the tier), and of
        the backlog given ``writable``, the blocks the tier writes now."""
        chosen = self.rule.admit(keys)
        self.refused_blocks += len(keys) - len(chosen)
        budget = self.budget
        if budget is None:
            self.admitted_blocks += len(chosen)
            return chosen
        twice, once = self._twice, self._once
        for key in chosen:  # offered again: the offer decides
            twice.pop(key, None)
            once.pop(key, None)
        get = self._counts.get if self._counts is not None else None
        if get is None:  # no counts: one class
            fresh_twice, fresh_once = [], chosen
        else:
            fresh_twice = [k for k in chosen if get(k, 0) >= 2]
            fresh_once = [k for k in chosen if get(k, 0) < 2]
        room = budget.available()
        written: list[BlockHash] = []
        over: list[BlockHash] = []
        for queue, fresh in ((twice, fresh_twice), (once, fresh_once)):
            fit = max(0, room - len(written))
            written += fresh[:fit]
            over += fresh[fit:]
            if writable is not None:
                while len(written) < room and queue:
                    key = queue.popitem(last=False)[0]
                    if writable(key):
                        written.append(key)
                        self.late_blocks += 1
        self.over_budget_blocks += len(over)
        if over and writable is not None and self.backlog_blocks:
            for key in over:
                (self._twice if get is not None and get(key, 0) >= 2 else self._once)[key] = None
            while self.backlog > self.backlog_blocks:  # the oldest first-sight ones go first
                (self._once or self._twice).popitem(last=False)
        budget.spend(len(written))
        self.admitted_blocks += len(written)
        return written

    def flushed(self, blocks: int) -> None:
        """``blocks`` were written past the rule and budget (a flush of every ready block
        the tier lacked, the backlog's among them): the budget pays, the backlog empties."""
        if self.budget is not None:
            self.budget.spend(blocks)
        self._twice.clear()
        self._once.clear()

    def counters(self) -> dict[str, int]:
        """``admitted_blocks`` (``late_blocks`` of them from the backlog),
        ``refused_blocks`` (by the rule), ``over_budget_blocks`` (when offered) and
        ``backlog_blocks`` (waiting now)."""
        return {
            "admitted_blocks": self.admitted_blocks,
            "refused_blocks": self.refused_blocks,
            "over_budget_blocks": self.over_budget_blocks,
            "late_blocks": self.late_blocks,
            "backlog_blocks": self.backlog,
        }


def make_gates(
    rules: Sequence[object],
    capacities: Sequence[int | None],
    cpu_blocks: int,
    budgets: Sequence[float | None] = (),
    *,
    block_bytes: int = 1,
    clock: Callable[[], float] = time.monotonic,
) -> list[WriteGate]:
    """One :class:`WriteGate` per secondary tier, fastest first: tier ``t`` of
    ``capacities[t]`` blocks (None: unbounded) admits by ``rules[t]``, below a tier of
    ``cpu_blocks`` (the CPU tier's, for the first) or of the faster tier's capacity, within
    ``budgets[t]`` bytes a second (None or left out: unbounded) of ``block_bytes`` blocks
    on ``clock``, with a backlog of up to ``cpu_blocks``.
    Raises InvalidArgumentError as :func:`make_admission` and :class:`WriteBudget`, or
    for lists of other lengths."""
    budgets = list(budgets) or [None] * len(rules)
    if not len(rules) == len(capacities) == len(budgets):
        raise InvalidArgumentError(
            f"{len(rules)} admission rules, {len(capacities)} capacities and {len(budgets)} "
            "budgets: one each per tier"
        )
    above = [cpu_blocks, *capacities][: len(capacities)]
    gates = []  # a backlog holds CPU blocks: at most the CPU tier's
    for rule, capacity, over, budget in zip(rules, capacities, above, budgets, strict=True):
        bucket = None
        if budget is not None:
            bucket = WriteBudget(budget, block_bytes, clock)
        gates.append(WriteGate(make_admission(rule, capacity, over), bucket, cpu_blocks))
    return gates
