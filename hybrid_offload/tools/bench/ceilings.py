"""Physical and library ceilings for `hybrid-offload bench backends`.

Every ceiling moves the same bytes as the backend it bounds, in calls of ``batch`` pages of
``page`` bytes, and is timed with :func:`time_calls` (so GB/s and per-call latency mean the same
thing everywhere): numpy copy (cpu), pwritev/preadv into one file, warm and cold (disk),
pipelined redis-py+hiredis SET/GET and ``redis-benchmark`` (redis), raw NIXL WRITE/READ into a
peer's pool (nixl_peer). The redis-server and cache peer they measure against are started by
:mod:`hybrid_offload.testing.services`.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hybrid_offload.tools.bench.common import percentile


def time_calls(calls: Sequence[Callable[[], object]], call_bytes: int) -> dict[str, float]:
    """Run each call once, in order (what it returns is dropped); GB/s over all calls and p50/p99
    ms per call."""
    times = []
    for call in calls:
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    total = sum(times)
    return {
        "gbps": call_bytes * len(calls) / total / 1e9 if total > 0 else float("nan"),
        "p50_ms": percentile(times, 50) * 1e3,
        "p99_ms": percentile(times, 99) * 1e3,
        "calls": len(calls),
    }


def slots(pool: int, batch: int, calls: int) -> list[range]:
    """Page index ranges of each call, cycling through ``pool`` pages (pool >= batch)."""
    out = []
    for c in range(calls):
        start = (c * batch) % pool
        if start + batch > pool:
            start = 0
        out.append(range(start, start + batch))
    return out


# -- ceilings ----------------------------------------------------------------------------------


def numpy_copy(page: int, batch: int, calls: int) -> dict[str, float]:
    """One ``np.copyto`` of batch*page bytes per call (cpu store and load ceiling); the
    destination is faulted in first (an untimed copy), as a reused buffer would be."""
    src = np.ones(page * batch, np.uint8)
    dst = np.zeros(page * batch, np.uint8)
    np.copyto(dst, src)
    return time_calls([lambda: np.copyto(dst, src)] * calls, page * batch)


def drop_cache(path: str) -> None:
    """Write back, then drop ``path`` from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_tree_cache(root: str) -> None:
    """Drop every regular file under ``root`` from the page cache (after a global sync)."""
    os.sync()
    for directory, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                drop_cache(os.path.join(directory, name))


def raw_file(directory: str, page: int, batch: int, calls: int, pool: int) -> dict[str, dict[str, float]]:
    """pwritev / preadv (warm and cold) of batch pages per call into one preallocated file."""
    path = os.path.join(directory, f"raw-{uuid.uuid4().hex}.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, page * pool)
        data = [memoryview(os.urandom(page))] * batch
        bufs = [memoryview(bytearray(page)) for _ in range(batch)]
        plan = slots(pool, batch, calls)

        def write(r: range) -> Callable[[], int]:
            return lambda: os.pwritev(fd, data, r.start * page)

        def read(r: range) -> Callable[[], int]:
            return lambda: os.preadv(fd, bufs, r.start * page)

        out = {"pwritev": time_calls([write(r) for r in plan], page * batch)}
        out["preadv_warm"] = time_calls([read(r) for r in plan], page * batch)
        drop_cache(path)
        one_pass = slots(pool, batch, max(1, pool // batch))
        out["preadv_cold"] = time_calls([read(r) for r in one_pass], page * batch)
        return out
    finally:
        os.close(fd)
        os.unlink(path)


def redis_py(port: int, page: int, batch: int, calls: int, pool: int) -> dict[str, dict[str, float]]:
    """Pipelined redis-py (hiredis) SET / GET of ``batch`` values per call."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    payload = os.urandom(page)
    keys = [f"raw:{i}" for i in range(pool)]
    plan = slots(pool, batch, calls)

    def pipe_call(r: range, op: str) -> Callable[[], None]:
        def call() -> None:
            pipe = client.pipeline(transaction=False)
            for i in r:
                pipe.set(keys[i], payload) if op == "set" else pipe.get(keys[i])
            pipe.execute()

        return call

    try:
        out = {"set": time_calls([pipe_call(r, "set") for r in plan], page * batch)}
        out["get"] = time_calls([pipe_call(r, "get") for r in plan], page * batch)
        client.delete(*keys)
        return out
    finally:
        client.close()


def flush_redis(port: int) -> None:
    """FLUSHDB on the bench's own server (between cells)."""
    import redis

    with redis.Redis(host="127.0.0.1", port=port) as client:
        client.flushdb()


def redis_benchmark(port: int, page: int, requests: int) -> dict[str, float]:
    """GB/s of ``redis-benchmark`` SET and GET with ``page``-byte values (4 clients, -P 8).

    No ``-r``: every request uses the one key ``key:__rand_int__``, so each GET hits a full value
    (with a random key space larger than the SETs, most GETs would miss and look fast).
    """
    binary = shutil.which("redis-benchmark")
    if binary is None:
        raise RuntimeError("redis-benchmark not found: run scripts/setup.sh (redis-tools)")
    cmd = [binary, "-h", "127.0.0.1", "-p", str(port), "-t", "set,get", "-d", str(page),
           "-n", str(requests), "-c", "4", "-P", "8", "--csv"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout
    rates = {row[0]: float(row[1]) for row in csv.reader(io.StringIO(out)) if row and row[0] != "test"}
    return {op.lower(): rps * page / 1e9 for op, rps in rates.items()}


class RawNixl:
    """This process's NIXL agent connected to one peer; READ/WRITE into the peer's pool.

    It overwrites the peer's pool bytes: run it after the backend's own measurements.
    """

    def __init__(self, address: str) -> None:
        from hybrid_offload.backends.nixl_peer.auth import raw_handshake
        from hybrid_offload.compat import nixl_agent

        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            hello = raw_handshake(sock, b"", "bench-raw").hello
        self.hello = hello
        self.agent = nixl_agent(f"bench-raw-{uuid.uuid4().hex}", progress_thread=False)
        self.agent.add_remote_agent(hello.metadata)

    def _xfer(self, op: str, local: np.ndarray, remote: np.ndarray) -> None:
        agent = self.agent
        descs = agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM")
        handle = agent.initialize_xfer(op, *descs, self.hello.agent_name)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        handle.release()
        if state != "DONE":
            raise RuntimeError(f"raw NIXL {op}: {state}")

    def measure(self, page: int, batch: int, calls: int, pool_bytes: int) -> dict[str, dict[str, float]]:
        """WRITE and READ of ``batch`` page descriptors per call (fresh descriptor lists each call)."""
        buf = np.ones(page * batch, np.uint8)
        reg = self.agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        plan = slots(max(batch, pool_bytes // page), batch, calls)
        base = self.hello.pool_base

        def call(op: str, r: range) -> Callable[[], None]:
            def run() -> None:
                local = np.array([(buf.ctypes.data + j * page, page, 0) for j in range(batch)], np.uint64)
                remote = np.array([(base + i * page, page, 0) for i in r], np.uint64)
                self._xfer(op, local, remote)

            return run

        try:
            out = {"write": time_calls([call("WRITE", r) for r in plan], page * batch)}
            out["read"] = time_calls([call("READ", r) for r in plan], page * batch)
            return out
        finally:
            self.agent.deregister_memory(reg)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.agent.remove_remote_agent(self.hello.agent_name)


def skipped(reason: str) -> dict[str, Any]:
    """A row value for a measurement that could not run here."""
    return {"gbps": None, "p50_ms": None, "p99_ms": None, "skipped": reason}
