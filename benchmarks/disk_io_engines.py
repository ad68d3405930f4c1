"""Disk read engines side by side (issue 16): the same pages read into preallocated buffers.

Pages of two sizes (128 KiB: a Falcon-H1-like attention page at chunk 64; 2 MiB: a
Qwen3-Next-like one at chunk 256), 64 per call, warm (page cache) and cold (dropped after a
sync), read by:

* ``preadv`` (the ceiling): one call for the 64 pages stored back to back in one file;
* ``disk[segments]``, ``disk[files]``: our backend's ``get_into`` (batched threads: the one I/O
  engine it offers), each layout on its own directory;
* ``nixl POSIX``: NIXL's POSIX backend (1.5), one READ request of 64 (file range -> DRAM)
  descriptors from the same back-to-back file, with each IO queue that can be built here;
* ``aiofiles``: one file per page (the files layout's way), ``asyncio.gather`` of an
  ``aiofiles`` open + read per page, each read copied into its buffer.

Prints a table (GB/s, ratio to ``preadv`` of the same run) and writes
``benchmarks/results/disk_io_engines.json``.

Usage: ``.venv/bin/python benchmarks/disk_io_engines.py [--out DIR] [--calls N]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hybrid_offload.backends import BackendConfig, create_backend
from hybrid_offload.tools.bench.ceilings import drop_tree_cache
from hybrid_offload.tools.bench.common import format_table, machine

BATCH = 64
SIZES = {"128KiB": 128 << 10, "2MiB": 2 << 20}
NIXL_QUEUES = {
    "nixl POSIX": {},
    "nixl POSIX uring": {"use_uring": "true"},
    "nixl POSIX aio": {"use_aio": "true"},
}


def best_of(
    run: Callable[[], None], calls: int, nbytes: int, before: Callable[[], None] | None = None
) -> float:
    """Median GB/s of ``calls`` runs (``before`` runs untimed before each)."""
    rates = []
    for _ in range(calls):
        if before is not None:
            before()
        began = time.perf_counter()
        run()
        rates.append(nbytes / (time.perf_counter() - began) / 1e9)
    return statistics.median(rates)


def nixl_posix(
    path: str, size: int, bufs: np.ndarray, params: dict[str, str]
) -> tuple[Callable[[], None], Callable[[], None]]:
    """A READ of the 64 pages of ``path`` into ``bufs`` through NIXL POSIX; (run, close)."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"io-engines-{os.getpid()}-{len(params)}", nixl_agent_config(backends=[]))
    agent.create_backend("POSIX", params)
    fd = os.open(path, os.O_RDONLY)
    file_reg = agent.register_memory([(0, size * BATCH, fd, "")], "FILE", backends=["POSIX"])
    dram_reg = agent.register_memory([(bufs.ctypes.data, bufs.nbytes, 0, "")], "DRAM", backends=["POSIX"])
    local = agent.get_xfer_descs([(bufs.ctypes.data + i * size, size, 0) for i in range(BATCH)], "DRAM")
    remote = agent.get_xfer_descs([(i * size, size, fd) for i in range(BATCH)], "FILE")

    def run() -> None:
        handle = agent.initialize_xfer("READ", local, remote, agent.name)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL POSIX READ: {state}")

    def close() -> None:
        agent.deregister_memory(dram_reg)
        agent.deregister_memory(file_reg)
        os.close(fd)

    return run, close


def aiofiles_read(paths: list[str], views: list[memoryview]) -> None:
    import aiofiles

    async def one(path: str, view: memoryview) -> None:
        async with aiofiles.open(path, "rb") as f:
            data = await f.read()
        view[: len(data)] = data

    async def all_pages() -> None:
        await asyncio.gather(*(one(p, v) for p, v in zip(paths, views, strict=True)))

    asyncio.run(all_pages())


def measure(work: Path, label: str, size: int, calls: int) -> list[dict[str, Any]]:
    pages = [os.urandom(size) for _ in range(BATCH)]
    nbytes = size * BATCH
    flat = work / f"{label}.bin"
    flat.write_bytes(b"".join(pages))
    per_page = work / f"{label}-pages"
    per_page.mkdir()
    paths = []
    for i, data in enumerate(pages):
        paths.append(str(per_page / f"{i}.page"))
        Path(paths[-1]).write_bytes(data)
    keys = [f"5eed0001-{i:032x}" for i in range(BATCH)]
    backends = {}
    for layout in ("segments", "files"):
        root = work / f"{label}-{layout}"
        config = BackendConfig("disk", "io", 1 << 36, options={"path": str(root), "layout": layout})
        backend = create_backend(config)
        assert backend.put_batch(list(zip(keys, pages, strict=True))) == [True] * BATCH
        backends[layout] = (backend, str(root))
    bufs = np.zeros(nbytes, np.uint8)
    views = [memoryview(bufs[i * size : (i + 1) * size]) for i in range(BATCH)]
    fd = os.open(flat, os.O_RDONLY)
    engines: dict[str, tuple[Callable[[], None], str]] = {
        "preadv (ceiling)": (lambda: os.preadv(fd, views, 0), str(flat.parent)),
        "disk[segments] get_into": (
            lambda: backends["segments"][0].get_into(keys, views),
            backends["segments"][1],
        ),
        "disk[files] get_into": (lambda: backends["files"][0].get_into(keys, views), backends["files"][1]),
        "aiofiles (one file per page)": (lambda: aiofiles_read(paths, views), str(per_page)),
    }
    closers = []
    errors: dict[str, str] = {}
    for name, params in NIXL_QUEUES.items():
        try:
            run, close = nixl_posix(str(flat), size, bufs, params)
            closers.append(close)
            run()
        except Exception as exc:  # an IO queue this libnixl build lacks: reported, not fatal
            errors[name] = repr(exc)[:200]
            continue
        engines[name] = (run, str(flat.parent))
    rows: list[dict[str, Any]] = [
        {"page": label, "engine": name, "error": why} for name, why in errors.items()
    ]
    try:
        for name, (run, where) in engines.items():
            warm = best_of(run, calls, nbytes)
            cold = best_of(run, max(3, calls // 2), nbytes, before=lambda w=where: drop_tree_cache(w))
            rows.append({"page": label, "engine": name, "warm_gbps": warm, "cold_gbps": cold})
    finally:
        for close in closers:
            close()
        os.close(fd)
        for backend, _ in backends.values():
            backend.close()
    ceiling = next(row for row in rows if row["engine"] == "preadv (ceiling)")
    for row in rows:
        if "warm_gbps" in row:
            row["warm_vs_preadv"] = row["warm_gbps"] / ceiling["warm_gbps"]
            row["cold_vs_preadv"] = row["cold_gbps"] / ceiling["cold_gbps"]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--calls", type=int, default=9)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    began = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as work:
        for label, size in SIZES.items():
            rows += measure(Path(work), label, size, args.calls)
    cols = ["page", "engine", "warm_gbps", "warm_vs_preadv", "cold_gbps", "cold_vs_preadv", "error"]
    print(format_table(rows, cols))
    doc = {
        "bench": "disk_io_engines",
        "batch": BATCH,
        "machine": machine(),
        "load_average_1m_before": load_before,
        "wall_s": time.monotonic() - began,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "disk_io_engines.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path} (load average {load_before:.2f} -> {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
