"""Capacity sweeps: the bookkeeping replay (:func:`~tiering.lab.replay.simulate`) at
several CPU capacities and policies, and a plot of hit ratio against capacity."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tiering.core.policies import policy_name, policy_names
from tiering.errors import InvalidArgumentError
from tiering.lab.replay import simulate
from tiering.lab.workloads import Request


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One replay of a sweep (capacity_fraction: of the footprint)."""

    capacity_blocks: int
    capacity_fraction: float
    policy: str
    hit_ratio: float
    requests_per_s: float


@dataclass(frozen=True, slots=True)
class SweepResult:
    """Every point of a sweep, capacities ascending, policies in the order given."""

    requests: int
    footprint_blocks: int
    points: tuple[SweepPoint, ...]

    def to_json(self) -> dict[str, Any]:
        """The result as plain JSON values (the ``--json`` line of ``tiering sweep``)."""
        return {
            "requests": self.requests,
            "footprint_blocks": self.footprint_blocks,
            "points": [
                {
                    **asdict(p),
                    "capacity_fraction": round(p.capacity_fraction, 4),
                    "hit_ratio": round(p.hit_ratio, 4),
                    "requests_per_s": round(p.requests_per_s),
                }
                for p in self.points
            ],
        }

    def table(self) -> str:
        """A text table: one row per capacity, one column per policy."""
        policies = list(dict.fromkeys(p.policy for p in self.points))
        rows: dict[int, dict[str, float]] = {}
        fractions: dict[int, float] = {}
        for p in self.points:
            rows.setdefault(p.capacity_blocks, {})[p.policy] = p.hit_ratio
            fractions[p.capacity_blocks] = p.capacity_fraction
        header = f"{'capacity':>10} {'of footprint':>12} " + " ".join(f"{n:>8}" for n in policies)
        lines = [header, "-" * len(header)]
        for capacity, ratios in rows.items():
            cells = " ".join(f"{ratios[n]:>8.4f}" for n in policies)
            lines.append(f"{capacity:>10} {fractions[capacity]:>11.1%} {cells}")
        return "\n".join(lines)


def footprint(requests: Sequence[Request], *, full_blocks_only: bool = False) -> int:
    """The workload's distinct blocks (full ones only, with ``full_blocks_only``)."""
    return len({k for r in requests for k in r.keys(full_blocks_only=full_blocks_only)})


def capacities_from(text: str, footprint_blocks: int) -> list[int]:
    """Capacities, ascending and distinct, from comma-separated block counts and footprint
    percentages (``1000,5%``); InvalidArgumentError names a bad item."""
    capacities = set()
    for item in map(str.strip, text.split(",")):
        if item.endswith("%"):
            capacities.add(max(1, round(footprint_blocks * _fraction(item, text))))
            continue
        try:
            blocks = int(item)
        except ValueError:
            blocks = 0
        if blocks <= 0:
            raise _bad_capacity(item, text)
        capacities.add(blocks)
    return sorted(capacities)


def fractions_from(text: str) -> list[float]:
    """Footprint fractions, in order, from comma-separated percentages (``1%,5%``);
    InvalidArgumentError names an item that is not one in (0, 100]%."""
    fractions = []
    for item in map(str.strip, text.split(",")):
        if not item.endswith("%"):
            raise InvalidArgumentError(
                f"capacities: the suite takes percentages of the footprint, got {item!r}"
            )
        fractions.append(_fraction(item, text))
    return fractions


def _fraction(item: str, text: str) -> float:
    try:
        percent = float(item[:-1])
    except ValueError:
        percent = 0.0
    if not 0 < percent <= 100:
        raise _bad_capacity(item, text)
    return percent / 100


def _bad_capacity(item: str, text: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"capacities: {item!r} is neither a positive block count nor a percentage "
        f"in (0, 100]% (in {text!r})"
    )


def sweep(
    requests: Sequence[Request],
    capacities: Sequence[int],
    policies: Sequence[str] | None = None,
    *,
    full_blocks_only: bool = False,
) -> SweepResult:
    """The bookkeeping replay at every capacity (CPU blocks) with every policy (default:
    all; a retired name counts as its replacement, once). Raises InvalidArgumentError or
    UnknownPolicyError."""
    if not requests:
        raise InvalidArgumentError("requests: the workload is empty")
    if not capacities:
        raise InvalidArgumentError("capacities: give at least one")
    names = policy_names() if policies is None else list(dict.fromkeys(map(policy_name, policies)))
    total = footprint(requests, full_blocks_only=full_blocks_only)
    points = []
    for capacity in sorted(capacities):
        for policy in names:
            began = time.perf_counter()
            model = simulate(
                requests, cpu_blocks=capacity, policy=policy, full_blocks_only=full_blocks_only
            )
            elapsed = time.perf_counter() - began
            fraction = capacity / total if total else 0.0
            speed = len(requests) / elapsed if elapsed > 0 else 0.0
            points.append(SweepPoint(capacity, fraction, policy, model.hit_ratio, speed))
    return SweepResult(len(requests), total, tuple(points))


def plot_sweep(result: SweepResult, path: str | Path, *, title: str = "") -> Path:
    """Draw hit ratio against capacity, one line per policy, as :func:`plot_lines` does."""
    lines: dict[str, list[tuple[float, float]]] = {}
    for p in result.points:
        lines.setdefault(p.policy, []).append((p.capacity_fraction * 100, p.hit_ratio))
    return plot_lines(
        lines,
        path,
        xlabel=f"CPU tier capacity, of the footprint ({result.footprint_blocks} blocks)",
        ylabel="prefix hit ratio",
        title=title or f"hit ratio by capacity ({result.requests} requests)",
    )


def plot_lines(
    lines: dict[str, list[tuple[float, float]]],
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
) -> Path:
    """One line of markers per label against a log x axis (percentages), into a PNG at
    ``path``; InvalidArgumentError without matplotlib or if ``path`` cannot be written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgumentError(
            "plot: needs matplotlib (pip install 'kv-tiering[plot]')"
        ) from None
    path = Path(path)
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        for label, points in lines.items():
            axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
        axes.set_xscale("log")
        ticks = sorted({x for points in lines.values() for x, _ in points})
        axes.set_xticks(ticks, [f"{t:.2g}%" for t in ticks])
        axes.minorticks_off()
        axes.set(xlabel=xlabel, ylabel=ylabel, title=title)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
        figure.tight_layout()
        try:
            figure.savefig(path, format="png")
        except OSError as exc:
            raise InvalidArgumentError(f"plot: cannot write {str(path)!r}: {exc}") from None
    finally:
        plt.close(figure)
    return path
