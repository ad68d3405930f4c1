"""Rows, ratios, table and plots of `hybrid-offload bench e2e` (pure: no engines run here).

Input is what :func:`hybrid_offload.tools.bench.e2e.run_scenarios` returns: per scenario the session
pass (requests in prompt order: ``repeats`` rounds over the lengths), the worker counters before
the pass, and the connector's groups (``page_len`` per group) and ``chunk_tokens``.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from hybrid_offload.core.metrics import LOAD_PHASES
from hybrid_offload.tools.bench.common import bar_plot, format_table, line_plot

#: scenarios whose hits come from vLLM itself or from nothing: no bytes move through our tiers
NO_TRANSFER = ("cold", "vllm")
TABLE_COLUMNS = ("scenario", "prompt_tokens", "hit_tokens", "ttft_ms", "speedup_vs_cold", "prefill_tok_s",
                 "loaded_MiB", "bytes_per_hit_token", "attn_MiB", "mamba_MiB")  # fmt: skip
IN_ENGINE_COLUMNS = ("tier", "loads", "MiB_per_load", "engine_gbps", "read_gbps", "ceiling_gbps",
                     "engine_vs_ceiling", "read_vs_ceiling", "ms_queued", "ms_prepare", "ms_read",
                     "ms_verify", "ms_ready", "ms_write", "ms_total", "ms_lookup")  # fmt: skip
STORE_COLUMNS = ("tier", "store_calls", "pages_per_call", "KiB_per_page", "store_gbps", "ceiling_gbps",
                 "store_vs_ceiling", "ms_per_call")  # fmt: skip
MIB = float(1 << 20)


def page_bytes(groups: list[dict[str, Any]], hit_tokens: int, chunk_tokens: int) -> tuple[int, int]:
    """(attention, Mamba/GDN) bytes of loading a ``hit_tokens`` prefix: one page per chunk per
    attention group plus the state page at the last boundary per Mamba group (0, 0 for no hit)."""
    chunks = hit_tokens // chunk_tokens if chunk_tokens else 0
    if chunks == 0:
        return 0, 0
    attn = sum(g["page_len"] for g in groups if g["attention"]) * chunks
    mamba = sum(g["page_len"] for g in groups if not g["attention"])
    return attn, mamba


def _row(scenario: str, length: int, requests: list[dict[str, Any]], entry: dict[str, Any]) -> dict[str, Any]:
    """One (scenario, length) row from the ``repeats`` requests of that length."""
    ttfts = [r["ttft_s"] for r in requests]
    hit = int(statistics.median(r["cached_tokens"] for r in requests))
    ttft = float(statistics.median(ttfts))
    attn, mamba = (0, 0)
    if scenario not in NO_TRANSFER:
        attn, mamba = page_bytes(entry["groups"], hit, entry["chunk_tokens"])
    return {
        "scenario": scenario,
        "length": length,
        "prompt_tokens": requests[0]["prompt_tokens"],
        "hit_tokens": hit,
        "ttft_s": ttft,
        "ttft_ms": ttft * 1000,
        "ttft_all_s": ttfts,
        "prefill_tok_s": requests[0]["prompt_tokens"] / ttft if ttft else None,
        "loaded_bytes": attn + mamba,
        "loaded_MiB": (attn + mamba) / MIB,
        "attn_bytes": attn,
        "mamba_bytes": mamba,
        "attn_MiB": attn / MIB,
        "mamba_MiB": mamba / MIB,
        "bytes_per_hit_token": (attn + mamba) / hit if hit and attn + mamba else None,
    }


def rows(settings: dict[str, Any], raw: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario (plan order) and length: median TTFT, throughput, bytes, speedup vs cold."""
    lengths = settings["lengths"]
    out = []
    for scenario in settings["scenarios"]:
        if scenario not in raw:
            continue
        requests = raw[scenario]["pass"]["requests"]
        for i, length in enumerate(lengths):
            picked = requests[i :: len(lengths)]
            out.append(_row(scenario, length, picked, raw[scenario]))
    cold = {r["length"]: r["ttft_s"] for r in out if r["scenario"] == "cold"}
    for row in out:
        base = cold.get(row["length"])
        row["speedup_vs_cold"] = base / row["ttft_s"] if base and row["ttft_s"] else None
    return out


def ratios(table_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Speedup vs cold per scenario and length, and each tier's TTFT over vLLM's own hit (the
    limit: a hit that moves no bytes)."""
    speedup: dict[str, dict[str, float | None]] = {}
    over_vllm: dict[str, dict[str, float | None]] = {}
    vllm = {r["length"]: r["ttft_s"] for r in table_rows if r["scenario"] == "vllm"}
    for row in table_rows:
        scenario, length = row["scenario"], row["length"]
        speedup.setdefault(scenario, {})[str(length)] = row["speedup_vs_cold"]
        if scenario not in NO_TRANSFER and length in vllm:
            over_vllm.setdefault(scenario, {})[str(length)] = row["ttft_s"] / vllm[length]
    return {"speedup_vs_cold": speedup, "ttft_over_vllm_hit": over_vllm}


def measured(entry: dict[str, Any]) -> dict[str, Any]:
    """Worker counters of one pass (the engine's totals minus those before the pass): pages and
    bytes loaded / copied out, loads written and their seconds by phase (``load_phases``), and
    per backend bytes loaded and stored and seconds in its calls."""
    after, before = entry["pass"]["worker_total"], entry["worker_before"]
    keys = ("pages_loaded", "bytes_loaded", "pages_copied_out", "bytes_copied_out", "loads_written")
    out: dict[str, Any] = {k: int(after.get(k, 0) - before.get(k, 0)) for k in keys}
    copy_out = after.get("copy_out_seconds", 0.0) - before.get("copy_out_seconds", 0.0)
    out["copy_out_seconds"] = round(copy_out, 6)
    out["load_phases"] = {
        p: round(after.get(f"load_{p}_seconds", 0.0) - before.get(f"load_{p}_seconds", 0.0), 6)
        for p in LOAD_PHASES
    }
    per_backend = {}
    for name, counters in after.get("backends", {}).items():
        old = before.get("backends", {}).get(name, {})
        fields = ("loaded_bytes", "load_seconds", "load_calls", "stored_pages", "stored_bytes", "store_calls",
                  "store_seconds")  # fmt: skip
        per_backend[name] = {f: round(counters.get(f, 0) - old.get(f, 0), 4) for f in fields}
    out["backends"] = per_backend
    return out


def scenario_summaries(raw: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per scenario: tiers, tokens loaded per backend (scheduler), bytes moved (worker, measured)
    next to bytes computed from page sizes, groups and the engine's wall time. Counters cover the
    whole pass (the cold pass's warm-up prompts included; loading passes have none)."""
    out = {}
    for scenario, entry in raw.items():
        sched = entry["pass"]["scheduler"]
        computed = 0
        if scenario not in NO_TRANSFER:
            for r in entry["pass"]["requests"]:
                computed += sum(page_bytes(entry["groups"], r["cached_tokens"], entry["chunk_tokens"]))
        out[scenario] = {
            "tiers": entry["tiers"],
            "loaded_tokens": {n: c.get("loaded_tokens", 0) for n, c in sched.get("backends", {}).items()},
            "external_tokens": sched.get("external_tokens", 0),
            "lookup_calls": sched.get("lookup_calls", 0),
            "lookup_seconds": sched.get("lookup_seconds", 0.0),
            "aligned_prompt_tokens": sched.get("aligned_prompt_tokens", 0),
            "worker": measured(entry),
            "ceiling": entry.get("ceiling"),
            "computed_bytes_loaded": computed,
            "chunk_tokens": entry["chunk_tokens"],
            "groups": entry["groups"],
            "engine_wall_s": round(entry["engine_wall_s"], 1),
        }
    return out


def in_engine(summaries: dict[str, Any]) -> list[dict[str, Any]]:
    """Per tier scenario: its loads inside the engine next to the ceiling of the same run.

    ``engine_gbps`` = bytes loaded / seconds from the load job reaching the worker until its
    pages are in the KV cache (what a request waits for); ``read_gbps`` = the same bytes / seconds
    in backend reads; ``ms_<phase>``: mean milliseconds per load of each phase; ``ms_lookup``:
    mean milliseconds per lookup call on the scheduler (not part of the load's phases)."""
    out = []
    for scenario, summary in summaries.items():
        worker, ceiling = summary["worker"], summary.get("ceiling") or {}
        loads, nbytes, phases = worker["loads_written"], worker["bytes_loaded"], worker["load_phases"]
        if scenario in NO_TRANSFER or not loads:
            continue
        engine = nbytes / phases["total"] / 1e9 if phases["total"] else None
        read = nbytes / phases["read"] / 1e9 if phases["read"] else None
        top = ceiling.get("gbps")
        row: dict[str, Any] = {
            "tier": scenario, "loads": loads, "MiB_per_load": nbytes / loads / MIB,
            "engine_gbps": engine, "read_gbps": read, "ceiling": ceiling.get("ceiling"), "ceiling_gbps": top,
            "engine_vs_ceiling": engine / top if engine and top else None,
            "read_vs_ceiling": read / top if read and top else None,
        }  # fmt: skip
        row.update({f"ms_{p}": 1e3 * phases[p] / loads for p in LOAD_PHASES})
        calls = summary.get("lookup_calls", 0)
        row["ms_lookup"] = 1e3 * summary.get("lookup_seconds", 0.0) / calls if calls else None
        out.append(row)
    return out


def in_engine_stores(raw: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per tier of the cold pass's engine: its ``put_batch`` calls on the worker's store thread
    while vLLM prefilled (``store_gbps`` = bytes stored / seconds in those calls) next to the
    ceiling of calls of the same shape (``store_ceilings`` of the cold entry); first, as tier
    ``copy_out``, the copy of those pages out of the KV cache on the model-runner thread."""
    entry = raw.get("cold")
    if entry is None:
        return []
    worker = measured(entry)
    backends = worker["backends"]
    ceilings = entry.get("store_ceilings") or {}
    out = []
    copied, seconds = worker["bytes_copied_out"], worker["copy_out_seconds"]
    if copied and seconds:  # the gather into page buffers on the model-runner thread, in the step
        top, gbps = (ceilings.get("cpu") or {}).get("gbps"), copied / seconds / 1e9
        out.append({"tier": "copy_out", "KiB_per_page": copied / worker["pages_copied_out"] / 1024,
                    "store_gbps": gbps, "ceiling": "numpy copy", "ceiling_gbps": top,
                    "store_vs_ceiling": gbps / top if top else None})  # fmt: skip
    for tier in entry["tiers"]:
        counters, ceiling = backends.get(tier) or {}, ceilings.get(tier) or {}
        calls, seconds = counters.get("store_calls", 0), counters.get("store_seconds", 0.0)
        pages, nbytes = counters.get("stored_pages", 0), counters.get("stored_bytes", 0)
        if not calls or not pages:
            continue
        gbps = nbytes / seconds / 1e9 if seconds else None
        top = ceiling.get("gbps")
        out.append({
            "tier": tier, "store_calls": calls, "pages_per_call": pages / calls,
            "KiB_per_page": nbytes / pages / 1024,
            "store_gbps": gbps, "ceiling": ceiling.get("ceiling"), "ceiling_gbps": top,
            "store_vs_ceiling": gbps / top if gbps and top else None, "ms_per_call": 1e3 * seconds / calls,
        })  # fmt: skip
    return out


def table(table_rows: list[dict[str, Any]]) -> str:
    """The printed summary table."""
    return format_table(table_rows, TABLE_COLUMNS)


def plots(results_path: Path, table_rows: list[dict[str, Any]]) -> list[Path]:
    """TTFT and prefill throughput vs prompt length per scenario, and speedup bars; PNGs next to
    ``results_path`` (same stem plus ``-ttft``, ``-throughput``, ``-speedup``)."""
    stem = results_path.with_suffix("")
    scenarios = list(dict.fromkeys(r["scenario"] for r in table_rows))
    lengths = sorted({r["length"] for r in table_rows})
    by = {(r["scenario"], r["length"]): r for r in table_rows}

    def series(key: str, names: list[str]) -> dict[str, list[float]]:
        return {s: [float(by[(s, n)][key] or 0.0) for n in lengths] for s in names}

    paths = [
        line_plot(Path(f"{stem}-ttft.png"), "Time to first token by prompt length", lengths,
                  series("ttft_s", scenarios), "prompt tokens", "TTFT (s)"),
        line_plot(Path(f"{stem}-throughput.png"), "Prefill throughput (prompt tokens / TTFT)", lengths,
                  series("prefill_tok_s", scenarios), "prompt tokens", "tokens/s"),
        bar_plot(Path(f"{stem}-speedup.png"), "TTFT speedup vs cold", [str(n) for n in lengths],
                 series("speedup_vs_cold", [s for s in scenarios if s != "cold"]), "x faster than cold"),
    ]  # fmt: skip
    return paths
