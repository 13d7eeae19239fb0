"""The admission rules on the workload suite: every workload and mode at each CPU capacity,
with a lower tier of ``tier_factor`` times the CPU tier's blocks below it (LRU, written
through what the rule admits), in the bookkeeping replay; each rule's hit ratio and the
blocks it wrote to the lower tier, as ratios to admitting everything. With a
``budget_fraction``, each rule runs again as ``<rule>+budget``: within a write budget of
that fraction of what admitting everything wrote, spread over the trace's time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tiering.config import WORKLOADS
from tiering.core.admission import ADMISSIONS, make_admission
from tiering.core.policies import policy_name
from tiering.lab.workload_suite import (
    FRACTIONS,
    check_suite,
    map_points,
    plot_worst,
    suite_requests,
)
from tiering.validation import positive_int, real

BASELINE = "all"
"""The rule every other is measured against."""
BUDGETED = "+budget"
"""The suffix of a rule's name for its run within the write budget."""


def _over(value: float, base: float) -> float:
    """``value / base``, 1.0 where ``base`` is 0 (nothing to compare with)."""
    return value / base if base else 1.0


@dataclass(frozen=True, slots=True)
class RuleRun:
    """One rule at one point: the total hit ratio, the lower tier's share of it, and the
    blocks offered to the lower tier that it wrote and refused."""

    hit_ratio: float
    tier_hit_ratio: float
    written: int
    refused: int


@dataclass(frozen=True, slots=True)
class AdmissionPoint:
    """One workload, mode and CPU capacity, with every rule's :class:`RuleRun`."""

    workload: str
    full_blocks_only: bool
    capacity_fraction: float
    cpu_blocks: int
    tier_blocks: int
    runs: dict[str, RuleRun]

    def hit_ratio(self, rule: str) -> float:
        """``rule``'s hit ratio over admitting everything's (1.0 if that is 0)."""
        return _over(self.runs[rule].hit_ratio, self.runs[BASELINE].hit_ratio)

    def writes(self, rule: str) -> float:
        """``rule``'s blocks written over admitting everything's (1.0 if that is 0)."""
        return _over(self.runs[rule].written, self.runs[BASELINE].written)

    def budget_ratio(self, rule: str) -> float:
        """``rule``'s hit ratio within the budget over its own without (1.0 if that is 0)."""
        return _over(self.runs[rule + BUDGETED].hit_ratio, self.runs[rule].hit_ratio)


@dataclass(frozen=True, slots=True)
class AdmissionSuiteResult:
    """Every point of an admission suite, workloads in the order given."""

    rules: tuple[str, ...]
    tier_factor: int
    points: tuple[AdmissionPoint, ...]
    budget_fraction: float | None = None

    @property
    def budgeted(self) -> tuple[str, ...]:
        """The rules that also ran within the budget (none without one)."""
        if self.budget_fraction is None:
            return ()
        return tuple(r for r in self.rules if not r.endswith(BUDGETED))

    def worst_budget_ratio(self, rule: str) -> float:
        """``rule``'s lowest :meth:`AdmissionPoint.budget_ratio` over the points."""
        return min(p.budget_ratio(rule) for p in self.points)

    def worst(self, rule: str) -> float:
        """``rule``'s lowest :meth:`AdmissionPoint.hit_ratio` over the points."""
        return min(p.hit_ratio(rule) for p in self.points)

    def total_writes(self, rule: str) -> float:
        """``rule``'s blocks written summed over the points, over admitting everything's."""
        base = sum(p.runs[BASELINE].written for p in self.points)
        return _over(sum(p.runs[rule].written for p in self.points), base)

    def table(self) -> str:
        """A row per point: each rule's hit ratio and writes over admitting everything's,
        and that rule's hit ratio; then each rule's worst hit ratio and total writes."""
        cells = " ".join(f"{r + ' hit/w':>22}" for r in self.rules)
        header = f"{'workload':<22} {'capacity':>8} {cells} {'all hit':>8}"
        lines = [header, "-" * len(header)]
        for p in self.points:
            name = p.workload + (" full" if p.full_blocks_only else "")
            row = " ".join(f"{p.hit_ratio(r):>14.3f} {p.writes(r):>7.2f}" for r in self.rules)
            base = p.runs[BASELINE].hit_ratio
            lines.append(f"{name:<22} {p.capacity_fraction:>8.0%} {row} {base:>8.4f}")
        totals = " ".join(
            f"{self.worst(r):>14.3f} {self.total_writes(r):>7.2f}" for r in self.rules
        )
        lines.append(f"{'worst hit / total w':<22} {'':>8} {totals}")
        for rule in self.budgeted:
            lines.append(
                f"{rule} within a budget of {self.budget_fraction:g} x all's writes: worst hit "
                f"ratio {self.worst_budget_ratio(rule):.3f} x its own without"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The result as plain JSON values (the ``--json`` line of ``tiering sweep --suite
        --admission``)."""
        return {
            "rules": list(self.rules),
            "tier_factor": self.tier_factor,
            "worst_hit_ratio": {r: round(self.worst(r), 4) for r in self.rules},
            "total_writes_ratio": {r: round(self.total_writes(r), 4) for r in self.rules},
            "budget_fraction": self.budget_fraction,
            "worst_budget_ratio": {r: round(self.worst_budget_ratio(r), 4) for r in self.budgeted},
            "points": [
                {k: v for k, v in asdict(p).items() if k != "runs"}
                | {"runs": {r: asdict(run) for r, run in p.runs.items()}}
                for p in self.points
            ],
        }


def _point(
    workload: str,
    seed: int,
    full: bool,
    fraction: float,
    policy: str,
    factor: int,
    rule: str,
    budget_blocks: float | None = None,
) -> tuple[int, RuleRun]:
    """One rule at one point; within a budget of ``budget_blocks`` writes over the trace."""
    from tiering.lab.replay import simulate  # the replay imports the tiers: only where it runs
    from tiering.lab.sweep import footprint

    requests = suite_requests(workload, seed)
    cpu = max(1, round(footprint(requests, full_blocks_only=full) * fraction))
    budget = None
    if budget_blocks is not None:
        seconds = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
        budget = max(budget_blocks, 1e-9) / max(seconds, 1e-9)  # blocks a second
    model = simulate(requests, cpu_blocks=cpu, policy=policy, tier_blocks=[factor * cpu],
                     full_blocks_only=full, tier_admission=[rule.removesuffix(BUDGETED)],
                     tier_budget=[budget])  # fmt: skip
    tier = model.tier_names[0]
    run = RuleRun(
        model.hit_ratio,
        model.hits[tier] / model.blocks if model.blocks else 0.0,
        model.written[tier],
        model.refused[tier],
    )
    return cpu, run


def run_admission_suite(
    workloads: Sequence[str] = WORKLOADS,
    rules: Sequence[str] = ADMISSIONS,
    *,
    fractions: Sequence[float] = FRACTIONS,
    modes: Sequence[bool] = (False, True),
    policy: str = "lru",
    tier_factor: int = 4,
    budget_fraction: float | None = None,
    seed: int = 0,
    jobs: int = 1,
) -> AdmissionSuiteResult:
    """The bookkeeping replay of every workload (a name of :data:`WORKLOADS` or a trace
    path), mode and fraction of its footprint for the CPU tier (evicting by ``policy``),
    with an LRU tier of ``tier_factor`` times its blocks below it under each rule (and
    ``all``), then within the budget if ``budget_fraction`` (in (0, 1]) is given, on
    ``jobs`` processes. Raises InvalidArgumentError for an unknown rule or workload or a
    bad fraction or factor, UnknownPolicyError, or TraceError."""
    policy = policy_name(policy)
    factor = positive_int("tier_factor", tier_factor)
    if budget_fraction is not None:
        real("budget_fraction", budget_fraction, "a number in (0, 1]", lambda f: 0 < f <= 1)
    names = list(dict.fromkeys([BASELINE, *rules]))
    for rule in names:
        make_admission(rule, 1)  # an unknown rule fails here, not in a worker
    check_suite(workloads, fractions, seed)
    tasks = [
        (w, seed, full, f, policy, factor, r)
        for w in workloads
        for full in modes
        for f in fractions
        for r in names
    ]
    points: dict[tuple[str, bool, float], AdmissionPoint] = {}
    results = map_points(_point, tasks, jobs)
    for (w, _seed, full, f, _policy, _factor, rule), (cpu, run) in zip(tasks, results, strict=True):
        point = points.setdefault((w, full, f), AdmissionPoint(w, full, f, cpu, factor * cpu, {}))
        point.runs[rule] = run
    if budget_fraction is not None:  # a second round: each point's budget is all's writes
        budgeted = [
            (w, seed, full, f, policy, factor, r + BUDGETED,
             budget_fraction * points[w, full, f].runs[BASELINE].written)
            for w in workloads for full in modes for f in fractions for r in names
        ]  # fmt: skip
        for task, (_cpu, run) in zip(budgeted, map_points(_point, budgeted, jobs), strict=True):
            points[task[0], task[2], task[3]].runs[task[6]] = run
        names += [r + BUDGETED for r in names]
    return AdmissionSuiteResult(tuple(names), factor, tuple(points.values()), budget_fraction)


def plot_admission_suite(result: AdmissionSuiteResult, path: str | Path) -> Path:
    """Draw each rule's worst hit ratio over admitting everything's by capacity."""
    return plot_worst(
        ((rule, p.capacity_fraction, p.hit_ratio(rule))
         for p in result.points for rule in result.rules),
        path,
        ylabel="worst hit ratio / admitting everything's",
        title=f"admission to a lower tier of {result.tier_factor}x the CPU tier's blocks",
    )  # fmt: skip
