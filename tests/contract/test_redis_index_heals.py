"""The redis index's heals against a hostile writer of the server (issue 45 N13), on real
redis-server processes.

Any Redis user with write access can make the shared index look damaged before every script
(a junk ZADD into the LRU set, a DEL of ``used``); a heal costs O(pages) inside Redis, so it
runs at most once per ``HEAL_EVERY_S`` per server (a marker key with that expiry, the server's
clock). Work is measured in commands the server ran (``INFO commandstats`` counts the commands
a script calls), never in time; the marker's expiry is simulated by deleting it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from hybrid_offload.backends import BackendConfig, create_backend
from hybrid_offload.backends.redis import RedisBackend
from hybrid_offload.backends.redis import index as index_module
from hybrid_offload.testing.backend_pages import key, page
from hybrid_offload.testing.services import RedisServer

KiB = 1 << 10
#: pages stored before the hostile writer starts: a heal costs at least one command per page
PAGES = 3000
#: commands a put of one page may cost with the index looking damaged (a clean put: ~14)
BOUNDED = 40



@pytest.fixture
def admin(server: RedisServer) -> Iterator[redis.Redis]:
    """The hostile writer (and the test's view of the server)."""
    client = redis.Redis.from_url(server.url)
    try:
        yield client
    finally:
        client.close()


def make_redis(url: str, capacity: int, **options: Any) -> RedisBackend:
    options = {"url": url, "prefix": f"h{uuid.uuid4().hex[:12]}", **options}
    backend = create_backend(BackendConfig("redis", "redis-heal", capacity, options=options))
    assert isinstance(backend, RedisBackend)
    return backend


def counted(admin: redis.Redis, call: Any) -> dict[str, int]:
    """Run ``call()``; return the commands the server ran meanwhile, by name (scripts' too)."""
    admin.config_resetstat()
    call()
    stats = admin.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}
    for own in ("info", "config|resetstat"):
        calls.pop(own, None)
    return calls


def fill(backend: RedisBackend, n: int, size: int = 100) -> None:
    for start in range(0, n, 1000):
        batch = [(key(i), page(i, size)) for i in range(start, min(n, start + 1000))]
        assert backend.put_batch(batch) == [True] * len(batch)


def test_junk_zadds_cost_one_repair_per_heal_interval(server: RedisServer, admin: redis.Redis) -> None:
    """Before: a junk member in the LRU set made the next script repair the whole index (every
    size ZADDed back, every member HEXISTS-checked: 2 commands per page, 60k at 30k pages,
    0.4 -> 47 ms a put here), and one junk ZADD before each put made every put do it. Now the
    first put heals, the next ones do O(1) work until the heal marker expires."""
    with make_redis(server.url, capacity=64 << 20) as backend:
        fill(backend, PAGES)
        work = []
        for i in range(20):
            admin.zadd(backend._index.lru, {f"junk-{i}": i})  # the hostile writer, every time
            work.append(sum(counted(admin, lambda i=i: backend.put_batch([(key(PAGES + i), b"x")])).values()))
        assert work[0] > 2 * PAGES  # the first damage seen is healed at once
        assert max(work[1:]) <= BOUNDED, work

        healed = backend._index.healed
        assert 0 < admin.pttl(healed) <= index_module.HEAL_EVERY_S * 1000
        assert admin.zcard(backend._index.lru) == admin.hlen(backend._index.size) + 19  # junk waits
        admin.delete(healed)  # HEAL_EVERY_S later: the marker has expired
        assert sum(counted(admin, lambda: backend.put_batch([(key(9999), b"y")])).values()) > 2 * PAGES
        assert admin.zcard(backend._index.lru) == admin.hlen(backend._index.size)  # junk dropped
        assert backend.used_bytes() == 100 * PAGES + 20 + 1
        assert backend.stats.errors == 0


def test_a_deleted_used_counter_is_summed_once_per_heal_interval(
    server: RedisServer, admin: redis.Redis
) -> None:
    """A DEL of ``used`` before each put made every put sum the whole size hash (HVALS). Now the
    sum waits for the heal marker (meanwhile ``used`` counts as 0 and is not stored), then the
    count is exact again."""
    with make_redis(server.url, capacity=64 << 20) as backend:
        fill(backend, PAGES)
        admin.zadd(backend._index.lru, {"junk": 0})
        backend.put_batch([(key(PAGES), b"x")])  # a heal takes the marker
        for i in range(1, 11):
            admin.delete(backend._index.used)
            calls = counted(admin, lambda i=i: backend.put_batch([(key(PAGES + i), b"x")]))
            assert "hvals" not in calls and sum(calls.values()) <= BOUNDED, calls
        admin.delete(backend._index.healed)  # the marker has expired
        assert backend.used_bytes() == 100 * PAGES + 11
        assert backend.stats.errors == 0


def test_a_flood_of_junk_costs_bounded_work_per_eviction(server: RedisServer, admin: redis.Redis) -> None:
    """Junk members under every page's tick, while the heal marker is held: an eviction pops at
    most MAX_STRAYS_PER_EVICTION of them per put (before: all of them in one script, each DELed
    as a victim). Once the marker expires, a heal drops the rest and the capacity holds."""
    strays = index_module.MAX_STRAYS_PER_EVICTION
    capacity = 200 * KiB
    with make_redis(server.url, capacity=capacity) as backend:
        fill(backend, 200, size=KiB)  # full
        admin.zadd(backend._index.lru, {"junk": 0})
        assert backend.put_batch([(key(1000), page(1000, KiB))]) == [True]  # heals, takes the marker
        admin.zadd(backend._index.lru, {f"junk-{j}": 0 for j in range(20 * strays)})
        for i in range(1001, 1011):
            calls = counted(admin, lambda i=i: backend.put_batch([(key(i), page(i, KiB))]))
            assert calls["zpopmin"] <= strays + 1, calls  # (each: an HGET, a DEL of the victim)
            assert sum(calls.values()) <= 4 * strays + BOUNDED, calls
        admin.delete(backend._index.healed)  # the marker has expired
        assert backend.put_batch([(key(2000), page(2000, KiB))]) == [True]
        assert admin.zcard(backend._index.lru) == admin.hlen(backend._index.size)
        assert backend.used_bytes() <= capacity
        prefix = backend.config.options["prefix"]
        held = sum(admin.strlen(name) for name in admin.scan_iter(match=f"{prefix}:p:*", count=1000))
        assert held == backend.used_bytes()


@pytest.mark.parametrize("ttl", [None, 10**9], ids=["no-expiry", "long-expiry"])
def test_a_heal_marker_no_script_set_is_ignored(
    server: RedisServer, admin: redis.Redis, ttl: int | None
) -> None:
    """A writer cannot stop heals by setting the marker for good: one without an expiry, or
    with a longer one than HEAL_EVERY_S, is dropped and the damage is healed at once."""
    with make_redis(server.url, capacity=64 << 20) as backend:
        fill(backend, 100)
        admin.set(backend._index.healed, 1, px=ttl)
        admin.zadd(backend._index.lru, {"junk": 0})
        admin.delete(backend._index.used)
        backend.put_batch([(key(100), b"x")])
        assert admin.zcard(backend._index.lru) == admin.hlen(backend._index.size)
        assert backend.used_bytes() == 100 * 100 + 1
        assert 0 < admin.pttl(backend._index.healed) <= index_module.HEAL_EVERY_S * 1000
