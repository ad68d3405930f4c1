"""Side-by-side summary of `hybrid-offload bench e2e` runs of several code versions (issue 16).

Each input is one run's ``e2e.json``, named ``<variant>-<anything>.json`` (e.g. ``before-1.json``,
``after-2.json``); runs of a variant are pooled. Prints, per variant: the TTFT of each tier and
vLLM's own prefix-cache hit (median of every sample of the variant's runs) with the ratio to
vLLM's hit of the same run (median over runs), and the mean milliseconds per load of each load
phase with the in-engine GB/s next to the same-run ceiling, and the in-engine stores (GB/s of
the copy out of the KV cache and of each tier's ``put_batch``, next to the ceiling). Writes a
grouped bar chart of the mean load time per tier and variant, and the summary as JSON, next to
the inputs.

Usage: ``.venv/bin/python benchmarks/load_path.py benchmarks/results/e2e_load_path/*.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from hybrid_offload.tools.bench.common import bar_plot

NO_TRANSFER = ("cold", "vllm")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's runs: TTFT per (scenario, length), ratios to vLLM's hit, phases per tier."""
    samples: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    phases: dict[str, list[dict[str, Any]]] = {}
    stores: dict[str, list[dict[str, Any]]] = {}
    for doc in runs:
        vllm = {r["length"]: r["ttft_s"] for r in doc["rows"] if r["scenario"] == "vllm"}
        for row in doc["rows"]:
            key = f"{row['scenario']}@{row['length']}"
            samples.setdefault(key, []).extend(row["ttft_all_s"])
            if row["scenario"] not in NO_TRANSFER and row["length"] in vllm:
                ratios.setdefault(key, []).append(row["ttft_s"] / vllm[row["length"]])
        for row in doc.get("in_engine", []):
            phases.setdefault(row["tier"], []).append(row)
        for row in doc.get("in_engine_stores", []):
            stores.setdefault(row["tier"], []).append(row)
    return {
        "runs": len(runs),
        "load_average_1m": [doc["machine"]["load_average_1m"] for doc in runs],
        "ttft_ms": {k: 1e3 * statistics.median(v) for k, v in samples.items()},
        "ttft_over_vllm_hit": {k: statistics.median(v) for k, v in ratios.items()},
        "per_load": {tier: _means(rows) for tier, rows in phases.items()},
        "stores": {tier: _means(rows) for tier, rows in stores.items()},
    }


def _means(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean of every numeric field the rows all have."""
    keys = [k for k, v in rows[0].items() if isinstance(v, int | float)]
    return {k: statistics.mean(r[k] for r in rows) for k in keys if all(r.get(k) is not None for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="e2e.json files named <variant>-*.json")
    args = parser.parse_args()
    variants: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(args.runs):
        variants.setdefault(path.stem.split("-")[0], []).append(json.loads(path.read_text()))
    summary = {name: summarize(runs) for name, runs in variants.items()}
    for name, s in summary.items():
        print(f"== {name}: {s['runs']} runs, 1-min load average at each start {s['load_average_1m']}")
        for key, ms in sorted(s["ttft_ms"].items(), key=lambda kv: (int(kv[0].split("@")[1]), kv[0])):
            ratio = s["ttft_over_vllm_hit"].get(key)
            vs = "" if ratio is None else f"   {ratio:.2f}x vLLM's hit"
            print(f"   {key:18s} TTFT {ms:8.1f} ms{vs}")
        for tier, row in s["per_load"].items():
            ms = " ".join(f"{k[3:]} {v:.1f}" for k, v in row.items() if k.startswith("ms_"))
            print(f"   {tier:10s} ms per load: {ms}; in-engine {row['engine_gbps']:.3f} GB/s, read "
                  f"{row['read_gbps']:.3f}, ceiling {row['ceiling_gbps']:.2f}")
        for tier, row in s["stores"].items():
            print(f"   {tier:10s} stores in the engine {row['store_gbps']:.2f} GB/s, ceiling "
                  f"{row.get('ceiling_gbps', float('nan')):.2f}")
    out = args.runs[0].parent
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    tiers = sorted({t for s in summary.values() for t in s["per_load"]})
    totals = {name: [s["per_load"].get(t, {}).get("ms_total", 0.0) for t in tiers]
              for name, s in summary.items()}  # fmt: skip
    title = "Mean load time inside the engine (ms per load)"
    bar_plot(out / "load-ms.png", title, tiers, totals, "ms per load")
    print(f"wrote {out / 'summary.json'} and {out / 'load-ms.png'}")


if __name__ == "__main__":
    main()
