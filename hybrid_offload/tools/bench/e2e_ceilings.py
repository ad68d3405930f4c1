"""Ceilings of `hybrid-offload bench e2e`: per tier, the fastest read (load) or write (store) of
the same bytes in the same calls outside the engine, measured in the same run.

The shape of a tier's in-engine loads comes from the worker's counters of its pass (mean object
size = bytes loaded / pages loaded, objects per call = pages loaded / loads written), that of its
stores from the backend's counters of the cold pass (bytes / pages stored, pages per
``put_batch`` call); each ceiling moves that many objects of that size per call, ``CALLS``
times, on the same services (after the engines: the raw NIXL transfers overwrite the peer's pool):

* cpu: one ``numpy.copyto`` of the call's bytes;
* disk: ``preadv`` / ``pwritev`` of the call's objects from / into one preallocated file in the
  disk tier's directory, page cache warm (as the engines read it);
* redis: the better of pipelined redis-py (hiredis) GETs / SETs and ``redis-benchmark`` GET /
  SET (4 clients, ``-P 8``) on the same server;
* nixl_peer: raw NIXL READ / WRITE of the call's descriptors from / into the peer's pool.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hybrid_offload.tools.bench import ceilings as ce

logger = logging.getLogger(__name__)

CALLS = 5
#: tier -> the name of its ceiling in reports
NAMES = {
    "load": {
        "cpu": "numpy copy",
        "disk": "preadv (warm)",
        "redis": "redis GET (best of redis-py, redis-benchmark)",
        "nixl_peer": "raw NIXL READ",
    },
    "store": {
        "cpu": "numpy copy",
        "disk": "pwritev",
        "redis": "redis SET (best of redis-py, redis-benchmark)",
        "nixl_peer": "raw NIXL WRITE",
    },
}


#: tier -> backend type, where they differ (``disk_seg``: the disk backend's segment layout)
KIND = {"disk_seg": "disk"}


def load_shape(measured: dict[str, Any]) -> tuple[int, int] | None:
    """(object bytes, objects per load) of a pass's in-engine loads; None without a load."""
    pages, nbytes, loads = measured["pages_loaded"], measured["bytes_loaded"], measured["loads_written"]
    if pages <= 0 or loads <= 0:
        return None
    return max(1, round(nbytes / pages)), max(1, round(pages / loads))


def store_shape(backend: dict[str, Any]) -> tuple[int, int] | None:
    """(object bytes, objects per call) of one backend's in-engine stores (its counters of a
    pass, see ``e2e_report.measured``); None without a store."""
    pages, nbytes = backend.get("stored_pages", 0), backend.get("stored_bytes", 0)
    calls = backend.get("store_calls", 0)
    if pages <= 0 or calls <= 0:
        return None
    return max(1, round(nbytes / pages)), max(1, round(pages / calls))


def measure(
    tier: str, shape: tuple[int, int], work: Path, urls: dict[str, str], op: str = "load"
) -> dict[str, Any]:
    """The ceiling of ``tier`` for ``op`` ("load" or "store") calls of ``shape``: ``{"ceiling",
    "gbps", ...}``; on a failure ``gbps`` is None and ``error`` says why (a missing tool must not
    lose the engines' results)."""
    page, batch = shape
    load = op == "load"
    tier = KIND.get(tier, tier)
    out: dict[str, Any] = {"ceiling": NAMES[op][tier], "object_bytes": page, "objects_per_call": batch}
    try:
        if tier == "cpu":
            out["gbps"] = ce.numpy_copy(page, batch, CALLS)["gbps"]
        elif tier == "disk":
            raw_file = ce.raw_file(str(work), page, batch, CALLS, batch)
            out["gbps"] = raw_file["preadv_warm" if load else "pwritev"]["gbps"]
        elif tier == "redis":
            port = int(urls["redis"].rsplit(":", 1)[1].split("/")[0])
            verb = "get" if load else "set"
            py = ce.redis_py(port, page, batch, CALLS, batch)[verb]["gbps"]
            bench = ce.redis_benchmark(port, page, max(64, 4 * batch * CALLS)).get(verb, 0.0)
            out.update(gbps=max(py, bench), redis_py_gbps=py, redis_benchmark_gbps=bench)
        elif tier == "nixl_peer":
            raw = ce.RawNixl(urls["nixl_peer"])
            try:
                moved = raw.measure(page, batch, CALLS, page * batch)
                out["gbps"] = moved["read" if load else "write"]["gbps"]
            finally:
                raw.close()
        else:
            raise ValueError(f"no ceiling for tier {tier!r}")
    except Exception as exc:  # reported in the results, next to the engines' numbers
        logger.warning("ceiling of %s failed: %r", tier, exc)
        out.update(gbps=None, error=repr(exc))
    return out
