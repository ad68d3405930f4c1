"""Coverage of ``bench workloads`` runs: served vs reusable tokens, TTFT, identical tokens.

Pure computations over the records of :mod:`hybrid_offload.tools.bench.workload_run` (no vLLM):
``reusable`` per request is :func:`~hybrid_offload.tools.bench.traffic.reusable_tokens` over the
run's own earlier waves (plus, for a restarted engine, everything the engine before it ran);
``served`` is what vLLM reports cached for the request (``num_cached_tokens``): with vLLM's own
prefix cache reset between waves, that is what the connector loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybrid_offload.tools.bench.common import bar_plot, format_table
from hybrid_offload.tools.bench.traffic import reusable_tokens

#: engines of one arch: (name, what it is)
ENGINES = {
    "baseline": "no connector, vLLM's prefix cache reset between waves (reference tokens, cold TTFT)",
    "vllm": "no connector, vLLM's own prefix cache never reset",
    "ours": "the connector (cpu + disk), vLLM's prefix cache reset between waves",
    "restart": "a new engine on the same disk directory (disk only), vLLM's cache reset between waves",
    "nodraft": "with --spec: the connector without drafting (prefix caching off), beside the drafting ones",
    "vllm_nodraft": "with --spec: no connector, no drafting, vLLM's own prefix cache never reset",
}
COLUMNS = ("arch", "workload", "requests", "reusable", "ours %", "restart %", "vllm %", "nodraft %",
           "vllm_nodraft %", "accept %", "identical", "ttft base ms", "ttft ours ms", "miss base ms",
           "miss ours ms")  # fmt: skip


def _pairs(waves: Sequence[Sequence[dict[str, Any]]]) -> list[list[tuple[list[int], list[int]]]]:
    return [[(r["prompt"], r["output"]) for r in wave] for wave in waves]


def coverage(waves: Sequence[Sequence[dict[str, Any]]], chunk: int,
             earlier: Sequence[Sequence[dict[str, Any]]] = ()) -> dict[str, Any]:
    """Served and reusable tokens of one engine's run of one workload (``earlier``: the waves of
    a run whose pages this engine can load too)."""
    prior = [list(p) + list(o) for wave in _pairs(earlier) for p, o in wave]
    reusable = reusable_tokens(_pairs(waves), chunk, prior)
    rows = [r for wave in waves for r in wave]
    served = [min(r["cached"], re) for wave, res in zip(waves, reusable, strict=True)
              for r, re in zip(wave, res, strict=True)]
    lost: dict[str, int] = {}
    for r in rows:
        for reason, tokens in ((r.get("report") or {}).get("lost_tokens") or {}).items():
            lost[reason] = lost.get(reason, 0) + tokens
    total_reusable = sum(sum(res) for res in reusable)
    return {
        "requests": len(rows),
        "reusable": total_reusable,
        "served": sum(served),
        "cached": sum(r["cached"] for r in rows),
        "ratio": sum(served) / total_reusable if total_reusable else 1.0,
        "ttft_ms": 1e3 * sum(r["ttft_s"] for r in rows) / max(1, len(rows)),
        "lost_reported": lost,
        "per_request": [
            {"label": r["label"], "prompt": len(r["prompt"]), "reusable": re, "cached": r["cached"]}
            for wave, res in zip(waves, reusable, strict=True) for r, re in zip(wave, res, strict=True)
        ],
    }


def identical(a: Sequence[Sequence[dict[str, Any]]], b: Sequence[Sequence[dict[str, Any]]]) -> bool:
    """Whether two runs generated the same tokens for every request."""
    outs = [[r["output"] for r in wave] for wave in a]
    return outs == [[r["output"] for r in wave] for wave in b]


def workload_rows(
    arch: str, chunk: int, runs: dict[str, dict[str, Any]], float32: bool
) -> list[dict[str, Any]]:
    """One row per workload from the engines' results (``runs[engine]["workloads"]``)."""
    rows = []
    for name, ours in runs["ours"]["workloads"].items():
        waves = ours["waves"]
        row: dict[str, Any] = {"arch": arch, "workload": name, "chunk_tokens": chunk}
        ran = {e: r for e, r in runs.items() if "error" not in r}
        cov = {"ours": coverage(waves, chunk)}
        if "restart" in ran:
            cov["restart"] = coverage(ran["restart"]["workloads"][name]["waves"], chunk, waves)
        for engine in ("vllm", "nodraft", "vllm_nodraft"):
            if engine in ran:
                cov[engine] = coverage(ran[engine]["workloads"][name]["waves"], chunk)
        row["coverage"] = cov
        row["failed"] = {e: r["error"] for e, r in runs.items() if "error" in r}
        for engine in row["failed"]:
            row[f"{engine} %"] = "failed"
        drafts = runs["ours"].get("drafts") or {}
        if drafts.get("drafted"):
            row["accept %"] = round(100 * drafts["accepted"] / drafts["drafted"], 1)
        row["requests"] = cov["ours"]["requests"]
        row["reusable"] = cov["ours"]["reusable"]
        for engine, data in cov.items():
            row[f"{engine} %"] = round(100 * data["ratio"], 1)
        if "baseline" in runs:
            base = runs["baseline"]["workloads"][name]["waves"]
            others = [ran[e]["workloads"][name]["waves"] for e in ("restart", "nodraft") if e in ran]
            same = identical(base, waves) and all(identical(base, other) for other in others)
            row["identical"] = ("yes" if same else "NO") if float32 else ("yes" if same else "differs (bf16)")
            row.update(_ttfts(base, waves, cov["ours"]["per_request"]))
        else:
            row["ttft ours ms"] = round(cov["ours"]["ttft_ms"], 1)
        rows.append(row)
    return rows


def _ttfts(base: Sequence[Sequence[dict[str, Any]]], ours: Sequence[Sequence[dict[str, Any]]],
           per_request: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean TTFT (ms) of the baseline and of ours over the requests with something to reuse
    ("ttft") and over those with nothing (the connector's cost on a miss: stops, copies)."""
    b = [r["ttft_s"] for wave in base for r in wave]
    o = [r["ttft_s"] for wave in ours for r in wave]
    out = {}
    for label, pick in (("ttft", lambda p: p["reusable"] > 0), ("miss", lambda p: p["reusable"] == 0)):
        idx = [i for i, p in enumerate(per_request) if pick(p)]
        if idx:
            out[f"{label} base ms"] = round(1e3 * sum(b[i] for i in idx) / len(idx), 1)
            out[f"{label} ours ms"] = round(1e3 * sum(o[i] for i in idx) / len(idx), 1)
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    return format_table(rows, COLUMNS)


def tokens_processed(run: dict[str, Any]) -> int:
    """Prompt and generated tokens of every request of an engine's run."""
    return sum(len(r["prompt"]) + len(r["output"]) for w in run["workloads"].values()
               for wave in w["waves"] for r in wave)


def storage_table(storage: Sequence[dict[str, Any]]) -> str:
    """What the ``ours`` engine stored per arch: attention and state pages and bytes."""
    rows = []
    for s in storage:
        att, state = s.get("attention_bytes", 0), s.get("state_bytes", 0)
        rows.append({"arch": s["arch"], "tokens": s.get("tokens"), "attention MiB": round(att / 2**20, 1),
                     "state MiB": round(state / 2**20, 1),
                     "state / attention": round(state / att, 2) if att else None,
                     "bytes / token": round((att + state) / s["tokens"]) if s.get("tokens") else None})
    return format_table(rows, ("arch", "tokens", "attention MiB", "state MiB", "state / attention",
                               "bytes / token"))


def plots(path: Path, rows: Sequence[dict[str, Any]]) -> list[Path]:
    """Share of the reusable prefix served, per (arch, workload) and engine."""
    labels = [f"{r['arch']}/{r['workload']}" for r in rows]
    def share(row: dict[str, Any], engine: str) -> float:
        value = row.get(f"{engine} %", 0.0)
        return value if isinstance(value, float | int) else 0.0

    engines = ("ours", "restart", "vllm", "nodraft", "vllm_nodraft")
    series = {e: [share(r, e) for r in rows] for e in engines if any(f"{e} %" in r for r in rows)}
    out = path.with_suffix(".png")
    bar_plot(out, "share of the reusable prefix served (%)", labels, series, "% of reusable tokens")
    return [out]
