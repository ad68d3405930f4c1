"""The redis-cluster backend: the shared contract on a real 3-node cluster, plus cluster layout.

One cluster per test module (per xdist worker); each backend gets a unique ``prefix``.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster
from redis.crc import key_slot

from hybrid_offload.backends import Backend, BackendConfig, BackendUnavailableError, create_backend
from hybrid_offload.backends.redis import RedisBackend, RedisClusterBackend
from hybrid_offload.testing.backend_contract import BackendContract
from hybrid_offload.testing.backend_pages import key, page
from hybrid_offload.testing.deadlines import takes_less_than, wait_until, within
from hybrid_offload.testing.services import RedisCluster, start_redis_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    process = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"), n=3)
    try:
        yield process
    finally:
        process.stop()


def unique_prefix() -> str:
    return f"c{uuid.uuid4().hex[:12]}"


def make_cluster_backend(
    cluster: RedisCluster, capacity: int = 64 << 20, **options: Any
) -> RedisClusterBackend:
    options = {"startup_nodes": cluster.startup_nodes, "prefix": unique_prefix(), **options}
    backend = create_backend(BackendConfig("redis-cluster", "cluster-test", capacity, options=options))
    assert isinstance(backend, RedisClusterBackend)
    return backend


def node_clients(cluster: RedisCluster) -> list[redis.Redis]:
    return [redis.Redis.from_url(node.url) for node in cluster.nodes]


class TestRedisClusterContract(BackendContract):
    @pytest.fixture(autouse=True)
    def _cluster(self, cluster: RedisCluster) -> None:
        self.cluster = cluster

    def make_backend(self, tmp_path: Path, capacity_bytes: int) -> Backend:
        return make_cluster_backend(self.cluster, capacity_bytes)

    def reopen(self, backend: Backend, tmp_path: Path) -> Backend | None:
        return create_backend(backend.config)


def test_pages_spread_over_all_nodes(cluster: RedisCluster) -> None:
    clients = node_clients(cluster)
    with make_cluster_backend(cluster) as backend:
        before = [client.dbsize() for client in clients]
        n = 90
        assert backend.put_batch([(key(i), page(i, 200)) for i in range(n)]) == [True] * n
        added = [client.dbsize() - b for client, b in zip(clients, before, strict=True)]
        # 90 pages over 3 nodes, plus the 4 index keys on one node
        assert sum(added) == n + 4
        assert all(count >= 15 for count in added), added
        assert backend.get_batch([key(i) for i in range(n)]) == [page(i, 200) for i in range(n)]
        slots = {key_slot(name.encode()) for name in backend._index.keys}
        assert len(slots) == 1, "the index keys share one hash slot"
        (slot,) = slots
        in_slot = [c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) for c in clients]
        assert sorted(in_slot) == [0, 0, 4], in_slot
    for client in clients:
        client.close()


def test_batch_get_is_one_pipeline_per_node(cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    clients = node_clients(cluster)
    with make_cluster_backend(cluster) as backend:
        n = 60
        backend.put_batch([(key(i), page(i, 300)) for i in range(n)])
        writes: Counter[str] = Counter()
        original = redis.cluster.NodeCommands.write

        def counting_write(self: Any) -> None:
            writes[f"{self.connection.host}:{self.connection.port}"] += 1
            original(self)

        monkeypatch.setattr(redis.cluster.NodeCommands, "write", counting_write)
        for client in clients:
            client.config_resetstat()
        assert backend.get_batch([key(i) for i in range(n)]) == [page(i, 300) for i in range(n)]
        monkeypatch.undo()

        gets, ranges = [], []
        for client in clients:
            stats = client.info("commandstats")
            gets.append(stats.get("cmdstat_get", {}).get("calls", 0))
            ranges.append(stats.get("cmdstat_getrange", {}).get("calls", 0))
        # pages are read with GETRANGE (bounded); commandstats also counts commands run inside
        # scripts: the refresh script's one GET of the used counter
        assert sum(ranges) == n and all(r > 0 for r in ranges), ranges
        assert sum(gets) == 1, gets
        # 3 nodes got one GETRANGE pipeline each; the index node also got the snapshot pipeline
        # (ZMSCORE + HMGET). The refresh script is a single command, not a pipeline.
        assert len(writes) == 3, writes
        assert sorted(writes.values()) == [1, 1, 2], writes
        # server side: each node read its GETs in very few socket reads, not one per GET
        reads = [client.info("stats")["total_reads_processed"] for client in clients]
        assert all(r <= 6 for r in reads), reads
    for client in clients:
        client.close()


def test_redis_type_with_cluster_url(cluster: RedisCluster) -> None:
    assert cluster.url.startswith("redis+cluster://")
    options = {"url": cluster.url, "prefix": unique_prefix()}
    backend = create_backend(BackendConfig("redis", "cluster-url", 1 << 20, options=options))
    assert type(backend) is RedisBackend
    with backend:
        n = 30
        assert backend.put_batch([(key(i), page(i, 100)) for i in range(n)]) == [True] * n
        assert backend.get_batch([key(i) for i in range(n)]) == [page(i, 100) for i in range(n)]
        assert backend.used_bytes() == 100 * n
        clients = node_clients(cluster)
        assert all(client.dbsize() > 0 for client in clients)
        for client in clients:
            client.close()
    # and the redis-cluster type accepts the same url form, without startup_nodes
    options = {"url": cluster.url, "prefix": unique_prefix()}
    with create_backend(BackendConfig("redis-cluster", "cluster-url2", 1 << 20, options=options)) as other:
        assert other.put_batch([(key(1), b"x" * 10)]) == [True]
        assert other.contains_batch([key(1), key(2)]) == [True, False]


def test_node_killed_then_restarted_same_instance_recovers(tmp_path: Path) -> None:
    process = start_redis_cluster(tmp_path / "own-cluster", n=3)
    try:
        backend = make_cluster_backend(process, socket_timeout_s=1.0, connect_timeout_s=0.5)
        keys = [key(i) for i in range(60)]
        assert backend.put_batch([(k, page(i, 300)) for i, k in enumerate(keys)]) == [True] * 60
        process.nodes[1].stop()
        calls = {
            "get": lambda: backend.get_batch(keys),
            "contains": lambda: backend.contains_batch(keys),
            "delete": lambda: backend.delete_batch(keys),
        }
        limit = within(1.0 + 0.5)  # a round trip: socket_timeout_s + connect_timeout_s
        for name, call in calls.items():  # every call touches the dead node's slots
            with takes_less_than(limit, name), pytest.raises(BackendUnavailableError, match="cluster-test"):
                call()
        assert backend.stats.errors == len(calls)
        process.nodes[1].start()  # same port and nodes.conf: it takes its slots back
        got = wait_until(lambda: backend.get_batch(keys), "the cluster client recovering",
                         ignore=(BackendUnavailableError,), poll_s=0.2)  # fmt: skip
        # the restarted node lost its pages (no persistence); the others kept theirs
        assert 0 < sum(data is not None for data in got) < len(keys)
        for i, data in enumerate(got):
            assert data is None or data == page(i, 300)
        # misses healed the index, or (if the index lived on the restarted node) hits re-adopted
        assert backend.used_bytes() == sum(300 for data in got if data is not None)
        backend.close()
    finally:
        process.stop()


def test_bounded_reads_orphan_expiry_and_index_rebuild(cluster: RedisCluster) -> None:
    """Issue 14 M3 on a cluster: a long value read into a small buffer is a miss and is not
    sent whole; pages carry an expiry until accounted; a dropped index key is rebuilt from a
    scan of every node, and the capacity holds again."""
    clients = node_clients(cluster)
    admin = redis.cluster.RedisCluster(
        startup_nodes=[redis.cluster.ClusterNode("127.0.0.1", n.port) for n in cluster.nodes]
    )
    with make_cluster_backend(cluster, capacity=1 << 20) as backend:
        prefix = backend.config.options["prefix"]
        big = f"{prefix}:p:{key(1000)}"
        admin.set(big, b"\0" * (16 << 20))
        backend.prepare_data_path()  # the client's start-up (CLUSTER SLOTS, COMMAND) first
        sent = [int(c.info("stats")["total_net_output_bytes"]) for c in clients]
        assert backend.get_into([key(1000)], [memoryview(bytearray(4096))]) == [None]
        after = [int(c.info("stats")["total_net_output_bytes"]) for c in clients]
        assert sum(after) - sum(sent) < 64 << 10
        assert admin.strlen(big) == 16 << 20
        admin.delete(big)

        assert backend.put_batch([(key(i), page(i, 100 << 10)) for i in range(10)]) == [True] * 10
        assert all(admin.pttl(f"{prefix}:p:{key(i)}") == -1 for i in range(10))
        admin.delete(backend._index.size)  # the server dropped an index key
        for i in range(10, 30):
            assert backend.put_batch([(key(i), page(i, 100 << 10))]) == [True]
        held = sum(admin.strlen(f"{prefix}:p:{key(i)}") for i in range(30))
        assert held <= 1 << 20
        assert backend.used_bytes() == held
        assert backend.get_batch([key(29)]) == [page(29, 100 << 10)]
        assert backend.stats.errors == 0
    admin.close()
    for client in clients:
        client.close()
