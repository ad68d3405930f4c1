"""Ratios and plots of `hybrid-offload bench backends` (pure functions of its rows)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hybrid_offload.tools.bench.common import bar_plot, line_plot

# (tier, op) -> the ceiling system that bounds it
CEILING = {
    ("cpu", "store"): "numpy copy", ("cpu", "load"): "numpy copy",
    ("disk", "store"): "pwritev/preadv", ("disk", "load"): "pwritev/preadv",
    ("disk", "load_cold"): "pwritev/preadv",
    ("redis", "store"): "redis-benchmark", ("redis", "load"): "redis-benchmark",
    ("nixl_peer", "store"): "raw NIXL", ("nixl_peer", "load"): "raw NIXL",
}  # fmt: skip
LMCACHE = {"cpu": "LMCache cpu", "disk": "LMCache disk", "redis": "LMCache redis"}


def _index(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {(r["system"], r["kind"], r["op"], r["batch"]): r for r in rows}


def _gbps(index: dict[tuple[Any, ...], dict[str, Any]], key: tuple[Any, ...]) -> float | None:
    row = index.get(key)
    return None if row is None else row.get("gbps")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratio_rows(rows: list[dict[str, Any]], batch: int) -> list[dict[str, Any]]:
    """Per our system, op and page kind at ``batch``: GB/s, its ceiling's, LMCache's, and ratios.

    redis-benchmark has no batch: its rows (batch None) are used for every batch; the redis-py
    pipeline at the same batch is given as a second ceiling.
    """
    index = _index(rows)
    out = []
    for r in rows:
        if r["role"] != "ours" or r["batch"] != batch:
            continue
        ceiling = CEILING.get((r["tier"], r["op"]))
        ceil_batch = None if ceiling == "redis-benchmark" else batch
        ceil = _gbps(index, (ceiling, r["kind"], r["op"], ceil_batch))
        lm_name = LMCACHE.get(r["tier"])
        lm = _gbps(index, (lm_name, r["kind"], r["op"], batch)) if lm_name else None
        row = {"tier": r["tier"], "system": r["system"], "op": r["op"], "kind": r["kind"],
               "batch": batch, "ours_gbps": r["gbps"], "ceiling": ceiling, "ceiling_gbps": ceil,
               "ours_vs_ceiling": _ratio(r["gbps"], ceil), "lmcache": lm_name, "lmcache_gbps": lm,
               "ours_vs_lmcache": _ratio(r["gbps"], lm)}  # fmt: skip
        if r["tier"] == "redis":
            py = _gbps(index, ("redis-py pipeline", r["kind"], r["op"], batch))
            row |= {"redis_py_gbps": py, "ours_vs_redis_py": _ratio(r["gbps"], py)}
        out.append(row)
    return out


def _geomean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def summary_rows(ratios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Geometric means over page kinds, per (system, op)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in ratios:
        groups.setdefault((r["system"], r["op"]), []).append(r)
    return [{"tier": rs[0]["tier"], "system": system, "op": op, "kinds": len(rs),
             "ours_gbps": _geomean([r["ours_gbps"] for r in rs]), "ceiling": rs[0]["ceiling"],
             "ceiling_gbps": _geomean([r["ceiling_gbps"] for r in rs]),
             "ours_vs_ceiling": _geomean([r["ours_vs_ceiling"] for r in rs]),
             "lmcache_gbps": _geomean([r["lmcache_gbps"] for r in rs]),
             "ours_vs_lmcache": _geomean([r["ours_vs_lmcache"] for r in rs])}
            for (system, op), rs in groups.items()]  # fmt: skip


def plot_all(out: Path, stem: str, rows: list[dict[str, Any]], sizes: Any) -> list[Path]:
    """GB/s bars (ours vs ceiling vs LMCache, largest batch) per representative page kind, and
    p50 latency vs batch size per op for one page kind."""
    batch = max(sizes.batches)
    ratios = ratio_rows(rows, batch)
    paths = []
    picks = [k for k in sizes.kinds if k.chunk_tokens in (0, 256)][:3] or list(sizes.kinds[:1])
    for kind in picks:
        rs = [r for r in ratios if r["kind"] == kind.name]
        labels = [f"{r['system']} {r['op']}" for r in rs]
        series = {"ours": [r["ours_gbps"] or 0.0 for r in rs],
                  "ceiling": [r["ceiling_gbps"] or 0.0 for r in rs],
                  "LMCache": [r["lmcache_gbps"] or 0.0 for r in rs]}  # fmt: skip
        slug = kind.name.replace(" ", "-").replace("@", "")
        paths.append(bar_plot(out / f"{stem}-gbps-{slug}.png",
                              f"GB/s at batch {batch}: {kind.name} ({kind.page_bytes / 2**20:.2f} MiB pages)",
                              labels, series, "GB/s"))  # fmt: skip
    kind = picks[0]
    for op in ("store", "load"):
        series = {}
        for system in dict.fromkeys(r["system"] for r in rows if r["batch"] is not None):
            pts = {r["batch"]: r["p50_ms"] for r in rows
                   if r["system"] == system and r["kind"] == kind.name and r["op"] == op}  # fmt: skip
            if len(pts) == len(sizes.batches) and None not in pts.values():
                series[system] = [pts[b] for b in sizes.batches]
        paths.append(line_plot(out / f"{stem}-latency-{op}.png", f"p50 {op} latency per call: {kind.name}",
                               list(sizes.batches), series, "pages per call (batch)", "ms"))  # fmt: skip
    return paths
