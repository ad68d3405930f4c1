"""`hybrid-offload bench backends`: store/load GB/s and per-call latency of every backend, next to
the ceilings of the same bytes and LMCache 0.5.6, all in one run.

Pages are canonical pages (``page_format.encode_page``) of bench-size hybrid geometries: a
Qwen3-Next-like model (full-attention group + GDN state group) and a Falcon-H1-like model
(attention group + Mamba2 state group), attention pages at several chunk sizes. For each page
kind and batch size, each system stores then loads ``calls`` batches cycling through a pool of
keys (see :func:`hybrid_offload.tools.bench.ceilings.slots`):

* ours: ``cpu``, ``disk`` (both layouts: files with ``io_threads`` 1 and 4, segments; its one
  I/O engine is batched threads: aiofiles and NIXL POSIX are not offered), ``redis`` (a
  loopback redis-server started here), ``nixl_peer`` (a ``hybrid-offload peer`` process started
  here); store is ``put_batch``, load ``get_into`` (disk also cold, after dropping its files
  from the page cache);
* ceilings (``ceilings.py``): numpy copy, pwritev/preadv warm/cold, redis-py pipeline,
  redis-benchmark, raw NIXL WRITE/READ;
* LMCache (``lmcache_tiers.py``): StorageManager local CPU, local disk, Redis.

Then a cross-restart check (pages a fresh process finds) and ratios ours/ceiling, ours/LMCache
at the largest batch. Writes ``<out>/backends[-quick].json`` and PNG plots beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybrid_offload.testing.services import start_peer, start_redis_server
from hybrid_offload.tools.bench import ceilings as ce
from hybrid_offload.tools.bench import lmcache_tiers as lm
from hybrid_offload.tools.bench.common import format_table, machine, write_results
from hybrid_offload.tools.bench.report import plot_all, ratio_rows, summary_rows

logger = logging.getLogger(__name__)

MiB = 1 << 20
#: the cache peer's NIXL progress thread sleeps 100 us between polls (instead of spinning a core)
PEER_ARGS = ("--progress-delay-us", "100")


@dataclass(frozen=True)
class PageKind:
    """One page shape: which model and group, the chunk size, and the page's bytes."""

    name: str
    model: str
    group: str
    chunk_tokens: int
    page_bytes: int


@dataclass(frozen=True)
class Sizes:
    """How much each cell moves: ``max(min_calls, target / call bytes)`` calls over a key pool
    of at most ``pool_bytes`` (at least one batch)."""

    kinds: tuple[PageKind, ...]
    batches: tuple[int, ...]
    target_bytes: int
    min_calls: int
    pool_bytes: int
    restart_pages: int
    redis_benchmark_requests_bytes: int

    def calls(self, kind: PageKind, batch: int) -> int:
        return max(self.min_calls, math.ceil(self.target_bytes / (kind.page_bytes * batch)))

    def pool(self, kind: PageKind, batch: int) -> int:
        calls = self.calls(kind, batch)
        return max(batch, min(calls * batch, self.pool_bytes // kind.page_bytes))


def _groups() -> dict[str, tuple[Any, Any]]:
    """(attention group, state group) of the bench-size geometries (4 layers per group, bf16)."""
    from hybrid_offload.core.spec import GroupKind, GroupSpec

    layers = tuple(f"L{i}" for i in range(4))
    qwen_attn = GroupSpec(1, GroupKind.FULL_ATTENTION, 64, layers, 0, num_kv_heads=2, head_size=256,
                          head_size_v=256)  # fmt: skip
    # GDN: 8 key heads, 16 value heads of dim 128: conv (3, 8*128*2 + 16*128), ssm (16, 128, 128)
    qwen_gdn = GroupSpec(0, GroupKind.MAMBA, 64, layers, 0, state_shapes=((3, 4096), (16, 128, 128)),
                         state_dtypes=("bfloat16", "bfloat16"), mamba_type="gdn_attention")  # fmt: skip
    falcon_attn = GroupSpec(0, GroupKind.FULL_ATTENTION, 64, layers, 0, num_kv_heads=2, head_size=64,
                            head_size_v=64)  # fmt: skip
    # Mamba2: 24 heads x 64, d_state 128, 1 group: conv (3, 1536 + 2*128), ssm (24, 64, 128)
    falcon_mamba = GroupSpec(1, GroupKind.MAMBA, 64, layers, 0, state_shapes=((3, 1792), (24, 64, 128)),
                             state_dtypes=("bfloat16", "bfloat16"), mamba_type="mamba2")  # fmt: skip
    return {"qwen3next-like": (qwen_attn, qwen_gdn), "falconh1-like": (falcon_attn, falcon_mamba)}


def page_kinds(quick: bool) -> tuple[PageKind, ...]:
    """The page shapes measured; sizes from ``GroupSpec.page_tensors`` and ``page_format.page_len``."""
    from hybrid_offload.core.page_format import page_len

    chunks = {"qwen3next-like": (64, 256), "falconh1-like": (64, 256, 1024)}
    kinds = []
    for model, (attn, state) in _groups().items():
        for chunk in chunks[model]:
            size = page_len(attn.page_tensors(chunk))
            kinds.append(PageKind(f"{model} attn@{chunk}", model, "attention", chunk, size))
        kinds.append(PageKind(f"{model} {state.mamba_type} state", model, "mamba", 0,
                              page_len(state.page_tensors(0))))  # fmt: skip
    if quick:
        return tuple(k for k in kinds if k.model == "falconh1-like" and k.chunk_tokens in (0, 64))
    return tuple(kinds)


def sizes_for(quick: bool) -> Sizes:
    if quick:
        return Sizes(page_kinds(True), (1, 8), 2 * MiB, 2, 16 * MiB, 8, 16 * MiB)
    return Sizes(page_kinds(False), (1, 2, 4, 8, 16, 32, 64), 24 * MiB, 4, 128 * MiB, 32, 256 * MiB)


def make_page(kind: PageKind) -> bytes:
    """A canonical page of ``kind`` with a random payload (backends treat it as opaque bytes)."""
    from hybrid_offload.core.page_format import PageHeader, encode_page
    from hybrid_offload.core.spec import GroupKind

    attn, state = _groups()[kind.model]
    group = attn if kind.group == "attention" else state
    tensors = group.page_tensors(kind.chunk_tokens)
    header = PageHeader(os.urandom(16), os.urandom(32), group.index,
                        GroupKind(group.kind), 0, kind.chunk_tokens, tensors)  # fmt: skip
    page = encode_page(header, os.urandom(header.payload_len))
    assert len(page) == kind.page_bytes
    return page


# -- our backends ------------------------------------------------------------------------------


def backend_configs(tmp: Path, redis_port: int, peer: str) -> dict[str, dict[str, Any]]:
    """Name -> BackendConfig fields of every backend variant measured (JSON-able)."""
    big = 16 << 30
    return {
        "cpu": {"type": "cpu", "capacity_bytes": big, "options": {}},
        "disk[io_threads=1]": {"type": "disk", "capacity_bytes": big,
                               "options": {"path": str(tmp / "disk1"), "io_threads": 1}},
        "disk[io_threads=4]": {"type": "disk", "capacity_bytes": big,
                               "options": {"path": str(tmp / "disk4"), "io_threads": 4}},
        "disk[segments]": {"type": "disk", "capacity_bytes": big,
                           "options": {"path": str(tmp / "diskseg"), "layout": "segments"}},
        "redis": {"type": "redis", "capacity_bytes": big,
                  "options": {"url": f"redis://127.0.0.1:{redis_port}/0", "prefix": "bench"}},
        "nixl_peer": {"type": "nixl_peer", "capacity_bytes": big,
                      "options": {"peers": [peer], "insecure": True}},  # its own peer, on loopback
    }  # fmt: skip


def open_backend(name: str, fields: dict[str, Any]) -> Any:
    from hybrid_offload.backends import BackendConfig, create_backend

    return create_backend(BackendConfig(fields["type"], name.split("[")[0], fields["capacity_bytes"],
                                        options=dict(fields["options"])))  # fmt: skip


def page_keys(namespace: int, start: int, n: int) -> list[str]:
    return [f"{namespace:08x}-{i:032x}" for i in range(start, start + n)]


def measure_ours(backend: Any, page: bytes, batch: int, calls: int, pool: int, cold_dir: str | None,
                 first_key: int) -> dict[str, dict[str, Any]]:  # fmt: skip
    """put_batch then get_into (and a cold get_into pass when ``cold_dir``); the pool is deleted after."""
    keys = page_keys(0xBE7C, first_key, pool)
    src = bytearray(page)  # what the connector hands over: a mutable encode buffer, copied by put
    bufs = [memoryview(bytearray(len(page))) for _ in range(batch)]
    plan = ce.slots(pool, batch, calls)

    def put(r: range) -> Any:
        def call() -> None:
            if not all(backend.put_batch([(keys[i], src) for i in r])):
                raise RuntimeError(f"{backend.name}: a put was refused")
        return call

    def get(r: range) -> Any:
        def call() -> None:
            if None in backend.get_into([keys[i] for i in r], bufs):
                raise RuntimeError(f"{backend.name}: a stored page missed")
        return call

    try:
        out = {"store": ce.time_calls([put(r) for r in plan], len(page) * batch)}
        out["load"] = ce.time_calls([get(r) for r in plan], len(page) * batch)
        if cold_dir is not None:
            ce.drop_tree_cache(cold_dir)
            out["load_cold"] = ce.time_calls([get(r) for r in ce.slots(pool, batch, pool // batch)],
                                             len(page) * batch)  # fmt: skip
        return out
    finally:
        backend.delete_batch(keys)


# -- the run -----------------------------------------------------------------------------------

OPS = {"store": "store", "load": "load", "load_cold": "load_cold", "pwritev": "store",
       "preadv_warm": "load", "preadv_cold": "load_cold", "set": "store", "get": "load",
       "write": "store", "read": "load"}  # fmt: skip


class Run:
    """State of one benchmark run: services, opened systems, rows (see ``run``)."""

    def __init__(self, sizes: Sizes, tmp: Path, redis_port: int, peer: str, peer_capacity: int) -> None:
        self.sizes, self.tmp, self.redis_port, self.peer = sizes, tmp, redis_port, peer
        self.peer_capacity = peer_capacity
        self.rows: list[dict[str, Any]] = []
        self.notes: dict[str, str] = {}
        self.key_counter = 0
        self.configs = backend_configs(tmp, redis_port, peer)
        self.backends = {name: open_backend(name, f) for name, f in self.configs.items()}
        self.raw_nixl = ce.RawNixl(peer)
        self.lm_tiers: dict[str, lm.Tier] = {}
        self.lm_error = lm.import_error()

    def add(self, kind: PageKind, batch: int | None, system: str, role: str, tier: str,
            results: dict[str, dict[str, Any]]) -> None:  # fmt: skip
        for op, values in results.items():
            self.rows.append({"kind": kind.name, "model": kind.model, "group": kind.group,
                              "chunk_tokens": kind.chunk_tokens, "page_bytes": kind.page_bytes,
                              "batch": batch, "system": system, "role": role, "tier": tier,
                              "op": OPS[op], **values})  # fmt: skip

    def next_keys(self, n: int) -> int:
        self.key_counter += n
        return self.key_counter - n

    def open_lmcache(self, page: int) -> None:
        """(Re)build the LMCache tiers (failures recorded per tier; chunk sizes are per call)."""
        for tier in lm.TIER_LOCATION:
            old = self.lm_tiers.pop(tier, None)
            if old is not None:
                close_manager(old.sm)
            if self.lm_error is not None:
                continue
            try:
                sm = lm.make_manager(tier, page, 1.0, str(self.tmp / f"lm-{tier}"),
                                     f"redis://127.0.0.1:{self.redis_port}")  # fmt: skip
                self.lm_tiers[tier] = lm.Tier(tier, sm)
            except Exception as exc:  # a tier that cannot run here is a result, not a crash
                self.notes[f"LMCache {tier}"] = f"cannot build StorageManager: {type(exc).__name__}: {exc}"

    def cell(self, kind: PageKind, page: bytes, batch: int) -> None:
        """Every system at one (page kind, batch size)."""
        calls, pool = self.sizes.calls(kind, batch), self.sizes.pool(kind, batch)
        size = kind.page_bytes
        for name, backend in self.backends.items():
            cold = self.configs[name]["options"]["path"] if name.startswith("disk") else None
            res = measure_ours(backend, page, batch, calls, pool, cold, self.next_keys(pool))
            self.add(kind, batch, name, "ours", self.configs[name]["type"], res)
        copies = {op: ce.numpy_copy(size, batch, calls) for op in ("store", "load")}
        self.add(kind, batch, "numpy copy", "ceiling", "cpu", copies)
        self.add(kind, batch, "pwritev/preadv", "ceiling", "disk",
                 ce.raw_file(str(self.tmp), size, batch, calls, pool))
        self.add(kind, batch, "redis-py pipeline", "ceiling", "redis",
                 ce.redis_py(self.redis_port, size, batch, calls, pool))
        self.add(kind, batch, "raw NIXL", "ceiling", "nixl_peer",
                 self.raw_nixl.measure(size, batch, calls, self.peer_capacity // 2))
        for tier in lm.TIER_LOCATION:
            name = f"LMCache {tier}"
            if tier not in self.lm_tiers:
                reason = self.lm_error or self.notes.get(name, "not built")
                self.add(kind, batch, name, "lmcache", tier, {"store": ce.skipped(reason),
                                                               "load": ce.skipped(reason)})
                continue
            try:
                res = lm.measure(self.lm_tiers[tier], size, batch, calls, pool, self.next_keys(pool))
            except Exception as exc:  # recorded in the row instead of a number
                why = f"{type(exc).__name__}: {exc}"
                res = {"store": ce.skipped(why), "load": ce.skipped(why)}
            self.add(kind, batch, name, "lmcache", tier, res)
        ce.flush_redis(self.redis_port)  # LMCache's Redis tier cannot delete its values

    def redis_benchmark(self, kind: PageKind) -> None:
        requests = max(32, self.sizes.redis_benchmark_requests_bytes // kind.page_bytes)
        res = ce.redis_benchmark(self.redis_port, kind.page_bytes, requests)
        self.add(kind, None, "redis-benchmark", "ceiling", "redis",
                 {op: {"gbps": gbps, "p50_ms": None, "p99_ms": None, "requests": requests,
                       "clients": 4, "pipeline": 8} for op, gbps in res.items()})  # fmt: skip

    def close(self) -> None:
        for backend in self.backends.values():
            with contextlib.suppress(Exception):
                backend.close()
        self.raw_nixl.close()
        for tier in list(self.lm_tiers):
            close_manager(self.lm_tiers.pop(tier).sm)


def close_manager(sm: Any, timeout: float = 5.0) -> None:
    """Close an LMCache StorageManager, bounded. With a RemoteBackend, ``close()`` never returns
    (LMCache's Redis connector shuts its executor down from its own event loop and waits on
    itself, leaving non-daemon threads that block interpreter exit), so for it only the manager's
    event loop is stopped; its sockets die with the process."""
    import threading

    if "RemoteBackend" in sm.storage_backends:
        with contextlib.suppress(Exception):
            sm.loop.call_soon_threadsafe(sm.loop.stop)
        sm.thread.join(timeout)
        return
    thread = threading.Thread(target=sm.close, daemon=True, name="lmcache-close")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        logger.warning("LMCache StorageManager.close() did not return in %.0f s; abandoned", timeout)


# -- cross-restart -----------------------------------------------------------------------------


def probe_main() -> None:
    """Fresh-process side of the cross-restart check: JSON specs on stdin, ``{name: found}`` out."""
    specs = json.loads(sys.stdin.read())
    found: dict[str, Any] = {}
    for spec in specs:
        try:
            if spec["kind"] == "ours":
                backend = open_backend(spec["name"], spec["config"])
                pages = backend.get_batch(spec["keys"])
                found[spec["name"]] = sum(p is not None and len(p) == spec["page"] for p in pages)
                backend.close()
            else:
                found[spec["name"]] = lm.probe_count(spec)
        except Exception as exc:  # reported per system
            found[spec["name"]] = f"{type(exc).__name__}: {exc}"
    print("PROBE " + json.dumps(found), flush=True)
    os._exit(0)  # LMCache leaves non-daemon threads behind


def cross_restart(run: Run, kind: PageKind, page: bytes) -> list[dict[str, Any]]:
    """Store N pages per system, close it, count what one fresh process finds."""
    n = run.sizes.restart_pages
    specs: list[dict[str, Any]] = []
    expected = {"cpu": "0 (in-process pool)", "disk": "1", "redis": "1", "nixl_peer": "1 (peer outlives)"}
    for name in list(run.backends):
        backend = run.backends.pop(name)
        keys = page_keys(0xC0DE, run.next_keys(n), n)
        assert all(backend.put_batch([(k, page) for k in keys]))
        backend.close()
        specs.append({"kind": "ours", "name": name, "config": run.configs[name], "keys": keys,
                      "page": len(page), "expected": expected[run.configs[name]["type"]]})  # fmt: skip
    for tier, t in list(run.lm_tiers.items()):
        first = run.next_keys(n)
        t.store(lm.make_keys(first, n), page)
        close_manager(run.lm_tiers.pop(tier).sm)
        specs.append({"kind": "lmcache", "name": f"LMCache {tier}", "tier": tier, "page": len(page),
                      "first_key": first, "n": n, "disk_dir": str(run.tmp / f"lm-{tier}"),
                      "redis_url": f"redis://127.0.0.1:{run.redis_port}",
                      "expected": {"cpu": "0", "disk": "0 (index in memory)", "redis": "1"}[tier]})
    code = "from hybrid_offload.tools.bench.backends import probe_main; probe_main()"
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(specs), capture_output=True,
                          text=True, timeout=180)  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")), None)
    found = json.loads(line[6:]) if line else {}
    rows = []
    for spec in specs:
        got = found.get(spec["name"], f"probe process failed: {proc.stderr[-500:]}")
        rows.append({"system": spec["name"], "kind": kind.name, "stored": n,
                     "found": got if isinstance(got, int) else None,
                     "fraction": got / n if isinstance(got, int) else None,
                     "expected_fraction": spec["expected"],
                     **({} if isinstance(got, int) else {"error": got})})  # fmt: skip
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of this benchmark."""
    parser.add_argument("--no-lmcache", action="store_true", help="skip the LMCache comparison")


def run(args: argparse.Namespace) -> int:
    """Measure everything (see the module docstring); write JSON + PNGs; print the ratio table."""
    from tqdm import tqdm

    began = time.monotonic()
    sizes = sizes_for(args.quick)
    load_before = machine()["load_average_1m"]
    peer_capacity = 2 * sizes.pool_bytes + 64 * MiB
    with tempfile.TemporaryDirectory(prefix="bench-backends-", dir=os.environ.get("BENCH_TMP")) as td, \
            start_redis_server(Path(td) / "redis") as redis, \
            start_peer(peer_capacity, extra_args=PEER_ARGS, start_timeout_s=60) as peer:  # fmt: skip
        bench = Run(sizes, Path(td), redis.port, peer.address, peer_capacity)
        if args.no_lmcache:
            bench.lm_error = "skipped (--no-lmcache)"
        try:
            cells = [(k, b) for k in sizes.kinds for b in sizes.batches]
            pages = {k: make_page(k) for k in sizes.kinds}
            with tqdm(total=len(cells), desc="bench backends", unit="cell") as bar:
                bench.open_lmcache(max(k.page_bytes for k in sizes.kinds))
                for kind in sizes.kinds:
                    bench.redis_benchmark(kind)
                    for batch in sizes.batches:
                        bar.set_postfix_str(f"{kind.name} x{batch}")
                        bench.cell(kind, pages[kind], batch)
                        bar.update()
            restart = cross_restart(bench, sizes.kinds[0], pages[sizes.kinds[0]])
        finally:
            bench.close()
    return finish(args, sizes, bench, restart, load_before, time.monotonic() - began)


def finish(args: argparse.Namespace, sizes: Sizes, bench: Run, restart: list[dict[str, Any]],
           load_before: float, wall_s: float) -> int:  # fmt: skip
    """Ratios, table, JSON and plots."""
    ratios = ratio_rows(bench.rows, max(sizes.batches))
    summary = summary_rows(ratios)
    payload = {
        "args": {"quick": args.quick, "no_lmcache": args.no_lmcache},
        "wall_s": round(wall_s, 1),
        "load_average_1m_before": load_before,
        "sizes": {**asdict(sizes), "kinds": [asdict(k) for k in sizes.kinds]},
        "notes": {**bench.notes, **NOTES},
        "rows": bench.rows,
        "ratios": ratios,
        "summary": summary,
        "cross_restart": restart,
    }
    stem = "backends-quick" if args.quick else "backends"
    path = write_results("backends", payload, out_dir=args.out, quick=args.quick)
    plots = plot_all(args.out, stem, bench.rows, sizes)
    print(format_table(summary, ["tier", "system", "op", "kinds", "ours_gbps", "ceiling",
                                 "ours_vs_ceiling", "ours_vs_lmcache"]))  # fmt: skip
    print(format_table(restart, ["system", "stored", "found", "fraction", "expected_fraction"]))
    load = machine()["load_average_1m"]
    print(f"wrote {path} and {len(plots)} plots in {wall_s:.0f} s (load average {load})")
    return 0


NOTES = {
    "disk_io_engines": "the disk backend offers one I/O engine, batched threads (io_threads), and two "
                       "layouts (files, segments); aiofiles and NIXL POSIX are not offered by the "
                       "backend, so not measured",
    "ratios": "at the largest batch; ceilings: cpu numpy copy, disk pwritev / preadv warm / preadv "
              "cold, redis redis-benchmark (C client, 4 clients, -P 8), nixl_peer raw NIXL WRITE/READ",
    "lmcache_nixl_peer": "no LMCache counterpart of nixl_peer is measured (ours_vs_lmcache empty)",
    "lmcache_load_cold": "LMCache disk is measured warm only (its load_cold is not measured)",
}  # fmt: skip
