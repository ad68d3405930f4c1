"""Redis-backend behaviour beyond the shared contract, against real redis-server processes:
expiry, server memory limits, authentication, TLS, a server killed / hung / restarted, bad
options, and clients in two processes sharing one capacity and LRU.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from hybrid_offload.backends import (
    BackendConfig,
    BackendConfigError,
    BackendUnavailableError,
    create_backend,
)
from hybrid_offload.backends.redis import RedisBackend
from hybrid_offload.testing.backend_pages import key, page
from hybrid_offload.testing.deadlines import takes_less_than, wait_until, within
from hybrid_offload.testing.services import RedisServer, free_port, start_redis_server

KiB = 1 << 10
MiB = 1 << 20


@pytest.fixture(scope="module")
def server(redis_server: RedisServer) -> RedisServer:
    """One plain server shared by the tests of this module (unique prefixes keep them apart)."""
    return redis_server


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Factory ``own_server(*extra_args)``: a server private to the test, always stopped."""
    started: list[RedisServer] = []

    def factory(*extra_args: str) -> RedisServer:
        started.append(start_redis_server(tmp_path / f"redis{len(started)}", *extra_args))
        return started[-1]

    try:
        yield factory
    finally:
        for item in started:
            item.stop()


def make_redis(url: str, capacity: int = 64 * MiB, **options: Any) -> RedisBackend:
    options = {"url": url, "prefix": f"s{uuid.uuid4().hex[:12]}", **options}
    backend = create_backend(BackendConfig("redis", "redis-test", capacity, options=options))
    assert isinstance(backend, RedisBackend)
    return backend


def all_calls(backend: RedisBackend) -> dict[str, Callable[[], object]]:
    buf = memoryview(bytearray(100))
    return {
        "put": lambda: backend.put_batch([(key(1), b"x" * 10)]),
        "get": lambda: backend.get_batch([key(1)]),
        "get_into": lambda: backend.get_into([key(1)], [buf]),
        "contains": lambda: backend.contains_batch([key(1)]),
        "delete": lambda: backend.delete_batch([key(1)]),
        "used_bytes": backend.used_bytes,
    }


# -- expiry and server memory limits -----------------------------------------------------------


def page_ttls_ms(client: redis.Redis, backend: RedisBackend, keys: list[str]) -> list[int]:
    """The server's PTTL of each page (-1: no expiry, -2: gone)."""
    prefix = backend.config.options["prefix"]
    return [client.pttl(f"{prefix}:p:{k}") for k in keys]  # type: ignore[misc]


def test_ttl_expiry_is_a_miss_and_heals_used_bytes(server: RedisServer) -> None:
    ttl_ms = 3_600_000
    client = redis.Redis.from_url(server.url)
    with client, make_redis(server.url, ttl_s=ttl_ms / 1000) as backend:
        pages = {key(i): page(i, 1000) for i in range(5)}
        assert backend.put_batch(list(pages.items())) == [True] * 5
        assert backend.get_batch(list(pages)) == list(pages.values())
        assert backend.used_bytes() == 5000
        assert all(0 < ttl <= ttl_ms for ttl in page_ttls_ms(client, backend, list(pages)))
        for k in pages:  # the server expires the pages now rather than in an hour
            client.pexpire(f"{backend.config.options['prefix']}:p:{k}", 1)
        wait_until(lambda: page_ttls_ms(client, backend, list(pages)) == [-2] * 5, "server-side expiry")
        assert backend.contains_batch(list(pages)) == [False] * 5
        assert backend.used_bytes() == 5000  # the index does not know yet
        assert backend.get_batch(list(pages)) == [None] * 5
        assert backend.used_bytes() == 0  # the misses healed it
        assert backend.put_batch([(key(1), page(1, 1000))]) == [True]  # re-put: new expiry
        assert 0 < page_ttls_ms(client, backend, [key(1)])[0] <= ttl_ms
        assert backend.get_batch([key(1)]) == [page(1, 1000)]


def put_through_small_server(backend: RedisBackend) -> dict[int, bytes]:
    """~12 MiB of 50 KiB pages, 4 per batch, through a 4 MiB server; every put succeeds."""
    rng = random.Random(3)
    latest: dict[int, bytes] = {}
    for step in range(60):
        ids = [rng.randrange(300) for _ in range(4)]
        items = [(i, page(step * 1000 + i, 50 * KiB)) for i in ids]
        assert backend.put_batch([(key(i), data) for i, data in items]) == [True] * len(ids)
        latest.update(items)
    return latest


def check_gets_heal(backend: RedisBackend, latest: dict[int, bytes]) -> None:
    got = backend.get_batch([key(i) for i in latest])
    for i, data in zip(latest, got, strict=True):
        assert data is None or data == latest[i]
    hits = [data for data in got if data is not None]
    assert 0 < len(hits) < len(latest)
    assert backend.used_bytes() == sum(map(len, hits))  # healed by the misses (and hits)
    assert backend.stats.errors == 0


def test_server_allkeys_lru_eviction_never_raises(own_server: Callable[..., RedisServer]) -> None:
    """Under allkeys-lru the server may evict the index keys too, at any write (Redis's LRU
    clock has one-second resolution, so pages and index look equally old): pages stay exact or
    missing and nothing raises, but the byte count is only as good as what the server kept —
    hence volatile-lru with ttl_s is the documented setting (next test: exact accounting)."""
    srv = own_server("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    with make_redis(srv.url, capacity=256 * MiB) as backend:
        latest = put_through_small_server(backend)
        got = backend.get_batch([key(i) for i in latest])
        for i, data in zip(latest, got, strict=True):
            assert data is None or data == latest[i]
        assert 0 < sum(data is not None for data in got) < len(latest)
        assert backend.used_bytes() >= 0
        assert backend.put_batch([(key(5000), page(5000, 10 * KiB))]) == [True]
        assert backend.get_batch([key(5000)]) == [page(5000, 10 * KiB)]
        assert backend.stats.errors == 0


def test_server_volatile_lru_with_ttl_keeps_the_index(own_server: Callable[..., RedisServer]) -> None:
    srv = own_server("--maxmemory", "4mb", "--maxmemory-policy", "volatile-lru")
    with make_redis(srv.url, capacity=256 * MiB, ttl_s=3600) as backend:
        latest = put_through_small_server(backend)
        # only pages carry a TTL, so the server evicted pages only: the index counts them all
        assert backend.used_bytes() == sum(map(len, latest.values())) > 4 * MiB
        check_gets_heal(backend, latest)


def test_server_full_noeviction_refuses_puts(own_server: Callable[..., RedisServer]) -> None:
    srv = own_server("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    with make_redis(srv.url, capacity=256 * MiB) as backend:
        answers: list[bool] = []
        stored: dict[str, bytes] = {}
        for i in range(80):  # 8 MiB into 3 MiB
            data = page(i, 100 * KiB)
            answers += backend.put_batch([(key(i), data)])
            if answers[-1]:
                stored[key(i)] = data
        assert True in answers and False in answers
        assert backend.stats.put_refused == answers.count(False)
        assert backend.stats.errors == 0
        assert backend.get_batch(list(stored)) == list(stored.values())
        assert backend.used_bytes() == sum(map(len, stored.values()))
        # deletes (and their accounting) still work while the server is full; then puts fit
        assert backend.delete_batch(list(stored)[:10]) == 10
        assert backend.used_bytes() == sum(map(len, list(stored.values())[10:]))
        assert backend.put_batch([(key(1000), page(1000, 100 * KiB))]) == [True]


# -- authentication and TLS --------------------------------------------------------------------


def secret_file(tmp_path: Path, value: str) -> str:
    path = tmp_path / f"pw-{uuid.uuid4().hex[:8]}"
    path.write_text(value + "\n")
    path.chmod(0o600)
    return str(path)


def test_password_from_file_or_env(
    own_server: Callable[..., RedisServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = own_server("--requirepass", "s3cret")
    with make_redis(srv.url, password_file=secret_file(tmp_path, "s3cret")) as backend:
        assert backend.put_batch([(key(1), b"abc")]) == [True]
        assert backend.get_batch([key(1)]) == [b"abc"]
        buf = bytearray(8)  # get_into reads on connections of its own: they authenticate too
        assert backend.get_into([key(1)], [memoryview(buf)]) == [3] and buf[:3] == b"abc"
    monkeypatch.setenv("HOP_TEST_REDIS_PW", "s3cret")
    with make_redis(srv.url, password_env="HOP_TEST_REDIS_PW") as backend:
        assert backend.put_batch([(key(2), b"def")]) == [True]
        assert "s3cret" not in repr(backend.config)
    # A wrong password is only seen on first use: BackendUnavailableError, with a clear message
    # that never shows the password.
    with make_redis(srv.url, password_file=secret_file(tmp_path, "wrong-pw")) as backend:
        with pytest.raises(BackendUnavailableError, match="authentication failed") as info:
            backend.get_batch([key(1)])
        assert "wrong-pw" not in str(info.value) and "password_file" in str(info.value)
        assert backend.stats.errors == 1
    with make_redis(srv.url) as backend, pytest.raises(BackendUnavailableError):
        backend.contains_batch([key(1)])  # no password at all


def test_password_in_url_or_literal_is_refused(tmp_path: Path) -> None:
    url = "redis://:hunter2@127.0.0.1:6379/0"
    with pytest.raises(BackendConfigError, match="'url'") as info:
        make_redis(url)
    text = str(info.value)
    assert "password_file" in text and "password_env" in text and "hunter2" not in text
    with pytest.raises(BackendConfigError, match="'url'") as info:
        make_redis("redis://alice:hunter2@127.0.0.1:6379/0")
    assert "hunter2" not in str(info.value)
    with pytest.raises(BackendConfigError, match="literal 'password'") as info:
        make_redis("redis://127.0.0.1:6379/0", password="hunter2")
    assert "hunter2" not in str(info.value)
    with pytest.raises(BackendConfigError, match="password_file"):
        make_redis("redis://127.0.0.1:6379/0", password_file=str(tmp_path / "missing"))
    with pytest.raises(BackendConfigError, match="password_env"):
        make_redis("redis://127.0.0.1:6379/0", password_env="HOP_TEST_SURELY_UNSET_VARIABLE")


def test_a_password_in_the_url_query_is_refused_and_never_shown(
    own_server: Callable[..., RedisServer],
) -> None:
    """Issue 31 L1: redis-py reads ``?password=`` from a url, so a password there is as visible
    as one in the netloc; refused naming 'url' without showing it, and query strings are
    redacted wherever a url is shown."""
    srv = own_server("--requirepass", "pw-in-query")
    for url in (f"{srv.url}?password=pw-in-query", f"{srv.url}?socket_timeout=5&Password=pw-in-query"):
        with pytest.raises(BackendConfigError, match=r"'url'.*credentials") as info:
            make_redis(url)
        assert "pw-in-query" not in str(info.value) and "password_file" in str(info.value)
    from hybrid_offload.backends.redis.options import redact_url

    assert "pw-in-query" not in redact_url(f"{srv.url}?password=pw-in-query")
    assert redact_url("redis://alice:pw@h:1/0?x=1") == "redis://alice:***@h:1/0?***"


def test_acl_user_in_url_password_from_file(own_server: Callable[..., RedisServer], tmp_path: Path) -> None:
    srv = own_server("--user", "default", "off", "--user", "alice", "on", ">pw1", "~*", "+@all")
    alice = srv.url.replace("redis://", "redis://alice@")
    with make_redis(alice, password_file=secret_file(tmp_path, "pw1")) as backend:
        assert backend.put_batch([(key(1), b"abc")]) == [True]
        assert backend.get_batch([key(1)]) == [b"abc"]
        buf = bytearray(8)
        assert backend.get_into([key(1)], [memoryview(buf)]) == [3] and buf[:3] == b"abc"
        assert backend.used_bytes() == 3
    with make_redis(alice, password_file=secret_file(tmp_path, "nope")) as backend:
        with pytest.raises(BackendUnavailableError, match=r"authentication failed.*") as info:
            backend.put_batch([(key(1), b"abc")])
        assert "alice@" in str(info.value) and "nope" not in str(info.value)


def make_tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server cert for 127.0.0.1 signed by it (openssl)."""
    ca_key, ca_crt = directory / "ca.key", directory / "ca.crt"
    srv_key, srv_csr, srv_crt = directory / "srv.key", directory / "srv.csr", directory / "srv.crt"
    ext = directory / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    commands = [
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=hop-test-ca", "-keyout", ca_key, "-out", ca_crt],
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-keyout", srv_key, "-out", srv_csr],
        ["openssl", "x509", "-req", "-in", srv_csr, "-CA", ca_crt, "-CAkey", ca_key,
         "-CAcreateserial", "-days", "2", "-extfile", ext, "-out", srv_crt],
    ]  # fmt: skip
    for command in commands:
        subprocess.run([str(c) for c in command], check=True, capture_output=True, timeout=60)
    return ca_crt, srv_crt, srv_key


def test_tls_rediss_url(own_server: Callable[..., RedisServer], tmp_path: Path) -> None:
    # Checked first: the apt redis-server 7.0.15 is built with TLS (it links libssl and
    # accepts --tls-port), so this test does not skip.
    ca, crt, tls_key = make_tls_files(tmp_path)
    tls_port = free_port()
    args = ["--tls-port", str(tls_port), "--tls-cert-file", str(crt), "--tls-key-file", str(tls_key)]
    srv = own_server(*args, "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no")
    url = f"rediss://127.0.0.1:{tls_port}/0"
    with make_redis(url, ssl_ca_certs=str(ca)) as backend:
        assert backend.put_batch([(key(1), page(1, 100_000))]) == [True]
        assert backend.get_batch([key(1)]) == [page(1, 100_000)]
    plain = redis.Redis.from_url(srv.url)
    assert plain.dbsize() > 0  # the pages went to this server, through TLS
    plain.close()
    # without ssl_ca_certs: the system CAs do not trust our self-signed CA
    with make_redis(url) as backend, pytest.raises(BackendUnavailableError):
        backend.get_batch([key(1)])


# -- failures: server down, killed, hung, restarted ---------------------------------------------


def test_construct_with_server_down_does_not_connect() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    for type_name, options in [("redis", {"url": url}), ("redis-cluster", {"url": url})]:
        config = BackendConfig(type_name, "down", MiB, options={**options, "prefix": "down"})
        backend = create_backend(config)  # must neither connect nor raise
        with pytest.raises(BackendUnavailableError, match="connect"):
            backend.prepare_data_path()  # the worker's start-up probe: a warning there
        limit = within(2.0 + 1.0)  # a round trip: the default socket_timeout_s + connect_timeout_s
        with takes_less_than(limit), pytest.raises(BackendUnavailableError, match=r"127\.0\.0\.1") as info:
            backend.get_batch([key(1)])
        assert isinstance(info.value.__cause__, Exception)  # chained to redis-py's error
        assert backend.stats.errors == 2
        backend.close()


def test_server_killed_then_restarted_same_instance_recovers(
    own_server: Callable[..., RedisServer],
) -> None:
    srv = own_server()
    with make_redis(srv.url, socket_timeout_s=1.0, connect_timeout_s=0.5) as backend:
        assert backend.put_batch([(key(1), page(1, 1000))]) == [True]
        srv.stop()
        limit = within(1.0 + 0.5)  # a round trip: socket_timeout_s + connect_timeout_s
        for name, call in all_calls(backend).items():
            with takes_less_than(limit, name), pytest.raises(BackendUnavailableError, match="redis-test"):
                call()
        assert backend.stats.errors == len(all_calls(backend))
        srv.start()  # same port; no persistence, so the pages are gone
        assert backend.get_batch([key(1)]) == [None]
        assert backend.put_batch([(key(2), page(2, 500))]) == [True]
        assert backend.get_batch([key(2)]) == [page(2, 500)]
        assert backend.used_bytes() == 500
        buf = bytearray(1000)
        assert backend.get_into([key(2)], [memoryview(buf)]) == [500]  # keeps a raw connection
        # a restart between two calls: the pooled connections are stale, redis-py reconnects
        srv.restart()
        assert backend.contains_batch([key(2)]) == [False]
        assert backend.put_batch([(key(3), b"abc")]) == [True]
        assert backend.used_bytes() == 3
        # and so does the raw reader of get_into: the restart is not an outage
        assert backend.get_into([key(3), key(2)], [memoryview(buf), memoryview(bytearray(8))]) == [3, None]
        assert bytes(buf[:3]) == b"abc"
        assert backend.stats.errors == len(all_calls(backend))


def test_hung_server_times_out(own_server: Callable[..., RedisServer]) -> None:
    srv = own_server()
    with make_redis(srv.url, socket_timeout_s=0.5, connect_timeout_s=0.5) as backend:
        assert backend.put_batch([(key(1), b"abc")]) == [True]
        srv.pause()
        try:
            limit = within(0.5 + 0.5)  # a round trip: socket_timeout_s + connect_timeout_s
            for call in (lambda: backend.get_batch([key(1)]), backend.used_bytes):
                with takes_less_than(limit), pytest.raises(BackendUnavailableError, match="Timeout"):
                    call()
        finally:
            srv.resume()
        assert backend.get_batch([key(1)]) == [b"abc"]


def test_scripts_reloaded_after_script_flush(server: RedisServer) -> None:
    with make_redis(server.url, capacity=3000) as backend:
        backend.put_batch([(key(i), page(i, 1000)) for i in range(3)])
        admin = redis.Redis.from_url(server.url)
        admin.script_flush()
        assert backend.put_batch([(key(3), page(3, 1000))]) == [True]  # NOSCRIPT -> EVAL
        assert backend.contains_batch([key(0), key(3)]) == [False, True]
        admin.close()


def test_index_heals_when_the_server_drops_index_keys(server: RedisServer) -> None:
    with make_redis(server.url, capacity=10_000) as backend:
        backend.put_batch([(key(i), page(i, 1000)) for i in range(4)])
        admin = redis.Redis.from_url(server.url)
        admin.delete(backend._index.used, backend._index.tick)
        assert backend.put_batch([(key(4), page(4, 1000))]) == [True]  # used rebuilt from sizes
        assert backend.used_bytes() == 5000
        backend.get_batch([key(0)])  # k0 refreshed with a tick above the others
        backend.put_batch([(key(9), page(9, 9000))])  # evicts k1..k4 (the LRU), not k0
        assert backend.contains_batch([key(0), key(1), key(4), key(9)]) == [True, False, False, True]
        admin.close()


def page_bytes_held(admin: redis.Redis, prefix: str) -> int:
    """Bytes of every page of ``prefix`` stored in the server now (indexed or not)."""
    return sum(admin.strlen(name) for name in admin.scan_iter(match=f"{prefix}:p:*", count=1000))


@pytest.mark.parametrize("dropped", ["size", "lru"])
def test_an_index_mismatch_rebuilds_the_index_from_a_scan(server: RedisServer, dropped: str) -> None:
    """The server drops one index key (an allkeys-* maxmemory policy): the index is rebuilt from
    the pages still stored, and the capacity holds again (before: the whole index was dropped,
    and the forgotten pages were never evicted: 2 MiB held against a 1 MiB capacity)."""
    with make_redis(server.url, capacity=MiB) as backend:
        prefix = backend.config.options["prefix"]
        admin = redis.Redis.from_url(server.url)
        assert backend.put_batch([(key(i), page(i, 100 * KiB)) for i in range(10)]) == [True] * 10
        admin.delete(getattr(backend._index, dropped))
        for i in range(10, 30):
            assert backend.put_batch([(key(i), page(i, 100 * KiB))]) == [True]
        held = page_bytes_held(admin, prefix)
        assert held <= MiB
        assert backend.used_bytes() == held
        assert backend.get_batch([key(29)]) == [page(29, 100 * KiB)]
        assert backend.stats.errors == 0
        admin.close()


def test_a_writer_raising_the_rebuild_flag_costs_one_scan_a_minute(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 31 L4: any writer of the server can raise the index's rebuild flag before every put;
    each put then rebuilt the index from a scan of every page (0.3 -> 210 ms a put at 50k
    pages). Now a process rebuilds at most once per REBUILD_EVERY_S (injected clock); the flag
    waits for the first put after that."""
    from hybrid_offload.backends.redis.backend import REBUILD_EVERY_S

    with make_redis(server.url, capacity=MiB) as backend:
        now = [1000.0]
        backend.clock = lambda: now[0]
        admin = redis.Redis.from_url(server.url)
        assert backend.put_batch([(key(i), page(i, KiB)) for i in range(200)]) == [True] * 200
        admin.delete(backend._index.size)  # a real mismatch first: rebuilt at the next put

        def puts(first: int, n: int) -> int:
            caplog.clear()
            with caplog.at_level("WARNING", logger="hybrid_offload.backends.redis"):
                for i in range(first, first + n):
                    admin.set(backend._index.rebuild_flag, 1)  # the hostile writer, every time
                    assert backend.put_batch([(key(i), page(i, KiB))]) == [True]
            return caplog.text.count("rebuilt it from a scan")

        assert puts(1000, 20) == 1
        now[0] += REBUILD_EVERY_S / 2
        assert puts(2000, 20) == 0
        now[0] += REBUILD_EVERY_S
        assert puts(3000, 20) == 1
        assert backend.used_bytes() == page_bytes_held(admin, backend.config.options["prefix"])
        admin.close()


_DIES_BEFORE_ACCOUNTING = """
import os, sys
from hybrid_offload.testing.backend_pages import key, page
from hybrid_offload.backends import BackendConfig, create_backend
options = {"url": sys.argv[1], "prefix": sys.argv[2]}
backend = create_backend(BackendConfig("redis", "child", 1 << 20, options=options))
backend._index.account = lambda *args: os._exit(17)  # dies between SET and accounting
backend.put_batch([(key(1), page(1, 1000))])
"""


def test_a_page_whose_accounting_never_ran_expires(server: RedisServer) -> None:
    """A client that dies between SET and accounting leaves a page no index knows: it carries
    an expiry (``orphan_ttl_s``) until its put is accounted, so it cannot stay forever."""
    with make_redis(server.url, capacity=MiB) as backend:
        prefix = backend.config.options["prefix"]
        child = subprocess.run(
            [sys.executable, "-c", _DIES_BEFORE_ACCOUNTING, server.url, prefix],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert child.returncode == 17, child.stderr
        admin = redis.Redis.from_url(server.url)
        orphan = f"{prefix}:p:{key(1)}"
        assert admin.exists(orphan) and backend.used_bytes() == 0
        assert 0 < admin.pttl(orphan) <= 60_000
        # a put that completes leaves its pages without expiry (no ttl_s) ...
        assert backend.put_batch([(key(2), page(2, 1000))]) == [True]
        assert admin.pttl(f"{prefix}:p:{key(2)}") == -1
        # ... and re-putting the orphan's key accounts it and removes the expiry
        assert backend.put_batch([(key(1), page(1, 1000))]) == [True]
        assert admin.pttl(orphan) == -1 and backend.used_bytes() == 2000
    with make_redis(server.url, capacity=MiB, ttl_s=3600) as backend:
        assert backend.put_batch([(key(3), page(3, 1000))]) == [True]
        name = f"{backend.config.options['prefix']}:p:{key(3)}"
        assert 3_590_000 < admin.pttl(name) <= 3_600_000  # ttl_s, not orphan_ttl_s
    admin.close()


def server_sent_bytes(admin: redis.Redis) -> int:
    return int(admin.info("stats")["total_net_output_bytes"])


def test_a_value_longer_than_the_buffer_is_a_miss_never_read_whole(server: RedisServer) -> None:
    """A 32 MiB value under a page key (garbage, or another writer's) read into a 4 KiB buffer
    is a miss, and the server sends at most the buffer (before: the whole value, into the
    worker's memory). It is left alone: not ours to delete, not adopted into the index."""
    with make_redis(server.url, capacity=MiB) as backend:
        prefix = backend.config.options["prefix"]
        admin = redis.Redis.from_url(server.url)
        big = f"{prefix}:p:{key(1)}"
        admin.set(big, b"\0" * (32 * MiB))
        assert backend.put_batch([(key(2), page(2, 1000))]) == [True]
        bufs = [bytearray(4 * KiB), bytearray(4 * KiB)]
        before = server_sent_bytes(admin)
        assert backend.get_into([key(1), key(2)], [memoryview(b) for b in bufs]) == [None, 1000]
        assert server_sent_bytes(admin) - before < 64 * KiB
        assert bytes(bufs[1][:1000]) == page(2, 1000)
        # get_batch: a value larger than the capacity is no page a put stored: a miss too
        before = server_sent_bytes(admin)
        assert backend.get_batch([key(1), key(2)]) == [None, page(2, 1000)]
        assert server_sent_bytes(admin) - before < MiB + 64 * KiB
        assert admin.strlen(big) == 32 * MiB
        assert backend.used_bytes() == 1000
        assert backend.stats.hits == 2 and backend.stats.errors == 0
        assert backend.put_batch([(key(3), b"")]) == [True]  # empty: GETRANGE reads it as ""
        assert backend.get_batch([key(3), key(4)]) == [b"", None]
        assert backend.get_into([key(3), key(4)], [memoryview(b) for b in bufs]) == [0, None]
        admin.close()


def test_get_into_an_error_reply_is_unavailable_and_the_next_read_is_clean(server: RedisServer) -> None:
    """A value of the wrong type under a page key makes the server answer an error mid-pipeline:
    the read raises (as any server error), and the next one is not confused by what was left of
    the stream (the connection that saw the error is closed)."""
    with make_redis(server.url) as backend:
        prefix = backend.config.options["prefix"]
        admin = redis.Redis.from_url(server.url)
        admin.rpush(f"{prefix}:p:{key(1)}", b"not a page")
        pages = [page(2, 70_000), page(3, 5)]
        assert backend.put_batch([(key(2), pages[0]), (key(3), pages[1])]) == [True, True]
        bufs = [bytearray(80_000) for _ in range(3)]
        with pytest.raises(BackendUnavailableError, match="WRONGTYPE"):
            backend.get_into([key(2), key(1), key(3)], [memoryview(b) for b in bufs])
        for _ in range(3):
            got = backend.get_into([key(3), key(2), key(4)], [memoryview(b) for b in bufs])
            assert got == [5, 70_000, None]
            assert bytes(bufs[0][:5]) == pages[1] and bytes(bufs[1][:70_000]) == pages[0]
        admin.close()


# -- options -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "bad_key"),
    [
        ({"url": "http://127.0.0.1:6379"}, "url"),
        ({"url": "redis://"}, "url"),
        ({"url": "redis://127.0.0.1:99999"}, "url"),
        ({"url": "redis://127.0.0.1/x"}, "url"),
        ({"url": "redis+cluster://127.0.0.1:7000/3"}, "url"),
        ({"url": 5}, "url"),
        ({"prefix": "a{b}"}, "prefix"),
        ({"prefix": ""}, "prefix"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"ttl_s": "10"}, "ttl_s"),
        ({"socket_timeout_s": -1}, "socket_timeout_s"),
        ({"connect_timeout_s": True}, "connect_timeout_s"),
        ({"max_connections": 0}, "max_connections"),
        ({"max_batch_bytes": 1.5}, "max_batch_bytes"),
        ({"orphan_ttl_s": 0}, "orphan_ttl_s"),
        ({"password_file": ""}, "password_file"),
        ({"password_env": 3}, "password_env"),
        ({"ssl_ca_certs": "/no/such/ca.pem"}, "ssl_ca_certs"),
        ({"startup_nodes": ["127.0.0.1:7000"]}, "startup_nodes"),  # unknown for type redis
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_options_name_the_key(options: dict[str, Any], bad_key: str) -> None:
    with pytest.raises(BackendConfigError, match=bad_key):
        create_backend(BackendConfig("redis", "bad", MiB, options=options))


@pytest.mark.parametrize(
    ("options", "bad_key"),
    [
        ({}, "url"),
        ({"startup_nodes": []}, "startup_nodes"),
        ({"startup_nodes": ["nohost"]}, "startup_nodes"),
        ({"startup_nodes": "127.0.0.1:7000"}, "startup_nodes"),
    ],
)
def test_bad_cluster_options_name_the_key(options: dict[str, Any], bad_key: str) -> None:
    with pytest.raises(BackendConfigError, match=bad_key):
        create_backend(BackendConfig("redis-cluster", "bad", MiB, options=options))


# -- batching and sharing ----------------------------------------------------------------------


def test_pipelines_carry_at_most_max_batch_bytes(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with make_redis(server.url, max_batch_bytes=250 * KiB) as backend:
        chunks: list[int] = []
        original = RedisBackend._put_chunk

        def counting(self: RedisBackend, client: Any, batch: list[Any], results: list[bool]) -> int:
            chunks.append(sum(view.nbytes for _, _, view in batch))
            return original(self, client, batch, results)

        monkeypatch.setattr(RedisBackend, "_put_chunk", counting)
        pages = [(key(i), page(i, 100 * KiB)) for i in range(10)]
        assert backend.put_batch(pages) == [True] * 10
        assert chunks == [200 * KiB] * 5
        pipelines: list[int] = []
        original_pipeline = RedisBackend._pipeline

        def counting_pipeline(self: RedisBackend, client: Any, commands: Any, **kw: Any) -> Any:
            pipelines.append(len(commands))
            return original_pipeline(self, client, commands, **kw)

        monkeypatch.setattr(RedisBackend, "_pipeline", counting_pipeline)
        assert backend.get_batch([k for k, _ in pages]) == [data for _, data in pages]
        assert pipelines == [2] * 5  # the GETs, split by the sizes the index knows


_CHILD = """
import sys
from hybrid_offload.testing.backend_pages import key, page
from hybrid_offload.backends import BackendConfig, create_backend
url, prefix, command = sys.argv[1], sys.argv[2], sys.argv[3]
options = {"url": url, "prefix": prefix}
with create_backend(BackendConfig("redis", "child", 4000, options=options)) as backend:
    if command == "put3-get0":
        assert backend.put_batch([(key(3), page(3, 1000))]) == [True]
        assert backend.get_batch([key(0)]) == [page(0, 1000)]
    print(backend.used_bytes())
"""


def test_two_processes_share_capacity_and_lru(server: RedisServer) -> None:
    with make_redis(server.url, capacity=4000) as backend:
        prefix = backend.config.options["prefix"]
        backend.put_batch([(key(i), page(i, 1000)) for i in range(3)])
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, server.url, prefix, "put3-get0"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert child.returncode == 0, child.stderr
        assert int(child.stdout.split()[-1]) == 4000  # the child saw our 3 pages + its own
        assert backend.used_bytes() == 4000
        # the child's get refreshed k0 and its put made k3 recent: k1 is the shared LRU
        assert backend.put_batch([(key(4), page(4, 1000))]) == [True]
        assert backend.contains_batch([key(i) for i in range(5)]) == [True, False, True, True, True]
        assert backend.get_batch([key(3)]) == [page(3, 1000)]  # the child's page, read here
        # two instances in this process share it the same way
        with make_redis(server.url, capacity=4000, prefix=prefix) as other:
            assert other.used_bytes() == 4000
            other.put_batch([(key(5), page(5, 1000))])  # evicts k2, now the LRU
            assert backend.contains_batch([key(2), key(5)]) == [False, True]
            assert other.stats.evictions == 1 and backend.stats.evictions == 1


# -- listing -----------------------------------------------------------------------------------


def test_scan_lists_orphans_skips_foreign_keys_and_keeps_idle_times(server: RedisServer) -> None:
    backend = make_redis(server.url)
    prefix = backend.config.options["prefix"]
    client = redis.Redis.from_url(server.url)
    try:
        backend.put_batch([(key(1), page(1, 700))])
        client.set(f"{prefix}:p:{key(2)}", page(2, 300))  # an orphan: not in the index
        client.set(f"{prefix}:p:not-a-page", b"x")  # matches the pattern, not a page key
        client.set(f"{prefix}x:p:{key(3)}", b"y")  # another prefix
        name = f"{prefix}:p:{key(1)}"  # an hour idle, as far as the server's LRU clock knows
        client.restore(name, 0, client.dump(name), replace=True, idletime=3600)  # type: ignore[arg-type]
        listed = {info.key: info for info in backend.scan()}
        assert {k: info.size for k, info in listed.items()} == {key(1): 700, key(2): 300}
        again = {info.key: info for info in backend.scan()}
        idle = time.time() - again[key(1)].mtime  # type: ignore[operator]
        assert idle >= 3599, "a scan must not reset the server's idle time of a page"
        assert client.object("idletime", name) >= 3600
    finally:
        backend.close()
        client.close()
