"""Seeded workload families for judging eviction policies (:data:`FAMILIES`), each
stressing a different reuse shape. Block ids are prefix-chained as in the Mooncake traces,
and each prompt ends with a partial block, so ``--full-blocks-only`` changes what is
reused. The same name and seed give the same requests."""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from tiering.config import WORKLOADS
from tiering.core.policies import policy_name, policy_names
from tiering.errors import InvalidArgumentError
from tiering.lab.workloads import TOKENS_PER_BLOCK, Request, read_mooncake, synthetic_requests


class _Builder:
    """A family's random source, prefix-chained block ids and requests (by arrival, done)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.requests: list[Request] = []
        self._ids: dict[tuple[int | None, Hashable], int] = {}
        self._unique = itertools.count()

    def chain(self, labels: Iterable[Hashable], parent: int | None = None) -> list[int]:
        """The ids of blocks ``labels`` following the block ``parent`` (None: the start)."""
        ids = []
        for label in labels:
            parent = self._ids.setdefault((parent, label), len(self._ids))
            ids.append(parent)
        return ids

    def unique(self, count: int) -> list[tuple[str, int]]:
        """Labels of ``count`` blocks no other prompt holds."""
        return [("u", next(self._unique)) for _ in range(count)]

    def extend(self, ids: list[int], count: int) -> list[int]:
        """``ids`` followed by ``count`` blocks of their own (a fresh chain if empty)."""
        return ids + self.chain(self.unique(count), ids[-1] if ids else None)

    def ask(self, arrival_s: float, ids: list[int], session: int) -> None:
        """A request for the full blocks ``ids`` and a partial block of its own; its answer
        is one block and a part."""
        tokens = len(ids) * TOKENS_PER_BLOCK + self.rng.randrange(1, TOKENS_PER_BLOCK)
        output = TOKENS_PER_BLOCK + self.rng.randrange(0, TOKENS_PER_BLOCK)
        blocks = tuple(self.extend(ids, 1))
        self.requests.append(Request(arrival_s, blocks, tokens, output, session))

    def zipf(self, n: int, s: float = 1.0) -> list[float]:
        """Zipf-like weights of ``n`` ranks."""
        return [1.0 / (rank + 1) ** s for rank in range(n)]

    def done(self) -> list[Request]:
        self.requests.sort(key=lambda r: r.arrival_s)
        return self.requests


def chat(seed: int = 0) -> list[Request]:
    """Chats of 1-20 turns on 30 system prompts; 60 % of turn gaps average 15 s, the rest 10 min."""
    b = _Builder(seed)
    rng = b.rng
    prompts = [b.extend([], rng.randint(2, 8)) for _ in range(30)]
    popularity = b.zipf(len(prompts))
    start = 0.0
    for session in range(1500):
        start += rng.expovariate(2.0)
        history = list(rng.choices(prompts, popularity)[0])
        arrival = start
        for _turn in range(min(20, 1 + int(rng.expovariate(1 / 4)))):
            ids = b.extend(history, rng.randint(1, 3))
            b.ask(arrival, ids, session)
            history = b.extend(ids, rng.randint(1, 2))
            arrival += rng.expovariate(1 / 15 if rng.random() < 0.6 else 1 / 600)
    return b.done()


def agent(seed: int = 0) -> list[Request]:
    """120 agents on 6 shared tool prompts; each runs 5-40 steps a few seconds apart,
    every step adding an observation and an action to its context."""
    b = _Builder(seed)
    rng = b.rng
    tools = [b.extend([], rng.randint(8, 16)) for _ in range(6)]
    popularity = b.zipf(len(tools))
    start = 0.0
    for session in range(120):
        start += rng.expovariate(0.2)
        base = rng.choices(tools, popularity)[0]
        context = b.extend(base, rng.randint(1, 3))
        arrival = start
        for _step in range(rng.randint(5, 40)):
            b.ask(arrival, context, session)
            context = b.extend(context, rng.randint(1, 4) + 1)  # an observation, an action
            arrival += rng.expovariate(1 / 3)
    return b.done()


def rag(seed: int = 0) -> list[Request]:
    """6,000 queries, each one system prompt, 3-5 of 3,000 documents (Zipf-popular, in
    random order) and the question."""
    b = _Builder(seed)
    rng = b.rng
    system = b.extend([], 3)
    documents = [b.unique(rng.randint(2, 6)) for _ in range(3000)]
    popularity = list(itertools.accumulate(b.zipf(len(documents), 0.9)))
    arrival = 0.0
    for query in range(6000):
        arrival += rng.expovariate(8.0)
        chosen: dict[int, None] = {}
        wanted = rng.randint(3, 5)
        while len(chosen) < wanted:
            chosen[rng.choices(range(len(documents)), cum_weights=popularity)[0]] = None
        labels = [label for d in chosen for label in documents[d]]
        b.ask(arrival, system + b.chain(labels, system[-1]), query)
    return b.done()


def scan(seed: int = 0) -> list[Request]:
    """6,000 requests: 85 % on 40 popular prefixes (Zipf) with a short question, 15 %
    long prompts (30-80 blocks) that no other request shares."""
    b = _Builder(seed)
    rng = b.rng
    system = b.extend([], 2)
    hot = [b.extend(system, rng.randint(4, 14)) for _ in range(40)]
    popularity = b.zipf(len(hot))
    arrival = 0.0
    for number in range(6000):
        arrival += rng.expovariate(8.0)
        if rng.random() < 0.85:
            b.ask(arrival, b.extend(rng.choices(hot, popularity)[0], rng.randint(1, 3)), number)
        else:
            b.ask(arrival, b.extend(system, rng.randint(30, 80)), number)
    return b.done()


def shift(seed: int = 0) -> list[Request]:
    """7,200 requests on 600 prefixes of 4-12 blocks whose Zipf popularity is reshuffled
    every 1,200 requests, each with a question of its own."""
    b = _Builder(seed)
    rng = b.rng
    prefixes = [b.extend([], rng.randint(4, 12)) for _ in range(600)]
    weights = b.zipf(len(prefixes), 1.1)
    arrival = 0.0
    for phase in range(6):
        order = list(range(len(prefixes)))
        rng.shuffle(order)
        for number in range(1200):
            arrival += rng.expovariate(8.0)
            prefix = prefixes[rng.choices(order, weights)[0]]
            b.ask(arrival, b.extend(prefix, rng.randint(1, 2)), phase * 1200 + number)
    return b.done()


FAMILIES: dict[str, Callable[[int], list[Request]]] = {
    family.__name__: family for family in (chat, agent, rag, scan, shift)
}
"""The generated families by name."""

_T = TypeVar("_T")

REFERENCES = ("lru", "arc")
"""The policies a suite measures every other against (the better of them, per point)."""

FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.25, 0.5)
"""The suite's capacities, as fractions of each workload's footprint."""


def generate(name: str, seed: int = 0) -> list[Request]:
    """The requests of the named workload (:data:`WORKLOADS`; ``synthetic``:
    :func:`~tiering.lab.workloads.synthetic_requests`' default) with ``seed``, by arrival.
    Raises InvalidArgumentError for an unknown name."""
    if name == "synthetic":
        return synthetic_requests(seed=seed)
    if name not in FAMILIES:
        raise InvalidArgumentError(f"workload must be one of {', '.join(WORKLOADS)}, got {name!r}")
    return FAMILIES[name](seed)


@dataclass(frozen=True, slots=True)
class SuitePoint:
    """One workload, mode and capacity of a suite, with every policy's hit ratio."""

    workload: str
    full_blocks_only: bool
    capacity_fraction: float
    capacity_blocks: int
    hit_ratios: dict[str, float]

    def ratio(self, policy: str) -> float:
        """``policy``'s hit ratio over the better of LRU's and ARC's (1.0 if both are 0)."""
        best = max(self.hit_ratios[p] for p in REFERENCES)
        return self.hit_ratios[policy] / best if best else 1.0


@dataclass(frozen=True, slots=True)
class SuiteResult:
    """Every point of a suite run, workloads in the order given, each mode and capacity."""

    policies: tuple[str, ...]
    points: tuple[SuitePoint, ...]

    def worst(self, policy: str) -> float:
        """``policy``'s lowest ratio to the better of LRU and ARC over all points."""
        return min(p.ratio(policy) for p in self.points)

    def table(self) -> str:
        """A row per point: each policy's :meth:`SuitePoint.ratio` and the better
        reference's hit ratio; then each policy's worst."""
        header = f"{'workload':<22} {'capacity':>8} " + " ".join(f"{p:>10}" for p in self.policies)
        lines = [header + f" {'best ref':>8}", "-" * (len(header) + 9)]
        for p in self.points:
            name = p.workload + (" full" if p.full_blocks_only else "")
            cells = " ".join(f"{p.ratio(policy):>10.3f}" for policy in self.policies)
            best = max(p.hit_ratios[r] for r in REFERENCES)
            lines.append(f"{name:<22} {p.capacity_fraction:>8.0%} {cells} {best:>8.4f}")
        worst = " ".join(f"{self.worst(policy):>10.3f}" for policy in self.policies)
        lines.append(f"{'worst':<22} {'':>8} {worst}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The result as plain JSON values (the ``--json`` line of ``tiering sweep --suite``)."""
        return {
            "policies": list(self.policies),
            "worst_ratio": {p: round(self.worst(p), 4) for p in self.policies},
            "points": [
                {k: v for k, v in asdict(p).items() if k != "hit_ratios"}
                | {"hit_ratio": {k: round(v, 4) for k, v in p.hit_ratios.items()}}
                for p in self.points
            ],
        }


@functools.lru_cache(maxsize=2)  # every point of one workload replays the same requests
def suite_requests(workload: str, seed: int) -> list[Request]:
    """A named workload, or the Mooncake trace at the path ``workload``."""
    return generate(workload, seed) if workload in WORKLOADS else read_mooncake(workload)


def _point(workload: str, seed: int, full: bool, fraction: float, policy: str) -> tuple[int, float]:
    from tiering.lab.replay import simulate  # the replay imports the tiers: only where it runs
    from tiering.lab.sweep import footprint

    requests = suite_requests(workload, seed)
    blocks = max(1, round(footprint(requests, full_blocks_only=full) * fraction))
    model = simulate(requests, cpu_blocks=blocks, policy=policy, full_blocks_only=full)
    return blocks, model.hit_ratio


def run_suite(
    workloads: Sequence[str] = WORKLOADS,
    policies: Sequence[str] | None = None,
    *,
    fractions: Sequence[float] = FRACTIONS,
    modes: Sequence[bool] = (False, True),
    seed: int = 0,
    jobs: int = 1,
) -> SuiteResult:
    """The bookkeeping replay of every workload (a name of :data:`WORKLOADS` or a trace
    path), in every mode (``full_blocks_only``), at every fraction of its footprint, with
    every policy (as :func:`~tiering.lab.sweep.sweep`) and the :data:`REFERENCES`, on
    ``jobs`` processes. Raises InvalidArgumentError for an unknown workload or a bad
    fraction, UnknownPolicyError, or TraceError for a bad trace."""
    names = policy_names() if policies is None else list(dict.fromkeys(map(policy_name, policies)))
    names += [r for r in REFERENCES if r not in names]
    check_suite(workloads, fractions, seed)
    tasks = [
        (w, seed, full, f, p) for w in workloads for full in modes for f in fractions for p in names
    ]
    points: dict[tuple[str, bool, float], SuitePoint] = {}
    for (w, _seed, full, f, policy), (blocks, hit_ratio) in zip(
        tasks, map_points(_point, tasks, jobs), strict=True
    ):
        point = points.setdefault((w, full, f), SuitePoint(w, full, f, blocks, {}))
        point.hit_ratios[policy] = hit_ratio
    return SuiteResult(tuple(names), tuple(points.values()))


def check_suite(workloads: Sequence[str], fractions: Sequence[float], seed: int) -> None:
    """Fail before the first replay, not in a worker: InvalidArgumentError for a fraction
    outside (0, 1] or an unknown workload, TraceError for a bad trace."""
    for fraction in fractions:
        if not 0 < fraction <= 1:
            raise InvalidArgumentError(f"fractions: {fraction!r} is not in (0, 1]")
    for workload in workloads:
        suite_requests(workload, seed)


def map_points(point: Callable[..., _T], tasks: Sequence[tuple[Any, ...]], jobs: int) -> list[_T]:
    """``point(*task)`` of every task, in order, on ``jobs`` processes (forked, so that
    policies registered at run time exist in the workers)."""
    if jobs > 1:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(point, *zip(*tasks, strict=True)))
    return [point(*task) for task in tasks]


def plot_worst(
    fractions_and_ratios: Iterable[tuple[str, float, float]],
    path: str | Path,
    *,
    ylabel: str,
    title: str,
) -> Path:
    """Draw each name's lowest ratio at each capacity, from ``(name, capacity fraction,
    ratio)`` triples, as :func:`~tiering.lab.sweep.plot_lines` does: a suite's plot."""
    from tiering.lab.sweep import plot_lines  # the sweep imports the replay: only where it draws

    worst: dict[str, dict[float, float]] = {}
    for name, fraction, ratio in fractions_and_ratios:
        line = worst.setdefault(name, {})
        x = fraction * 100
        line[x] = min(line.get(x, float("inf")), ratio)
    lines = {name: sorted(line.items()) for name, line in worst.items()}
    xlabel = "CPU tier capacity, of each workload's footprint"
    return plot_lines(lines, path, xlabel=xlabel, ylabel=ylabel, title=title)


def plot_suite(result: SuiteResult, path: str | Path) -> Path:
    """Draw each policy's worst :meth:`SuitePoint.ratio` by capacity (:func:`plot_worst`)."""
    workloads = len({p.workload for p in result.points})
    return plot_worst(
        ((policy, p.capacity_fraction, p.ratio(policy))
         for p in result.points for policy in result.policies),
        path,
        ylabel="worst hit ratio / the better of LRU and ARC",
        title=f"the workload suite: the worst of {workloads} workloads at each capacity",
    )  # fmt: skip
