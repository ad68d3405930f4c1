"""lmcache-backend behaviour beyond the shared contract: LMCache's known faults kept out.

Bounded close (LMCache's Redis connector close() never returns), one value per page on the
Redis side with torn or foreign values read as misses, the remote down or hung, options.
Skipped only when LMCache is not installed (``scripts/install_lmcache.sh`` installs it).
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "lmcache", reason="LMCache is not installed: run scripts/install_lmcache.sh (no CUDA deps)"
)
import redis

from hybrid_offload.backends import (
    BackendConfig,
    BackendConfigError,
    BackendUnavailableError,
    create_backend,
)
from hybrid_offload.backends.lmcache import LMCacheBackend
from hybrid_offload.testing.backend_pages import key, page
from hybrid_offload.testing.deadlines import FAILS_FAST_S, LONG_TIMEOUT_S, takes_less_than, within
from hybrid_offload.testing.services import RedisServer, free_port, start_redis_server

# LMCache's loggers attach opentelemetry's deprecated LoggingHandler: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")
CLOSE_TIMEOUT_S = 0.3
_namespaces = itertools.count()



def make(url: str, capacity: int = 1 << 24, **options: Any) -> LMCacheBackend:
    options = {
        "remote_url": url,
        "namespace": f"spec{os.getpid()}x{next(_namespaces)}",
        "close_timeout_s": CLOSE_TIMEOUT_S,
        **options,
    }
    backend = create_backend(BackendConfig("lmcache", "lmcache-test", capacity, options=options))
    assert isinstance(backend, LMCacheBackend)
    return backend


def redis_values(srv: RedisServer, namespace: str) -> dict[bytes, bytes]:
    client = redis.Redis.from_url(srv.url)
    try:
        return {k: client.get(k) for k in client.keys(f"{namespace}-*")}  # type: ignore[misc]
    finally:
        client.close()


# -- lifecycle -------------------------------------------------------------------------------


def test_close_bounded_with_server_killed(server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    backend = make(server.url)
    assert backend.put_batch([(key(i), page(i, 5000)) for i in range(8)]) == [True] * 8
    server.stop()
    caplog.set_level(logging.WARNING, logger="hybrid_offload.backends.lmcache")
    with takes_less_than(within(CLOSE_TIMEOUT_S), "close"):
        backend.close()
    assert "did not finish" in caplog.text  # LMCache's RedisConnector.close() hangs: logged
    backend._close_timeout = 3600.0  # idempotent, immediate: a second close waits for nothing
    second = threading.Thread(target=backend.close, daemon=True)
    second.start()
    second.join(60)  # only a second close that waits (for the hung I/O thread) gets this far
    assert not second.is_alive(), "a second close() waits"


def test_close_bounded_with_server_up(server: RedisServer) -> None:
    backend = make(server.url, close_timeout_s=0.5)
    backend.put_batch([(key(1), page(1, 100))])
    with takes_less_than(within(0.5), "close"):
        backend.close()


def test_fs_close_finishes_and_stops_its_thread(tmp_path: Path) -> None:
    backend = make(f"fs://localhost:0{tmp_path / 'store'}")
    backend.put_batch([(key(1), page(1, 100))])
    backend.close()
    assert not backend._thread.is_alive()  # the fs connector's close() returns


# -- one value per page, integrity -----------------------------------------------------------


def test_one_value_per_page_on_redis(server: RedisServer) -> None:
    backend = make(server.url)
    namespace = backend._namespace
    try:
        pages = {key(i): page(i, size) for i, size in enumerate([0, 1, 4096, 100_000])}
        assert backend.put_batch(list(pages.items())) == [True] * len(pages)
        values = redis_values(server, namespace)
        # LMCache writes two Redis keys per page: the value, and its 28-byte shape record.
        assert len(values) == 2 * len(pages)
        for k, data in pages.items():
            lm_key = backend._lm_key(k).to_string().encode()
            assert set(values) >= {lm_key + b"kv_bytes", lm_key + b"metadata"}
            value = values[lm_key + b"kv_bytes"]
            assert len(value) == 24 + len(data) and value.endswith(data)  # whole page, one value
            assert len(values[lm_key + b"metadata"]) == 28
            if len(data) >= 64:  # the page's bytes are in no other value
                others = [v for name, v in values.items() if name != lm_key + b"kv_bytes"]
                assert not any(data in v for v in others)
        assert backend.get_batch(list(pages)) == list(pages.values())
    finally:
        backend.close()


def _rewrite(srv: RedisServer, name: bytes, value: bytes) -> None:
    client = redis.Redis.from_url(srv.url)
    try:
        client.set(name, value)
    finally:
        client.close()


def test_torn_or_foreign_values_are_misses(server: RedisServer) -> None:
    backend = make(server.url)
    try:
        ks = [key(i) for i in range(6)]
        datas = [page(i, 3000) for i in range(6)]
        backend.put_batch(list(zip(ks, datas, strict=True)))
        names = [backend._lm_key(k).to_string().encode() for k in ks]
        values = redis_values(server, backend._namespace)
        # 0: value truncated (metadata still says the full length: LMCache's read fails)
        _rewrite(server, names[0] + b"kv_bytes", values[names[0] + b"kv_bytes"][:-10])
        # 1: value and metadata both truncated consistently (LMCache reads it fine)
        short = values[names[1] + b"kv_bytes"][:-10]
        meta = bytearray(values[names[1] + b"metadata"])
        struct.pack_into("=i", meta, 0, len(short))  # length
        struct.pack_into("=i", meta, 12, len(short))  # shape[0] of the 1-D uint8 value
        _rewrite(server, names[1] + b"kv_bytes", short)
        _rewrite(server, names[1] + b"metadata", bytes(meta))
        # 2: one flipped page byte
        flipped = bytearray(values[names[2] + b"kv_bytes"])
        flipped[100] ^= 0xFF
        _rewrite(server, names[2] + b"kv_bytes", bytes(flipped))
        # 3: another key's (valid) value and metadata copied under this key
        _rewrite(server, names[3] + b"kv_bytes", values[names[4] + b"kv_bytes"])
        _rewrite(server, names[3] + b"metadata", values[names[4] + b"metadata"])
        errors = backend.stats.errors
        assert backend.get_batch(ks) == [None, None, None, None, datas[4], datas[5]]
        assert backend.stats.errors == errors + 4
        assert sorted(backend.take_evicted()) == sorted(ks[:4])  # dropped from the index
        assert backend.contains_batch(ks) == [False] * 4 + [True] * 2
        assert backend.used_bytes() == 6000
    finally:
        backend.close()


def test_delete_and_evict_free_redis_values(server: RedisServer) -> None:
    backend = make(server.url, capacity=10_000)
    try:
        backend.put_batch([(key(i), page(i, 4000)) for i in range(2)])
        backend.put_batch([(key(2), page(2, 4000))])  # evicts key(0)
        assert backend.take_evicted() == [key(0)]
        assert backend.delete_batch([key(1)]) == 1
        values = redis_values(server, backend._namespace)
        for i in (0, 1):  # a 24-byte tombstone replaced the page
            assert len(values[backend._lm_key(key(i)).to_string().encode() + b"kv_bytes"]) == 24
        assert sum(len(v) for v in values.values()) < 4000 + 3 * (24 + 28) + 1
        assert backend.get_batch([key(0), key(1), key(2)]) == [None, None, page(2, 4000)]
    finally:
        backend.close()


def test_fs_delete_removes_the_file(tmp_path: Path) -> None:
    store = tmp_path / "store"
    backend = make(f"fs://localhost:0{store}")
    try:
        backend.put_batch([(key(1), page(1, 100)), (key(2), page(2, 100))])
        assert len(list(store.glob("*.data"))) == 2
        backend.delete_batch([key(1)])
        assert [p.name for p in store.glob("*.data")] == [backend._lm_key(key(2)).to_string() + ".data"]
    finally:
        backend.close()


def test_remote_lost_pages_are_misses_and_reported(server: RedisServer) -> None:
    backend = make(server.url)
    try:
        backend.put_batch([(key(1), page(1, 100)), (key(2), page(2, 100))])
        client = redis.Redis.from_url(server.url)
        client.delete(backend._lm_key(key(1)).to_string() + "kv_bytes")
        client.delete(backend._lm_key(key(2)).to_string() + "metadata")
        client.close()
        assert backend.get_batch([key(1), key(2)]) == [None, None]
        assert sorted(backend.take_evicted()) == sorted([key(1), key(2)])
        assert backend.used_bytes() == 0
    finally:
        backend.close()


# -- expiry: the remote does not grow across restarts (issue 14 L4) ----------------------------


def pttls(srv: RedisServer, names: list[bytes]) -> list[int]:
    client = redis.Redis.from_url(srv.url)
    try:
        return [client.pttl(name) for name in names]
    finally:
        client.close()


def test_redis_values_expire_ttl_s_after_their_last_put_or_get(server: RedisServer) -> None:
    """A new instance starts with an empty index and never reads an earlier one's values: they
    must expire, or every restart leaves its pages in Redis for good."""
    backend = make(server.url, ttl_s=100)
    try:
        assert backend.put_batch([(key(i), page(i, 3000)) for i in range(3)]) == [True] * 3
        names = [
            backend._lm_key(key(i)).to_string().encode() + suffix
            for i in range(3)
            for suffix in (b"kv_bytes", b"metadata")
        ]
        assert all(90_000 < ttl <= 100_000 for ttl in pttls(server, names))
        client = redis.Redis.from_url(server.url)
        client.pexpire(names[0], 5000)
        client.pexpire(names[1], 5000)
        client.close()
        assert backend.get_batch([key(0)]) == [page(0, 3000)]  # a hit: expires 100 s from now
        assert all(90_000 < ttl <= 100_000 for ttl in pttls(server, names[:2]))
        assert backend.delete_batch([key(1)]) == 1  # the tombstone expires too
        assert all(0 < ttl <= 100_000 for ttl in pttls(server, names[2:4]))
    finally:
        backend.close()
    default = make(server.url)  # default ttl_s: one day
    try:
        assert default.put_batch([(key(7), page(7, 100))]) == [True]
        name = default._lm_key(key(7)).to_string().encode() + b"kv_bytes"
        assert 86_000_000 < pttls(server, [name])[0] <= 86_400_000
    finally:
        default.close()


def test_fs_restart_sweeps_this_namespaces_values_older_than_ttl_s(tmp_path: Path) -> None:
    store = tmp_path / "store"
    url = f"fs://localhost:0{store}"
    first = make(url, ttl_s=3600)
    namespace = first._namespace
    try:
        assert first.put_batch([(key(i), page(i, 500)) for i in range(3)]) == [True] * 3
        files = {i: store / (first._lm_key(key(i)).to_string() + ".data") for i in range(3)}
        old = time.time() - 7200
        os.utime(files[2], (old, old))
        assert first.get_batch([key(2)]) == [page(2, 500)]  # a hit refreshes the file's mtime
        assert files[2].stat().st_mtime > time.time() - 60
    finally:
        first.close()
    for i in (0, 1):
        os.utime(files[i], (old, old))
    foreign = [
        store / f"{namespace}x-{'ab' * 8}@1@0@1{'cd' * 16}@uint8.data",  # another namespace
        store / f"{namespace}-notes.data",  # not a value's name
        store / "unrelated.txt",
    ]
    for path in foreign:
        path.write_bytes(b"x")
        os.utime(path, (old, old))
    second = make(url, ttl_s=3600, namespace=namespace)  # a restart: sweeps at start-up
    try:
        assert not files[0].exists() and not files[1].exists()
        assert files[2].exists()  # used within ttl_s
        assert all(path.exists() for path in foreign)
    finally:
        second.close()


# -- remote down ------------------------------------------------------------------------------


def test_construct_with_server_down_then_unavailable_then_recovers(tmp_path: Path) -> None:
    port = free_port()
    with takes_less_than(FAILS_FAST_S, "construction"):  # nothing listens: must not raise or hang
        backend = make(f"redis://127.0.0.1:{port}/0", op_timeout_s=LONG_TIMEOUT_S)
    try:
        with takes_less_than(FAILS_FAST_S, "a put"), pytest.raises(BackendUnavailableError):
            backend.put_batch([(key(1), page(1, 100))])
        assert backend.contains_batch([key(1)]) == [False]  # a failed put is not stored
        assert backend.used_bytes() == 0
        assert backend.stats.errors >= 1
        srv = RedisServer(port, tmp_path / "late")
        srv.start()
        try:
            assert backend.put_batch([(key(1), page(1, 100))]) == [True]
            assert backend.get_batch([key(1)]) == [page(1, 100)]
        finally:
            srv.stop()
    finally:
        backend.close()


def test_lm_server_down_construct_then_unavailable() -> None:
    """lm:// connects in LMCache's connector constructor: a refused connect is not raised."""
    with takes_less_than(FAILS_FAST_S, "construction"):
        backend = make(f"lm://127.0.0.1:{free_port()}", op_timeout_s=LONG_TIMEOUT_S)
    try:
        for _ in range(2):  # the second call is inside the reconnect pause
            with takes_less_than(FAILS_FAST_S, "a put"), pytest.raises(BackendUnavailableError):
                backend.put_batch([(key(1), page(1, 10))])
        assert backend.contains_batch([key(1)]) == [False]
    finally:
        backend.close()


def test_server_killed_calls_raise_unavailable_quickly(server: RedisServer) -> None:
    backend = make(server.url, op_timeout_s=LONG_TIMEOUT_S)
    try:
        backend.put_batch([(key(i), page(i, 1000)) for i in range(4)])
        server.stop()
        buf = memoryview(bytearray(1000))
        calls = [
            lambda: backend.get_batch([key(0), key(1)]),
            lambda: backend.get_into([key(0)], [buf]),
            lambda: backend.put_batch([(key(9), page(9, 10))]),
            lambda: backend.delete_batch([key(2)]),
        ]
        for call in calls:
            with takes_less_than(FAILS_FAST_S), pytest.raises(BackendUnavailableError):
                call()
        assert backend.contains_batch([key(9)]) == [False]
        server.start()  # same port, empty: stored pages are gone, later calls work
        assert backend.get_batch([key(0)]) == [None]
        assert backend.put_batch([(key(9), page(9, 10))]) == [True]
        assert backend.get_batch([key(9)]) == [page(9, 10)]
    finally:
        backend.close()


def test_hung_server_bounded_by_op_timeout(server: RedisServer) -> None:
    backend = make(server.url, op_timeout_s=0.5)
    try:
        backend.put_batch([(key(1), page(1, 100))])
        server.pause()
        try:
            with takes_less_than(within(0.5), "a get"), pytest.raises(BackendUnavailableError):
                backend.get_batch([key(1)])
        finally:
            server.resume()
    finally:
        with takes_less_than(within(2 * CLOSE_TIMEOUT_S), "close"):
            backend.close()


# -- options and import ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({}, "remote_url"),
        ({"remote_url": 6379}, "remote_url"),
        ({"remote_url": "127.0.0.1:6379"}, "remote_url"),
        ({"remote_url": "redis://127.0.0.1"}, "remote_url"),
        ({"remote_url": "redis://127.0.0.1:notaport"}, "remote_url"),
        ({"remote_url": "resp://127.0.0.1:6379"}, "remote_url"),
        ({"remote_url": "fs:///tmp/x"}, "remote_url"),
        ({"remote_url": "nosuchstore://h:1"}, "remote_url"),
        ({"remote_url": "redis://127.0.0.1:1", "namespace": "a@b"}, "namespace"),
        ({"remote_url": "redis://127.0.0.1:1", "op_timeout_s": 0}, "op_timeout_s"),
        ({"remote_url": "redis://127.0.0.1:1", "close_timeout_s": "1"}, "close_timeout_s"),
        ({"remote_url": "redis://127.0.0.1:1", "local_disk": "/tmp"}, "local_disk"),
        ({"remote_url": "redis://127.0.0.1:1", "ttl_s": 0}, "ttl_s"),
        ({"remote_url": "redis://127.0.0.1:1", "ttl_s": "1d"}, "ttl_s"),
    ],
)
def test_bad_options_name_the_key(options: dict[str, Any], named: str) -> None:
    with pytest.raises(BackendConfigError, match=named):
        create_backend(BackendConfig("lmcache", "bad", 1 << 20, options=options))


def test_redis_url_gets_socket_timeouts(server: RedisServer) -> None:
    backend = make(server.url, op_timeout_s=3)
    try:
        assert "socket_timeout=3" in backend._url and "socket_connect_timeout=3" in backend._url
    finally:
        backend.close()


_NO_LMCACHE = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "lmcache" or name.startswith("lmcache."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from hybrid_offload.backends import BackendConfig, create_backend
try:
    create_backend(BackendConfig("lmcache", "x", 1, options={"remote_url": "redis://h:1"}))
except ImportError as exc:
    print("CAUSE:", repr(exc.__cause__))
    print("MESSAGE:", exc)
"""


def test_missing_lmcache_raises_clear_import_error() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _NO_LMCACHE], capture_output=True, text=True, timeout=120, check=True
    )
    assert "backend type 'lmcache'" in result.stdout
    assert "scripts/install_lmcache.sh" in result.stdout
    assert "[lmcache]" in result.stdout
    assert "CAUSE: ImportError" in result.stdout  # chained, not swallowed


def test_the_remote_password_comes_from_a_file_and_is_never_shown(tmp_path: Path) -> None:
    """Issue 31 L2: a Redis remote with AUTH. A password in ``remote_url`` (user info or query)
    is refused naming the key without showing it; ``password_file`` / ``password_env`` work, and
    no error shows the password."""
    srv = start_redis_server(tmp_path / "redis", "--requirepass", "lm-s3cret")
    try:
        host_port = srv.url.removeprefix("redis://").split("/")[0]
        for url in (f"redis://:lm-s3cret@{host_port}", f"redis://{host_port}?password=lm-s3cret"):
            with pytest.raises(BackendConfigError, match="remote_url") as info:
                make(url)
            assert "lm-s3cret" not in str(info.value) and "password_file" in str(info.value)
        with pytest.raises(BackendConfigError, match="'password'"):
            make(f"redis://{host_port}", password="lm-s3cret")
        secret = tmp_path / "pw"
        secret.write_text("lm-s3cret\n")
        secret.chmod(0o600)
        backend = make(f"redis://{host_port}", password_file=str(secret))
        try:
            assert backend.put_batch([(key(1), b"behind AUTH")]) == [True]
            assert backend.get_batch([key(1)]) == [b"behind AUTH"]
            assert "lm-s3cret" not in repr(backend.__dict__.get("_url"))
        finally:
            backend.close()
        secret.write_text("wrong\n")
        backend = make(f"redis://{host_port}", password_file=str(secret))
        try:
            with pytest.raises(BackendUnavailableError) as failed:
                backend.put_batch([(key(2), b"x")])
            assert "wrong" not in str(failed.value) and "lm-s3cret" not in str(failed.value)
        finally:
            backend.close()
    finally:
        srv.stop()


_CONNECT_AND_LOG = """
import logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)  # our loggers and redis-py's too
from hybrid_offload.testing.backend_pages import key
from hybrid_offload.backends import BackendConfig, create_backend
url, cluster_url, sentinel_url, password_file = sys.argv[1:5]
password = open(password_file).read().strip()
options = {"password_file": password_file, "close_timeout_s": 0.3, "namespace": "n11"}
backend = create_backend(BackendConfig("lmcache", "n11", 1 << 20, options={"remote_url": url, **options}))
print("PUT", backend.put_batch([(key(1), b"behind AUTH")]))
print("GET", backend.get_batch([key(1)]))
print("TTL", 0 < backend._expiry._client.pttl(backend._lm_key(key(1)).to_string() + "kv_bytes"))
print("ERRORS", backend.stats.errors)
backend.close()
# cluster and sentinel remotes: built (never connected: nothing listens), the password an argument
for name, remote in (("CLUSTER", cluster_url), ("SENTINEL", sentinel_url)):
    config = BackendConfig("lmcache", name, 1 << 20, options={"remote_url": remote, **options})
    backend = create_backend(config)
    inner = backend._connector._connector
    client = inner.cluster if name == "CLUSTER" else inner.master.connection_pool
    print(name, "AUTH", client.connection_kwargs["password"] == password)
    backend.close()
"""


def test_lmcache_never_logs_the_remote_password(tmp_path: Path) -> None:
    """Issue 45 N11: LMCache logs the URL it is handed at INFO on every connect ("Creating
    connector for URL: redis://:<password>@..."), through its own loggers, which write to stderr
    past our redaction. Now the password never goes into a URL LMCache sees: every line a
    connect, put and get write (LMCache's at DEBUG, ours, redis-py's) is free of it, and AUTH
    (pages, and the expiry client's PEXPIRE) works. Cluster and sentinel remotes get it as an
    argument of their connector."""
    password = "n11-Pa55-w0rd-never-logged"
    srv = start_redis_server(tmp_path / "redis", "--requirepass", password)
    try:
        secret = tmp_path / "pw"
        secret.write_text(password + "\n")
        secret.chmod(0o600)
        host_port = srv.url.removeprefix("redis://").split("/")[0]
        cluster_url = f"redis-cluster://127.0.0.1:{free_port()}"
        sentinel_url = f"redis-sentinel://127.0.0.1:{free_port()}"
        env = {**os.environ, "LMCACHE_LOG_LEVEL": "DEBUG"}
        result = subprocess.run(
            [sys.executable, "-c", _CONNECT_AND_LOG,
             f"redis://{host_port}", cluster_url, sentinel_url, str(secret)],
            capture_output=True, text=True, timeout=120, check=False, env=env,
        )  # fmt: skip
        out = result.stdout + result.stderr
        assert result.returncode == 0, out[-4000:]
        assert "Creating Redis connector for URL" in out  # LMCache's own lines were captured
        assert password not in out
        assert "PUT [True]" in out and "GET [b'behind AUTH']" in out and "TTL True" in out, out[-4000:]
        assert "ERRORS 0" in out and "CLUSTER AUTH True" in out and "SENTINEL AUTH True" in out, out[-4000:]
    finally:
        srv.stop()
