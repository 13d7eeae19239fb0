"""Property-based tests: random operation sequences keep the manager's invariants.

A plain model tracks what each block must be (ready, readers); every step checks the
manager against it and against the invariants that protect data: no pinned or
in-flight block is evicted, capacity is never exceeded, no slot has two owners.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiering.core.cpu_tier import CPUOffloadingManager
from tiering.core.policies import policy_names

CAPACITY = 6
KEYS = [i.to_bytes(2, "big") for i in range(14)]
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=5)


class _ManagerMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.m = CPUOffloadingManager(CAPACITY, policy=self.policy, enable_events=True)
        self.ready: dict[bytes, bool] = {}
        self.refs: dict[bytes, int] = {}

    @rule(keys=key_lists)
    def prepare_store(self, keys: list[bytes]) -> None:
        before_ready = dict(self.ready)
        admit = self.m.policy.admit  # a policy may decline new keys (second sight)
        new = [k for k in dict.fromkeys(keys) if k not in before_ready and admit(k)]
        out = self.m.prepare_store(keys)
        if out is None:
            assert set(self.m._slot_of) == set(before_ready)
            evictable = [
                k for k in before_ready if before_ready[k] and not self.refs[k] and k not in keys
            ]
            assert len(before_ready) + len(new) - len(evictable) > CAPACITY
            return
        assert out.block_hashes_to_store == new
        for k in out.block_hashes_evicted:
            assert before_ready[k], "evicted a block still being stored"
            assert self.refs[k] == 0, "evicted a pinned block"
            assert k not in keys, "evicted a sibling of the store"
            del self.ready[k], self.refs[k]
        for k in new:
            self.ready[k] = False
            self.refs[k] = 0

    @precondition(lambda self: any(not r for r in self.ready.values()))
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        in_flight = sorted(k for k, r in self.ready.items() if not r)
        keys = data.draw(st.lists(st.sampled_from(in_flight), min_size=1, unique=True))
        self.m.complete_store(keys, success=success)
        for k in keys:
            if success:
                self.ready[k] = True
            else:
                del self.ready[k], self.refs[k]

    @precondition(lambda self: any(self.ready.values()))
    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        ready = sorted(k for k, r in self.ready.items() if r)
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3))
        spec = self.m.prepare_load(keys)
        assert list(spec.block_ids) == [self.m.block_state(k).slot for k in keys]
        for k in keys:
            self.refs[k] += 1

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        pinned = sorted(k for k, n in self.refs.items() if n)
        key = data.draw(st.sampled_from(pinned))
        self.m.complete_load([key])
        self.refs[key] -= 1

    @rule(keys=key_lists)
    def touch(self, keys: list[bytes]) -> None:
        self.m.touch(keys)

    @rule(keys=key_lists)
    def lookup(self, keys: list[bytes]) -> None:
        expected = 0
        for k in keys:
            if not self.ready.get(k):
                break
            expected += 1
        assert self.m.lookup(keys) == expected

    @invariant()
    def matches_the_model(self) -> None:
        assert len(self.m) == len(self.ready) <= CAPACITY
        for k, ready in self.ready.items():
            state = self.m.block_state(k)
            assert state is not None and state.ready == ready
            assert state.ref_count == self.refs[k]
        assert len(self.m.policy) == len(self.ready)

    @invariant()
    def slots_have_one_owner_each(self) -> None:
        slots = [self.m.block_state(k).slot for k in self.ready]
        assert len(set(slots)) == len(slots)
        assert all(0 <= s < CAPACITY for s in slots)
        assert set(slots).isdisjoint(self.m._free_slots)
        assert len(slots) + len(self.m._free_slots) == CAPACITY

    @invariant()
    def evictable_count_is_exact(self) -> None:
        expected = sum(1 for k, r in self.ready.items() if r and not self.refs[k])
        assert self.m.num_evictable == expected


@pytest.mark.parametrize("policy", policy_names())
def test_random_operations_keep_the_invariants(policy: str) -> None:
    machine = type(f"Machine_{policy}", (_ManagerMachine,), {"policy": policy})
    machine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
    machine.TestCase().runTest()
