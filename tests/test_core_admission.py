"""Which blocks a lower tier takes (tiering.core.admission): each rule through its public
calls, and the bookkeeping replay's counts of what each tier wrote and refused."""

from __future__ import annotations

import bisect
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._clock import FakeClock
from tiering.core.admission import ADMISSIONS, WriteGate, make_admission
from tiering.core.write_budget import BURST_S, WriteBudget
from tiering.errors import InvalidArgumentError
from tiering.lab.replay import simulate
from tiering.lab.workloads import TOKENS_PER_BLOCK, Request


def key(i: int) -> bytes:
    return i.to_bytes(8, "little")


def keys(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


def nowhere(_key: bytes) -> bool:  # the tier above holds nothing
    return False


def test_all_admits_every_offered_block_in_order() -> None:
    rule = make_admission("all", 8)
    rule.observe([key(1)], nowhere)
    assert rule.admit([key(3), key(1), key(2)]) == [key(3), key(1), key(2)]


@given(st.lists(st.lists(st.integers(0, 20), max_size=8), max_size=30))
def test_seen_twice_admits_the_blocks_two_requests_named(requests: list[list[int]]) -> None:
    rule = make_admission("seen-twice", 1 << 16)  # one generation: counts never halve
    named: Counter[int] = Counter()
    for request in requests:
        rule.observe([key(i) for i in request], nowhere)
        named.update(set(request))
    offered = [key(i) for i in range(21)]
    assert rule.admit(offered) == [key(i) for i in range(21) if named[i] >= 2]


def test_seen_twice_halves_a_count_carried_into_a_new_generation() -> None:
    rule = make_admission("seen-twice", 2)  # a generation: 8 x 2 observed keys
    rule.observe([key(0)], nowhere)
    rule.observe([key(0)], nowhere)
    rule.observe([key(i) for i in range(100, 114)], nowhere)  # 16 keys: a new generation
    assert rule.admit([key(0)]) == []  # 2 carried over as 1
    rule.observe([key(0)], nowhere)
    assert rule.admit([key(0)]) == [key(0)]


def test_adaptive_admits_everything_while_its_tier_has_room() -> None:
    rule = make_admission("adaptive", 64)
    for i in range(40):  # unique blocks: refusing would save writes, but gains no hit
        rule.observe([key(i)], nowhere)
    assert rule.admit([key(1000)]) == [key(1000)]


def test_adaptive_refuses_first_sight_blocks_where_refusing_costs_no_hit() -> None:
    rule = make_admission("adaptive", 64)
    for i in range(1000):  # a scan: no block comes back, the tier's room fills up
        rule.observe([key(i)], nowhere)
    assert rule.admit([key(5000), key(999)]) == []  # first sights, refused


def test_adaptive_refuses_below_a_tier_that_turned_over_twice_though_its_own_has_room() -> None:
    rule = make_admission("adaptive", 100_000, 50)  # its own tier never fills here
    for i in range(99):  # fewer distinct blocks than the tier above holds twice over
        rule.observe([key(i)], nowhere)
    assert rule.admit([key(5000)]) == [key(5000)]
    for i in range(99, 1000):  # a scan: no block comes back
        rule.observe([key(i)], nowhere)
    assert rule.admit([key(5000)]) == []


@pytest.mark.parametrize("above", [None, 8])
def test_adaptive_admits_everything_where_refusing_costs_hits(above: int | None) -> None:
    rule = make_admission("adaptive", 64, above)
    for i in range(1000):  # every block comes back once, 16 requests later
        rule.observe([key(i)], nowhere)
        if i >= 16:
            rule.observe([key(i - 16)], nowhere)
    assert rule.admit([key(5000)]) == [key(5000)]


def test_a_block_the_tier_above_holds_is_no_evidence_for_this_tier() -> None:
    rule = make_admission("adaptive", 64)
    for i in range(1000):  # the tier above answers every request: this tier sees none
        rule.observe([key(i)], lambda _k: True)
    assert rule.admit([key(5000)]) == [key(5000)]  # its shadows never filled


@pytest.mark.parametrize("rule", [None, "seen", "ALL", 2])
def test_an_unknown_rule_is_refused_naming_admission(rule: object) -> None:
    with pytest.raises(InvalidArgumentError, match="admission must be one of"):
        make_admission(rule, 8)


def test_a_bad_tier_capacity_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgumentError, match="capacity_blocks"):
        make_admission("adaptive", 0)


def requests_of(chains: list[list[int]]) -> list[Request]:
    return [
        Request(float(t), tuple(chain), TOKENS_PER_BLOCK * len(chain), 16, t)
        for t, chain in enumerate(chains)
    ]


@pytest.mark.parametrize("rule", ADMISSIONS)
def test_the_replay_counts_what_each_tier_wrote_and_refused(rule: str) -> None:
    chains = [[i, i + 1, i + 2] for i in range(0, 300, 3)] * 2  # every prompt twice
    full = simulate(requests_of(chains), cpu_blocks=8, tier_blocks=[32, None],
                    full_blocks_only=True, tier_admission=[rule, "all"])  # fmt: skip
    offered = full.written["tier0"] + full.refused["tier0"]
    assert offered > 0 and full.written["tier1"] > 0 and full.refused["tier1"] == 0
    if rule == "all":
        assert full.refused["tier0"] == 0
    if rule == "seen-twice":  # the first pass: every block refused
        assert full.refused["tier0"] >= 300 - 8


def test_a_replay_names_one_rule_per_tier() -> None:
    with pytest.raises(InvalidArgumentError, match="tier_admission"):
        simulate(requests_of([[1, 2]]), cpu_blocks=4, tier_blocks=[8], tier_admission=[])


def _budgeted(rule: str, blocks_per_s: float, backlog: int = 16) -> tuple[WriteGate, FakeClock]:
    clock = FakeClock()
    gate = WriteGate(make_admission(rule, 64), WriteBudget(blocks_per_s, 1, clock), backlog)
    return gate, clock


def test_over_budget_a_gate_writes_blocks_seen_twice_first() -> None:
    gate, _ = _budgeted("adaptive", 2)  # it admits everything: its tier has room
    for request in (keys(1, 2, 3), keys(3)):
        gate.observe(request, nowhere)
    assert gate.admit(keys(1, 2, 3)) == keys(3, 1)  # 3 was seen twice; then in order


def test_the_backlog_skips_blocks_no_longer_writable_and_keeps_its_bound() -> None:
    gate, clock = _budgeted("all", 1, backlog=3)
    assert gate.admit(keys(1, 2, 3, 4, 5), lambda key: True) == keys(1)
    assert gate.backlog == 3  # 2 went first: the oldest
    clock.now += 3
    assert gate.admit([], lambda key: key != keys(3)[0]) == keys(4)  # 3 left the CPU tier
    assert gate.counters() == {
        "admitted_blocks": 2,
        "refused_blocks": 0,
        "over_budget_blocks": 4,
        "late_blocks": 1,
        "backlog_blocks": 1,  # 5 waits on: the bucket of one block went to 4
    }


def test_a_victim_over_the_budget_is_not_kept_for_later() -> None:
    gate, _ = _budgeted("all", 1)
    assert gate.admit(keys(1, 2)) == keys(1)  # no writable: write-back's victims
    assert gate.backlog == 0 and gate.counters()["over_budget_blocks"] == 1


def test_a_waiting_block_named_again_goes_before_first_sights() -> None:
    gate, clock = _budgeted("adaptive", 1)
    gate.observe(keys(1, 2), nowhere)
    assert gate.admit(keys(1, 2), lambda key: True) == keys(1)  # 2 waits
    gate.observe(keys(2), nowhere)  # its second request
    clock.now += 1
    assert gate.admit(keys(3), lambda key: True) == keys(2)  # before the offer's 3


@settings(max_examples=40, deadline=None)
@given(
    rate=st.floats(0.5, 20),
    offers=st.lists(st.tuples(st.floats(0, 3), st.integers(0, 30)), min_size=1, max_size=200),
)
def test_no_minute_writes_more_than_the_budget_and_one_second_backlog_included(
    rate: float, offers: list[tuple[float, int]]
) -> None:
    gate, clock = _budgeted("all", rate, backlog=64)
    times, written, next_key = [], [], 0
    for gap, blocks in offers:
        clock.now += gap
        offered = keys(*range(next_key, next_key + blocks))
        next_key += blocks
        times.append(clock.now)
        written.append(len(gate.admit(offered, lambda key: True)))
    for i, start in enumerate(times):
        end = bisect.bisect_right(times, start + 60.0)
        assert sum(written[i:end]) <= max(1.0, rate * BURST_S) + rate * 60.0 + 1e-6
    assert gate.admitted_blocks == sum(written)
