"""The admission rules on the workload suite (``tiering.lab.admission_suite``)."""

from __future__ import annotations

import pytest

from tiering.errors import InvalidArgumentError
from tiering.lab.admission_suite import run_admission_suite
from tiering.lab.replay import simulate
from tiering.lab.sweep import footprint
from tiering.lab.workload_suite import generate


def test_each_rule_is_reported_against_admitting_everything() -> None:
    result = run_admission_suite(["scan"], ["seen-twice"], fractions=(0.02,), modes=(True,))
    assert result.rules == ("all", "seen-twice") and result.tier_factor == 4
    (point,) = result.points
    requests = generate("scan")
    cpu = round(footprint(requests, full_blocks_only=True) * 0.02)
    assert (point.cpu_blocks, point.tier_blocks) == (cpu, 4 * cpu)
    for rule in result.rules:
        model = simulate(requests, cpu_blocks=cpu, policy="lru", tier_blocks=[4 * cpu],
                         full_blocks_only=True, tier_admission=[rule])  # fmt: skip
        run = point.runs[rule]
        assert (run.hit_ratio, run.written, run.refused) == (
            model.hit_ratio,
            model.written["tier0"],
            model.refused["tier0"],
        )
        assert run.tier_hit_ratio == model.hits["tier0"] / model.blocks
    assert point.hit_ratio("all") == point.writes("all") == 1.0
    assert (
        point.writes("seen-twice") == point.runs["seen-twice"].written / point.runs["all"].written
    )
    assert result.worst("seen-twice") == point.hit_ratio("seen-twice")
    assert result.total_writes("seen-twice") == point.writes("seen-twice")
    assert result.to_json()["total_writes_ratio"]["seen-twice"] == round(
        point.writes("seen-twice"), 4
    )
    assert "scan full" in result.table()


def test_a_budgeted_run_writes_within_its_fraction_of_admitting_everything() -> None:
    result = run_admission_suite(
        ["chat"], ["adaptive"], fractions=(0.05,), modes=(False,), budget_fraction=0.25
    )
    assert result.rules == ("all", "adaptive", "all+budget", "adaptive+budget")
    assert result.budgeted == ("all", "adaptive")
    (point,) = result.points
    requests = generate("chat")
    seconds = requests[-1].arrival_s - requests[0].arrival_s
    all_writes = point.runs["all"].written
    for rule in result.budgeted:
        budgeted = point.runs[rule + "+budget"]
        # A bucket of one second's budget: at most that over the whole trace's.
        assert budgeted.written <= 0.25 * all_writes * (seconds + 1) / seconds + 1
        assert budgeted.refused > point.runs[rule].refused
        assert point.budget_ratio(rule) == budgeted.hit_ratio / point.runs[rule].hit_ratio
    assert result.to_json()["worst_budget_ratio"]["adaptive"] == round(
        point.budget_ratio("adaptive"), 4
    )
    assert "within a budget of 0.25" in result.table()


def test_the_admission_suite_gives_the_same_points_on_two_processes() -> None:
    args = (["shift"], ["adaptive"])
    kwargs = {"fractions": (0.01, 0.1), "modes": (False,)}
    assert run_admission_suite(*args, **kwargs, jobs=2) == run_admission_suite(*args, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rules": ["seen-thrice"]}, "admission must be one of"),
        ({"tier_factor": 0}, "tier_factor"),
        ({"fractions": (0.0,)}, "fractions"),
        ({"budget_fraction": 0}, "budget_fraction"),
    ],
)
def test_a_bad_suite_is_refused_before_any_replay(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        run_admission_suite(["scan"], **kwargs)
