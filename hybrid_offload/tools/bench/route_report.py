"""What ``bench route`` (:mod:`.route`) reports: per-mode rows from request records, metric
deltas and subscriber counters (pure), the engine facts it reads from logs, and its plots."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hybrid_offload.tools.bench.common import bar_plot, percentile

#: vLLM metrics read per mode (summed over the engines)
PROMPT_TOKENS = "vllm:prompt_tokens_total"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
OUR_LOADED = "hybrid_offload_loaded_tokens_total"
TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
TTFT_COUNT = "vllm:time_to_first_token_seconds_count"
TABLE_COLUMNS = (
    "mode",
    "requests",
    "errors",
    "prompt_tokens",
    "cached_pct",
    "gpu_pct",
    "connector_pct",
    "reusable_pct",
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "route_mean_us",
    "route_p99_us",
    "events_per_s",
    "gaps",
    "resyncs",
    "per_engine",
)





def metric_delta(before: Any, after: Any) -> dict[str, float]:
    """The counters a mode reads, ``after - before`` for one engine's ``Metrics``."""

    def d(name: str, **labels: str) -> float:
        return float(after.total(name, **labels) - before.total(name, **labels))

    out = {
        "prompt_tokens": d(PROMPT_TOKENS),
        "local_cache_hit": d(BY_SOURCE, source="local_cache_hit"),
        "external_kv_transfer": d(BY_SOURCE, source="external_kv_transfer"),
        "local_compute": d(BY_SOURCE, source="local_compute"),
        "prefix_cache_hits": d(LOCAL_HITS),
        "external_prefix_cache_hits": d(EXTERNAL_HITS),
        "our_loaded_tokens": d(OUR_LOADED),
        "server_ttft_sum_s": d(TTFT_SUM),
        "server_ttft_count": d(TTFT_COUNT),
    }
    return out


def add_counts(rows: Iterable[dict[str, float]]) -> dict[str, float]:
    """Key-wise sum of dicts of numbers."""
    total: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total


def counters_of(subscriber: Any) -> dict[str, float]:
    """A subscriber's numeric counters as a flat dict (a dataclass, a mapping, or an object with
    ``counters`` / ``stats()``)."""
    raw: Any = subscriber
    for attr in ("counters", "stats"):
        if hasattr(raw, attr):
            raw = getattr(raw, attr)
            raw = raw() if callable(raw) else raw
            break
    if dataclasses.is_dataclass(raw) and not isinstance(raw, type):
        raw = dataclasses.asdict(raw)
    elif not isinstance(raw, dict):
        raw = dict(vars(raw))
    return {k: v for k, v in raw.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _pct(part: float, whole: float) -> float:
    return round(100.0 * part / whole, 1) if whole else 0.0


def summarize_mode(
    mode: str,
    records: Sequence[dict[str, Any]],
    route_s: Sequence[float],
    metrics: dict[str, float],
    events: dict[str, float],
    wall_s: float,
) -> dict[str, Any]:
    """One mode's row from its request records (``prompt_tokens``, ``cached_tokens``,
    ``reusable``, ``ttft_s``, ``engine``, ``error``), its ``route()`` times, the engines' summed
    metric deltas (:func:`metric_delta`) and the subscribers' summed counter deltas."""
    ok = [r for r in records if r.get("error") is None]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    reusable = sum(r.get("reusable") or 0 for r in ok)
    ttft = [r["ttft_s"] * 1000.0 for r in ok]
    route_us = [s * 1e6 for s in route_s]
    per_engine: dict[str, int] = {}
    for r in records:
        per_engine[r["engine"]] = per_engine.get(r["engine"], 0) + 1
    server_prompt = metrics.get("prompt_tokens", 0.0)
    n_events = events.get("events", 0.0)
    row: dict[str, Any] = {
        "mode": mode,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "first_error": next((r["error"] for r in records if r.get("error") is not None), None),
        "wall_s": round(wall_s, 2),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "reusable_tokens": reusable,
        "cached_pct": _pct(cached, prompt),
        "reusable_pct": _pct(reusable, prompt),
        "cached_of_reusable_pct": _pct(cached, reusable),
        "gpu_pct": _pct(metrics.get("local_cache_hit", 0.0), server_prompt),
        "connector_pct": _pct(metrics.get("external_kv_transfer", 0.0), server_prompt),
        "ttft_mean_ms": round(sum(ttft) / len(ttft), 1) if ttft else float("nan"),
        "ttft_p50_ms": round(percentile(ttft, 50), 1),
        "ttft_p90_ms": round(percentile(ttft, 90), 1),
        "server_ttft_mean_ms": round(1000.0 * metrics["server_ttft_sum_s"] / metrics["server_ttft_count"], 1)
        if metrics.get("server_ttft_count")
        else None,
        "route_calls": len(route_us),
        "route_mean_us": round(sum(route_us) / len(route_us), 1) if route_us else None,
        "route_p99_us": round(percentile(route_us, 99), 1) if route_us else None,
        "events": int(n_events),
        "events_per_s": round(n_events / wall_s, 1) if wall_s > 0 else 0.0,
        "gaps": int(events.get("gaps", 0)),
        "resyncs": int(events.get("resyncs", 0)),
        "per_engine": "/".join(str(per_engine[e]) for e in sorted(per_engine)),
        "metrics": {k: int(v) if float(v).is_integer() else round(v, 4) for k, v in metrics.items()},
        "subscriber": {k: round(v, 6) for k, v in events.items()},
    }
    if records and any("predicted" in r for r in records):
        predicted = [r for r in ok if r.get("predicted") is not None]
        row["predicted_tokens"] = sum(r["predicted"] for r in predicted)
        row["predicted_exact"] = sum(1 for r in predicted if r["predicted"] == (r.get("cached_tokens") or 0))
        row["predicted_over"] = sum(1 for r in predicted if r["predicted"] > (r.get("cached_tokens") or 0))
    return row


def hash_block_size_from_log(text: str) -> int | None:
    """vLLM's hash block (tokens per block hash) from a server log: the gcd of the KV cache
    groups' block sizes it logs for hybrid models; None if it did not log them."""
    match = re.search(r"kv cache group sizes \(([\d, ]+)\)", text)
    if match is None:
        return None
    sizes = [int(s) for s in match.group(1).replace(" ", "").split(",") if s]
    return math.gcd(*sizes) if sizes else None


def chunk_tokens_from_log(text: str) -> int | None:
    """The connector's chunk (``chunk_tokens=N`` in its start-up line); None if not logged."""
    match = re.search(r"hybrid-offload scheduler .*?chunk_tokens=(\d+)", text)
    return int(match.group(1)) if match else None


def plots(rows: Sequence[dict[str, Any]], json_path: Path) -> list[Path]:
    """Bars per mode: served shares (and the reusable bound), TTFT p50/p90."""
    modes = [r["mode"] for r in rows]
    stem = json_path.with_suffix("")
    served = {
        "served, total %": [r["cached_pct"] for r in rows],
        "vLLM's own cache (GPU) %": [r["gpu_pct"] for r in rows],
        "connector (Redis) %": [r["connector_pct"] for r in rows],
        "reusable %": [r["reusable_pct"] for r in rows],
    }
    ttft = {"TTFT p50": [r["ttft_p50_ms"] for r in rows], "TTFT p90": [r["ttft_p90_ms"] for r in rows]}
    return [
        bar_plot(Path(f"{stem}-served.png"), "Routing: prompt tokens served from caches", modes, served,
                 "% of prompt tokens"),
        bar_plot(Path(f"{stem}-ttft.png"), "Routing: time to first token", modes, ttft, "ms"),
    ]  # fmt: skip
