"""``hybrid-offload demo``: the cache working on a hybrid model, on traffic as people send it.

1. Build a small random-weight model locally (no network).
2. Traffic (:mod:`hybrid_offload.tools.bench.traffic`, seeded, lengths never aligned to anything):
   a multi-turn chat whose turns carry the generated replies, documents asked several questions,
   and prompts of random lengths asked twice.
3. A baseline engine without the connector answers it (greedy).
4. Engine A with a cpu + disk cache answers it; vLLM's own prefix cache is reset before every
   request, so every cached token is the connector's.
5. Engine A exits; engine B starts on the same disk directory (a restart) and answers it again.
6. Prints, per kind of traffic, the reusable prefix (what earlier requests' prompts and replies
   share with each request, floored to the chunk) and the share the cache served, TTFT without
   and with the cache on the requests that had something to reuse, and whether every output
   equals the baseline's.

Every engine is its own process and vLLM's default multi-process engine. The default model is
Falcon-H1-style in float32, where identical greedy tokens are a real check. In bf16 (Qwen3-Next
on CPU, whose GDN kernels need it) a reply's KV and state computed while decoding differ in the
last bits from the same tokens prefilled in the next turn, and near-tied logits of a random
model flip: there the token comparison is reported, not required.
"""

from __future__ import annotations

import json
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_offload.tools.bench.workload_run import run_engine_subprocess
from hybrid_offload.tools.bench.workloads_report import coverage

#: chunk tokens of every tiny model here (the connector's default on vLLM CPU)
CHUNK_TOKENS = 128
TRAFFIC = [
    {"name": "chat", "seed": 1, "size": {"conversations": 2, "turns": 4, "first": (300, 900),
                                         "message": (60, 300), "reply": 100}},
    {"name": "rag", "seed": 1, "size": {"docs": 2, "questions": 3, "doc": (1500, 2500), "question": (20, 200),
                                        "reply": 16}},
    {"name": "random", "seed": 1, "size": {"prompts": 3, "length": (1000, 4000), "reply": 16}},
]


DEFAULT_DEMO_ARCH = "falcon_h1"


@dataclass(frozen=True)
class DemoOptions:
    arch: str = DEFAULT_DEMO_ARCH
    workdir: Path = Path("demo-output")
    dtype: str = "float32"


def _connector(disk_dir: Path, with_cpu: bool) -> dict[str, Any]:
    backends: list[dict[str, Any]] = []
    if with_cpu:
        backends.append({"type": "cpu", "name": "cpu", "capacity_bytes": "512MiB", "load_weight": 1.0})
    backends.append(
        {"type": "disk", "name": "disk", "path": str(disk_dir), "capacity_bytes": "2GiB", "load_weight": 0.5}
    )
    return {"backends": backends}


def _ttfts(base: list[list[dict[str, Any]]], run: list[list[dict[str, Any]]], earlier: Any = ()) -> tuple:
    """Mean TTFT (s) without and with the cache over the requests that had something to reuse."""
    per_request = coverage(run, CHUNK_TOKENS, earlier)["per_request"]
    rows = [r for wave in run for r in wave]
    cold = [b for wave in base for b in wave]
    hit = [i for i, p in enumerate(per_request) if p["reusable"]]
    if not hit:
        return float("nan"), float("nan")
    return (statistics.mean(cold[i]["ttft_s"] for i in hit), statistics.mean(rows[i]["ttft_s"] for i in hit))


def _differing(ref: list[list[dict[str, Any]]], run: list[list[dict[str, Any]]]) -> list[int]:
    """Per request whose output differs from the reference: the index of its first other token."""
    out = []
    expected, got = ([r["output"] for w in x for r in w] for x in (ref, run))
    for a, b in zip(expected, got, strict=True):
        if a != b:
            out.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                            min(len(a), len(b))))
    return out


def run_demo(options: DemoOptions) -> dict[str, Any]:
    """Run the whole demo; return the summary (also written to workdir/summary.json)."""
    from hybrid_offload.testing.models import build_model

    work = options.workdir.resolve()
    model_dir = work / f"model-{options.arch}"
    if not (model_dir / "config.json").exists():
        build_model(options.arch, model_dir)
    disk_dir = work / "disk-cache"
    shutil.rmtree(disk_dir, ignore_errors=True)
    base = {"model": str(model_dir), "dtype": options.dtype, "max_model_len": 8192, "workloads": TRAFFIC,
            "sequential": True}
    baseline = run_engine_subprocess({**base, "connector": None})
    engine_a = run_engine_subprocess({**base, "connector": _connector(disk_dir, True)})
    engine_b = run_engine_subprocess({**base, "connector": _connector(disk_dir, False)})
    rows = []
    for name in baseline["workloads"]:
        ref = baseline["workloads"][name]["waves"]
        a, b = engine_a["workloads"][name]["waves"], engine_b["workloads"][name]["waves"]
        cov_a, cov_b = coverage(a, CHUNK_TOKENS), coverage(b, CHUNK_TOKENS, a)
        cold, hit = _ttfts(ref, a)
        rows.append({
            "workload": name,
            "requests": cov_a["requests"],
            "prompt_tokens": [len(r["prompt"]) for wave in a for r in wave],
            "same_session": {k: cov_a[k] for k in ("reusable", "served", "ratio")},
            "after_restart": {k: cov_b[k] for k in ("reusable", "served", "ratio")},
            "ttft_cold_s": cold,
            "ttft_hit_s": hit,
            "differing": _differing(ref, a) + _differing(ref, b),
        })
    summary = {"arch": options.arch, "dtype": options.dtype, "chunk_tokens": CHUNK_TOKENS, "workloads": rows,
               "outputs_identical": not any(r["differing"] for r in rows),
               "requests": 2 * sum(r["requests"] for r in rows)}
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"hybrid-offload demo: {summary['arch']} ({summary['dtype']}), vLLM's multi-process engine; "
             f"reusable = what earlier prompts and replies share with a request, floored to "
             f"{summary['chunk_tokens']} tokens"]
    for row in summary["workloads"]:
        sizes = row["prompt_tokens"]
        lines.append(f"  {row['workload']}: {row['requests']} requests of {min(sizes)}-{max(sizes)} tokens")
        for label, key in (("same session (engine A, cpu + disk)", "same_session"),
                           ("after restart (engine B, disk only)", "after_restart")):
            cov = row[key]
            lines.append(f"    {label}: served {cov['served']} of {cov['reusable']} reusable tokens "
                         f"({100 * cov['ratio']:.1f}%)")
        cold, hit = row["ttft_cold_s"], row["ttft_hit_s"]
        lines.append(f"    TTFT of requests with something to reuse: {cold * 1e3:.1f} ms without the cache, "
                     f"{hit * 1e3:.1f} ms with it ({cold / hit if hit else float('inf'):.2f}x)")
    if summary["outputs_identical"]:
        lines.append("  outputs identical: yes")
    elif summary["dtype"] == "float32":
        lines.append("  outputs identical: NO")
    else:
        first = sorted(i for r in summary["workloads"] for i in r["differing"])
        lines.append(f"  outputs identical: no ({len(first)} of {summary['requests']} requests differ, from "
                     f"token {first[0]} on; {summary['dtype']}: expected, compare in float32)")
    return "\n".join(lines)
