"""Quick throughput check of the redis backend vs redis-benchmark on the same server.

Starts one loopback ``redis-server`` (no persistence), then measures, for pages of
``--page-kib`` KiB:

* ``redis-benchmark`` SET and GET with values of the same size (``-P`` pipelining, 4 clients):
  what the server and loopback can do with a C client;
* plain redis-py (hiredis) pipelined SET / GET in batches of ``--batch`` (the library's ceiling);
* the redis backend's ``put_batch`` and ``get_into`` in calls of ``--batch`` pages (one
  process, one thread: what one connector I/O thread gets).

Usage: ``.venv/bin/python benchmarks/quick_redis.py [--pages 512] [--page-kib 256] [--batch 32]``.
Prints one JSON object. Figures are noisy on a shared 2-core machine: compare ratios from one run.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from hybrid_offload.backends import BackendConfig, create_backend
from hybrid_offload.testing.services import start_redis_server


def redis_benchmark(port: int, value_bytes: int, requests: int) -> dict[str, float]:
    """GB/s of redis-benchmark SET and GET with ``value_bytes`` values."""
    cmd = [shutil.which("redis-benchmark") or "redis-benchmark", "-h", "127.0.0.1", "-p", str(port),
           "-t", "set,get", "-d", str(value_bytes), "-n", str(requests), "-c", "4", "-P", "8",
           "-r", "1000", "--csv"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout
    rates = {row[0]: float(row[1]) for row in csv.reader(io.StringIO(out)) if row and row[0] != "test"}
    return {f"redis_benchmark_{op.lower()}_gbps": rps * value_bytes / 1e9 for op, rps in rates.items()}


def redis_py_rates(url: str, pages: int, page_bytes: int, batch: int) -> dict[str, float]:
    """GB/s of plain redis-py (+hiredis) pipelined SET / GET: the client library's ceiling."""
    import redis

    client = redis.Redis.from_url(url)
    payload = os.urandom(page_bytes)
    keys = [f"raw:{i}" for i in range(pages)]
    start = time.perf_counter()
    for i in range(0, pages, batch):
        pipe = client.pipeline(transaction=False)
        for k in keys[i : i + batch]:
            pipe.set(k, payload)
        pipe.execute()
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, pages, batch):
        pipe = client.pipeline(transaction=False)
        for k in keys[i : i + batch]:
            pipe.get(k)
        assert all(len(v) == page_bytes for v in pipe.execute())
    get_s = time.perf_counter() - start
    client.delete(*keys)
    client.close()
    total = pages * page_bytes
    return {"redis_py_set_gbps": total / put_s / 1e9, "redis_py_get_gbps": total / get_s / 1e9}


def backend_rates(url: str, pages: int, page_bytes: int, batch: int) -> dict[str, float]:
    """GB/s of the backend's put_batch and get_into over ``pages`` pages."""
    config = BackendConfig("redis", "bench", 64 << 30, options={"url": url, "prefix": "bench"})
    payload = os.urandom(page_bytes)
    keys = [f"{0xBE4C:08x}-{i:032x}" for i in range(pages)]
    buffers = [memoryview(bytearray(page_bytes)) for _ in range(batch)]
    with create_backend(config) as backend:
        start = time.perf_counter()
        for i in range(0, pages, batch):
            assert all(backend.put_batch([(k, payload) for k in keys[i : i + batch]]))
        put_s = time.perf_counter() - start
        start = time.perf_counter()
        for i in range(0, pages, batch):
            chunk = keys[i : i + batch]
            assert backend.get_into(chunk, buffers[: len(chunk)]) == [page_bytes] * len(chunk)
        get_s = time.perf_counter() - start
    total = pages * page_bytes
    return {"backend_put_gbps": total / put_s / 1e9, "backend_get_gbps": total / get_s / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=512)
    parser.add_argument("--page-kib", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    page_bytes = args.page_kib << 10
    with tempfile.TemporaryDirectory(prefix="quick-redis-") as tmp:
        server = start_redis_server(Path(tmp))
        try:
            result = {"page_bytes": page_bytes, "pages": args.pages, "batch": args.batch}
            result |= redis_benchmark(server.port, page_bytes, args.pages * 4)
            result |= redis_py_rates(server.url, args.pages, page_bytes, args.batch)
            result |= backend_rates(server.url, args.pages, page_bytes, args.batch)
        finally:
            server.stop()
    result["backend_get_vs_redis_benchmark_get"] = (
        result["backend_get_gbps"] / result["redis_benchmark_get_gbps"]
    )
    result["backend_put_vs_redis_benchmark_set"] = (
        result["backend_put_gbps"] / result["redis_benchmark_set_gbps"]
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
