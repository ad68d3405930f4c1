"""ResumePointPolicy: retention by resume point (backends/retention.py) in a real LruIndex."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_offload.backends.lru_index import EvictionPolicy, LruIndex, LruPolicy
from hybrid_offload.backends.retention import ResumePointPolicy, Retention, page_weight

MB = 1 << 20


def put_chain(index: LruIndex[None], policy: ResumePointPolicy, name: str, chunks: int, attention: int,
              state: int, weight: float = 1.0, parent: str = "") -> list[str]:  # fmt: skip
    """A request's pages as the store path puts them: its attention chunks, then its tail state."""
    keys = []
    for c in range(chunks):
        unit = f"{name}.a{c}"
        policy.describe(unit, Retention(unit, parent if c == 0 else f"{name}.a{c - 1}", False, weight))
        index.put(unit, attention, None)
        keys.append(unit)
    tail = f"{name}.s{chunks - 1}"
    policy.describe(tail, Retention(tail, f"{name}.a{chunks - 1}", True, weight))
    index.put(tail, state, None)
    return [*keys, tail]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("put touch delete"), st.integers(0, 30), st.integers(1, 9)),
                max_size=200))  # fmt: skip
def test_without_hints_it_evicts_as_lru_does(ops: list[tuple[str, int, int]]) -> None:
    lru, ours = LruIndex[None](40), LruIndex[None](40, ResumePointPolicy())
    for op, k, size in ops:
        key = f"k{k}"
        for index in (lru, ours):
            if op == "put":
                index.put(key, size, None)
            elif op == "touch":
                index.touch(key)
            else:
                index.remove(key)
        assert lru.ordered() == ours.ordered()
        assert lru.used == ours.used


def test_a_state_goes_before_its_attention_and_orphaned_attention_goes_first() -> None:
    policy = ResumePointPolicy()
    index = LruIndex[None](100 * MB, policy)
    old = put_chain(index, policy, "old", 3, 10 * MB, 5 * MB)
    new = put_chain(index, policy, "new", 3, 10 * MB, 5 * MB)
    assert index.ordered()[0] == old[-1]  # the oldest resume point's state first, then its chain
    index.put("filler", 60 * MB, None)  # 30 MB over: the old state, then its 3 chunks (now useless)
    assert all(k not in index for k in old) and all(k in index for k in new)
    # a state leaving releases the attention only it needed, even when recently used
    index.touch(new[0])
    index.remove(new[-1])
    index.put("later", 1 * MB, None)  # a deleted page is settled by the next put
    assert index.ordered()[:3] == new[2::-1]  # deepest first


def test_attention_shared_by_two_resume_points_stays_until_both_leave() -> None:
    policy = ResumePointPolicy()
    index = LruIndex[None](1000 * MB, policy)
    first = put_chain(index, policy, "t1", 2, 10 * MB, 5 * MB)
    second = put_chain(index, policy, "t2", 1, 10 * MB, 5 * MB, parent=first[1])  # the next turn
    index.remove(first[-1])  # the first turn's state leaves: the next turn still needs its chunks
    assert index.ordered()[0] != first[0]
    index.remove(second[-1])
    assert set(index.ordered()[:3]) == {first[0], first[1], second[0]}


def test_a_page_put_again_keeps_the_states_that_need_it() -> None:
    """Backends replace a page by removing then adding it: that must not orphan its states."""
    policy = ResumePointPolicy()
    index = LruIndex[None](100 * MB, policy)
    keys = put_chain(index, policy, "r", 2, 10 * MB, 5 * MB)
    newer = put_chain(index, policy, "n", 1, 10 * MB, 5 * MB)
    policy.describe(keys[0], Retention(keys[0], "", False))
    index.remove(keys[0])
    index.insert(keys[0], 10 * MB, None)
    assert index.ordered()[0] == keys[-1]  # still the oldest resume point, not a released one
    index.remove(newer[0])  # gone for good: its state cannot load and goes first
    index.put("later", 1 * MB, None)
    index.evict()
    assert newer[-1] not in index and keys[-1] in index


def test_weights_lengthen_lives_and_weight_zero_goes_first() -> None:
    policy = ResumePointPolicy()
    index = LruIndex[None](36 * MB, policy)
    kept = put_chain(index, policy, "kept", 1, 1 * MB, 1 * MB, weight=3.0)
    ended = put_chain(index, policy, "ended", 1, 1 * MB, 1 * MB, weight=0.0)
    assert set(index.ordered()[:2]) == set(ended)
    for i in range(40):  # plain traffic cycling through the tier: 2 MB a request, 18 fit
        put_chain(index, policy, f"p{i}", 1, 1 * MB, 1 * MB)
    assert all(k not in index for k in ended)
    assert all(k in index for k in kept)  # weight 3: outlives about 3 tiers' worth of traffic
    for i in range(40, 120):
        put_chain(index, policy, f"p{i}", 1, 1 * MB, 1 * MB)
    assert all(k not in index for k in kept)


def test_page_weight() -> None:
    assert page_weight(10, 100) == 1.0
    assert page_weight(10, 100, session="continues") == 1.0
    assert page_weight(10, 100, session="ends") == 0.0
    assert page_weight(60, 100) == 0.0  # more than half the tier: a scan
    with pytest.raises(ValueError, match="session"):
        page_weight(1, 100, session="maybe")


@pytest.mark.parametrize("policy_cls", [LruPolicy, ResumePointPolicy])
def test_a_one_shot_long_prompt_does_not_flush_the_tier(policy_cls: type[EvictionPolicy]) -> None:
    """Three conversations fill most of a tier; one long prompt bigger than the tier then
    arrives. Plain LRU loses every conversation (the control); resume points keep them."""
    policy = policy_cls()
    index = LruIndex[None](100 * MB, policy)
    hinted = isinstance(policy, ResumePointPolicy)
    convs = []
    for c in range(3):
        keys = [f"c{c}.a{i}" for i in range(5)] + [f"c{c}.s4"]
        for i, key in enumerate(keys):
            if hinted:
                state = key.endswith("s4")
                parent = f"c{c}.a{min(i, 4) - (0 if state else 1)}" if i else ""
                policy.describe(key, Retention(key, parent, state, 1.0))  # type: ignore[attr-defined]
            index.put(key, 5 * MB, None)
        convs += keys
    scan = 30  # 150 MB of new pages: more than the tier
    weight = page_weight(scan * 5 * MB, index.capacity)
    for i in range(scan):
        key = f"scan.a{i}"
        if hinted:
            policy.describe(key, Retention(key, f"scan.a{i - 1}" if i else "", False, weight))  # type: ignore[attr-defined]
        index.put(key, 5 * MB, None)
    kept = sum(k in index for k in convs)
    if hinted:
        assert kept == len(convs)
    else:
        assert kept == 0


def check_policy(index: LruIndex[None], policy: ResumePointPolicy) -> None:
    """Every held key ordered once; every live state ahead of the held attention it needs."""
    assert sorted(index.ordered()) == sorted(index)
    units = policy._units
    for unit in units.values():
        if unit.state and unit.entry is not None:
            for parent in unit.chain:
                held = units.get(parent)
                assert held is None or (held.entry is not None and held.entry > unit.entry)


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_the_index_and_policy_in_step(seed: int) -> None:
    """Chains put deepest first or not, several pages a state, states stored over held
    attention, replaces, deletes, touches and evictions at random: every held key is ordered
    exactly once, states stay ahead of their attention, nothing outlives the index."""
    rng = random.Random(seed)
    policy = ResumePointPolicy(lambda: index.capacity)
    index = LruIndex[None](200 * MB, policy)
    for step in range(3000):
        name = f"r{rng.randrange(60)}"
        chunks = rng.randrange(1, 6)
        action = rng.random()
        if action < 0.5:
            pages = [(f"{name}.a{c}", Retention(f"{name}.A{c}", f"{name}.A{c - 1}" if c else "", False))
                     for c in range(chunks)]  # fmt: skip
            state = Retention(f"{name}.S", f"{name}.A{chunks - 1}", True, rng.choice([0.0, 1.0, 2.0]),
                              rng.choice([0, 150 * MB]))  # fmt: skip
            pages += [(f"{name}.s.g{g}", state) for g in range(rng.randrange(1, 3))]
            if rng.random() < 0.5:
                pages.reverse()  # as the store path puts them
            for key, hint in pages:
                policy.describe(key, hint)
                index.put(key, rng.choice([4, 8, 12]) * MB, None)
        elif action < 0.7:
            for key in rng.sample(list(index), min(4, len(index))):
                index.touch(key)
        elif action < 0.8:
            for key in rng.sample(list(index), min(2, len(index))):
                policy.describe(key, Retention(key))
                index.put(key, 8 * MB, None)  # replaced (unhinted now)
        else:
            for key in rng.sample(list(index), min(3, len(index))):
                index.remove(key)
        if step % 10 == 0:
            check_policy(index, policy)
        assert index.used <= index.capacity
    check_policy(index, policy)
    assert set(policy._unit_of) == set(index)
    index.clear()
    assert index.ordered() == [] and not policy._units and not policy._waiting


def test_pages_put_deepest_first_still_make_one_chain() -> None:
    """The store path puts a step's pages deepest first: the state before the attention it
    needs. The state reaches up its chain as the attention arrives."""
    policy = ResumePointPolicy()
    index = LruIndex[None](100 * MB, policy)
    state = "r.s2"
    policy.describe(state, Retention(state, "r.a2", True))
    index.put(state, 5 * MB, None)
    for c in (2, 1, 0):
        unit = f"r.a{c}"
        policy.describe(unit, Retention(unit, f"r.a{c - 1}" if c else "", False))
        index.put(unit, 10 * MB, None)
    index.put("other", 10 * MB, None)
    assert index.ordered()[0] == state  # the resume point before the pages it needs
    for c in range(3):
        index.touch(f"r.a{c}")  # used after "other", yet useless once the state leaves
    index.remove(state)
    index.put("later", 1 * MB, None)
    assert set(index.ordered()[:3]) == {"r.a0", "r.a1", "r.a2"}  # they served only it


def test_a_state_of_several_pages_stored_over_held_attention_goes_first() -> None:
    """A state set is a page per group and shard: every one of them refreshes the chain after
    itself, so the state stays ahead of the attention it needs."""
    policy = ResumePointPolicy()
    index = LruIndex[None](100 * MB, policy)
    policy.describe("a0", Retention("A0"))
    index.put("a0", 10 * MB, None)
    for shard in ("s0.g0", "s0.g1"):
        policy.describe(shard, Retention("S0", "A0", True))
        index.put(shard, 5 * MB, None)
    assert index.ordered() == ["s0.g0", "s0.g1", "a0"]
    index.capacity = 15 * MB
    index.make_room(0)
    assert "a0" in index and "s0.g0" not in index  # not the attention, keeping a useless state


def test_a_state_put_while_its_attention_is_replaced_still_needs_it() -> None:
    policy = ResumePointPolicy()
    index = LruIndex[None](100 * MB, policy)
    policy.describe("a0", Retention("A0"))
    index.put("a0", 10 * MB, None)
    policy.describe("s0", Retention("S0", "A0", True))
    index.put("s0", 5 * MB, None)
    index.remove("a0")  # the first half of a replace
    policy.describe("s1", Retention("S1", "A0", True))
    index.put("s1", 5 * MB, None)
    policy.describe("a0", Retention("A0"))
    index.insert("a0", 10 * MB, None)
    index.remove("s0")
    assert index.ordered() == ["s1", "a0"]  # a0 still serves s1, after it


def test_replacing_a_page_when_room_must_be_made_evicts_the_least_recent_other() -> None:
    policy = ResumePointPolicy()
    index = LruIndex[None](40, policy)
    for key, hint in [("x", Retention("X")), ("a0", Retention("A0")), ("s0", Retention("S0", "A0", True)),
                      ("y", Retention("Y"))]:  # fmt: skip
        policy.describe(key, hint)
        index.put(key, 10, None)
    policy.describe("a0", Retention("A0"))
    assert [e.key for e in index.put("a0", 20, None) or []] == ["x"]
    policy.describe("s0", Retention("S0", "A0", True))
    assert [e.key for e in index.put("s0", 20, None) or []] == ["y"]
    assert set(index) == {"a0", "s0"} and index.ordered() == ["s0", "a0"]


def test_the_heap_stays_bounded_without_evictions() -> None:
    policy = ResumePointPolicy()
    index = LruIndex[None](1 << 40, policy)
    for i in range(100):
        index.put(f"k{i}", 1, None)
    for i in range(100_000):
        index.touch(f"k{i % 100}")
    assert len(policy._heap) <= 2 * 100 + 65


def test_a_victim_the_index_may_not_evict_is_skipped() -> None:
    policy = ResumePointPolicy()
    index = LruIndex[None](100, policy)
    for key in ("k0", "k1", "k2"):
        index.put(key, 10, None)
    assert index.evict(lambda e: e.key != "k0").key == "k1"  # k0 pinned (a lease)
    assert index.ordered() == ["k0", "k2"]


def test_the_scan_rule_applies_with_the_tiers_capacity() -> None:
    policy = ResumePointPolicy(lambda: 100)
    index = LruIndex[None](100, policy)
    index.put("old", 10, None)
    policy.describe("scan", Retention("SCAN", request_bytes=60))  # more than half the tier
    index.put("scan", 10, None)
    assert index.ordered() == ["scan", "old"]


def test_the_cpu_tier_orders_by_the_hints_it_is_given() -> None:
    from hybrid_offload.backends import BackendConfig
    from hybrid_offload.backends.cpu import CpuBackend

    a0, x, s0, y, z, w = (f"{'ab' * 8}-{i:016x}" for i in range(6))
    with CpuBackend(BackendConfig(type="cpu", name="cpu", capacity_bytes=3000)) as cpu:
        cpu.describe_batch([(a0, Retention("A0"))])
        cpu.put_batch([(a0, b"a" * 1000)])
        cpu.put_batch([(x, b"x" * 1000)])
        cpu.describe_batch([(s0, Retention("S0", "A0", True))])
        cpu.put_batch([(s0, b"s" * 1000)])  # refreshes the attention it needs after itself
        cpu.put_batch([(y, b"y" * 1000)])
        assert cpu.take_evicted() == [x]  # plain LRU evicts a0, leaving s0 useless
        cpu.put_batch([(z, b"z" * 1000)])
        assert cpu.take_evicted() == [s0]
        cpu.put_batch([(w, b"w" * 1000)])
        assert cpu.take_evicted() == [a0]  # it served only s0: before y, which is older
