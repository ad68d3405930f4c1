"""Consistent hashing of page keys onto nixl peers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest

from hybrid_offload.backends.nixl_peer.ring import HashRing

KEYS = [f"5eed{i % 7:04x}-{i * 2654435761 % (1 << 64):016x}" for i in range(20_000)]
NODES = [f"10.0.0.{i}:7000" for i in range(1, 6)]


def _owners(ring: HashRing) -> list[str]:
    return [ring.node_for(key) for key in KEYS]


def test_spread_is_roughly_even() -> None:
    counts = Counter(_owners(HashRing(NODES)))
    assert set(counts) == set(NODES)
    share = len(KEYS) / len(NODES)
    assert all(0.7 * share < n < 1.3 * share for n in counts.values()), counts


def test_node_leaving_moves_only_its_keys() -> None:
    before = _owners(HashRing(NODES))
    after = _owners(HashRing([n for n in NODES if n != NODES[2]]))
    for old, new in zip(before, after, strict=True):
        if old != NODES[2]:
            assert new == old
        else:
            assert new != NODES[2]


def test_node_joining_takes_only_its_share() -> None:
    before = _owners(HashRing(NODES))
    after = _owners(HashRing([*NODES, "10.0.0.9:7000"]))
    moved = [(old, new) for old, new in zip(before, after, strict=True) if old != new]
    assert all(new == "10.0.0.9:7000" for _, new in moved)
    assert 0.5 / 6 < len(moved) / len(KEYS) < 1.5 / 6


def test_order_of_nodes_does_not_matter() -> None:
    assert _owners(HashRing(NODES)) == _owners(HashRing(list(reversed(NODES))))


def test_group_keeps_input_order() -> None:
    ring = HashRing(NODES)
    groups = ring.group(KEYS[:500])
    assert sorted(i for idxs in groups.values() for i in idxs) == list(range(500))
    for n, idxs in groups.items():
        assert idxs == sorted(idxs)
        assert all(ring.index_for(KEYS[i]) == n for i in idxs)


def test_stable_across_processes() -> None:
    """No Python hash(): another interpreter (other PYTHONHASHSEED) places keys the same way."""
    code = (
        "import sys; from hybrid_offload.backends.nixl_peer.ring import HashRing; "
        "r = HashRing(sys.argv[1].split(',')); print(','.join(r.node_for(k) for k in sys.argv[2:]))"
    )
    keys = KEYS[:50]
    out = subprocess.run(
        [sys.executable, "-c", code, ",".join(NODES), *keys],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "12345"},
    )  # fmt: skip
    assert out.stdout.strip().split(",") == [HashRing(NODES).node_for(k) for k in keys]


@pytest.mark.parametrize(("nodes", "vnodes"), [([], 160), (["a", "a"], 160), (["a"], 0)])
def test_invalid_rings(nodes: list[str], vnodes: int) -> None:
    with pytest.raises(ValueError):
        HashRing(nodes, vnodes)
