"""`hybrid-offload bench workloads`: how much of the reusable prefix real traffic gets served.

Per architecture (a random-weight tiny model; float32 where vLLM's CPU kernels allow, bf16 for
qwen3_next), four engines, each its own process and vLLM's default multi-process engine, run the
same seeded traffic (:mod:`hybrid_offload.tools.bench.traffic`: chat, agent, shared system prompt,
RAG, random-length prompts asked twice); see ``workloads_report.ENGINES``. The report compares,
per workload, the tokens served with the reusable prefix (what earlier traffic shared, floored to
the chunk), the same for vLLM's own never-reset prefix cache, TTFT, and whether every engine
generated the baseline's tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hybrid_offload.tools.bench import workloads_report
from hybrid_offload.tools.bench.traffic import SIZES, WORKLOADS

logger = logging.getLogger(__name__)

ARCHS = ("falcon_h1", "nemotron_h", "zamba2", "granite_hybrid", "qwen3_next")
#: archs whose CPU kernels need bf16 (their tokens are compared for information only)
BF16_ONLY = ("qwen3_next",)
#: the checkpoint granularity of every arch here (the connector's default chunk on vLLM CPU)
CHUNK_TOKENS = 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma separated architectures")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma separated workloads")
    parser.add_argument("--seed", type=int, default=1, help="traffic seed")
    parser.add_argument("--engines", default="baseline,vllm,ours,restart",
                        help="comma separated subset of " + ",".join(workloads_report.ENGINES))


def connector(disk: Path, with_cpu: bool) -> dict[str, Any]:
    """The connector config of the ``ours`` (cpu + disk) and ``restart`` (disk) engines."""
    backends: list[dict[str, Any]] = [
        {"type": "disk", "name": "disk", "path": str(disk), "capacity_bytes": "4GiB", "load_weight": 0.5}
    ]
    if with_cpu:
        backends.insert(0, {"type": "cpu", "name": "cpu", "capacity_bytes": "4GiB"})
    return {"backends": backends}


def run_arch(arch: str, workloads: list[dict[str, Any]], engines: list[str], work: Path,
             model_dir: Path) -> dict[str, dict[str, Any]]:
    """Every engine of one arch over the same traffic; their records by engine name."""
    from hybrid_offload.tools.bench.workload_run import run_engine_subprocess

    base = {"model": str(model_dir), "dtype": "bfloat16" if arch in BF16_ONLY else "float32",
            "workloads": workloads}
    disk = work / f"{arch}-disk"
    plans = {
        "baseline": {"connector": None, "reset_prefix_cache": "wave"},
        "vllm": {"connector": None, "reset_prefix_cache": "never"},
        "ours": {"connector": connector(disk, True), "reset_prefix_cache": "wave"},
        "restart": {"connector": connector(disk, False), "reset_prefix_cache": "wave"},
    }
    runs = {}
    for engine in engines:
        started = time.perf_counter()
        result = run_engine_subprocess({**base, **plans[engine]})
        result.pop("log", None)
        result["wall_s"] = round(time.perf_counter() - started, 1)
        logger.info("%s %s: %.0fs", arch, engine, result["wall_s"])
        runs[engine] = result
        if engine == "ours":
            result["stored"] = stored_bytes(disk)
    return runs


def stored_bytes(disk: Path) -> dict[str, int]:
    """Pages and bytes the connector stored on disk, per group kind (``hybrid-offload cache
    stats``): what the traffic cost in storage."""
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_offload", "cache", "stats", "--disk", str(disk), "--json"],
        capture_output=True, text=True, timeout=600, check=True,
    )
    out: dict[str, int] = {}
    for fingerprint in json.loads(proc.stdout)["fingerprints"]:
        for group in fingerprint["groups"]:
            kind = "state" if group["kind"] == "mamba" else "attention"
            out[f"{kind}_pages"] = out.get(f"{kind}_pages", 0) + group["pages"]
            out[f"{kind}_bytes"] = out.get(f"{kind}_bytes", 0) + group["bytes"]
    return out


def run(args: argparse.Namespace) -> int:
    from hybrid_offload.testing.models import build_model
    from hybrid_offload.tools.bench.common import write_results

    archs = [a for a in args.archs.split(",") if a]
    names = [w for w in args.workloads.split(",") if w]
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(names) - set(WORKLOADS)) + sorted(set(engines) - set(workloads_report.ENGINES))
    if unknown or "ours" not in engines:
        raise ValueError(f"unknown workloads/engines {unknown}, or no 'ours' engine in {engines}")
    size = "small" if args.quick else "full"
    workloads = [{"name": n, "seed": args.seed, "size": SIZES[size][n]} for n in names]
    began = time.perf_counter()
    rows: list[dict[str, Any]] = []
    storage: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hybrid-offload-bench-workloads-") as tmp:
        work = Path(tmp)
        for arch in archs:
            model_dir = build_model(arch, work / f"{arch}-model")
            runs = run_arch(arch, workloads, engines, work, model_dir)
            rows += workloads_report.workload_rows(arch, CHUNK_TOKENS, runs, arch not in BF16_ONLY)
            storage.append({"arch": arch, **runs["ours"].get("stored", {}),
                            "tokens": workloads_report.tokens_processed(runs["ours"])})
            print(workloads_report.table(rows[-len(names):]), flush=True)
    payload = {
        "args": {"archs": archs, "workloads": workloads, "engines": engines, "seed": args.seed,
                 "chunk_tokens": CHUNK_TOKENS},
        "engines": {e: workloads_report.ENGINES[e] for e in engines},
        "rows": rows,
        "storage": storage,
        "wall_s": round(time.perf_counter() - began, 1),
    }
    path = write_results("workloads", payload, out_dir=args.out, quick=args.quick)
    plots = workloads_report.plots(path, rows)
    print(workloads_report.table(rows))
    print(workloads_report.storage_table(storage))
    print(f"\nwrote {path} and {', '.join(str(p) for p in plots)} ({payload['wall_s']}s)")
    return 0
