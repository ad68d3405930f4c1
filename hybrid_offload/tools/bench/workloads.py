"""`hybrid-offload bench workloads`: how much of the reusable prefix real traffic gets served.

Per architecture (a random-weight tiny model; float32 where vLLM's CPU kernels allow, bf16 for
qwen3_next), four engines, each its own process and vLLM's default multi-process engine, run the
same seeded traffic (:mod:`hybrid_offload.tools.bench.traffic`: chat, agent, shared system prompt,
RAG, random-length prompts asked twice); see ``workloads_report.ENGINES``. The report compares,
per workload, the tokens served with the reusable prefix (what earlier traffic shared, floored to
the chunk), the same for vLLM's own never-reset prefix cache, TTFT, and whether every engine
generated the baseline's tokens.

``--spec ngram|mtp`` runs the same traffic with speculative decoding (:data:`SPECS`): ``ours``,
``restart`` and vLLM's own cache draft; the baseline does not (its tokens are the reference:
drafting must not change greedy tokens); ``nodraft`` (our cache) and ``vllm_nodraft`` (vLLM's
own cache) run without drafting beside them. Our engines and the baseline have prefix caching
off (Mamba cache mode ``none``: vLLM's CPU build crashes with drafting in ``align`` mode, which
the ``vllm`` engine needs; its failure is reported). The rows add the draft acceptance rate.
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
#: ``--spec``: vLLM's speculative_config, the archs it applies to, and how their models are built
#: (n-gram drafts are accepted only where replies repeat themselves: a lower weight std)
SPECS: dict[str, dict[str, Any]] = {
    "ngram": {"config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 4},
              "archs": ARCHS, "build": {"init_std": 0.03}},
    "mtp": {"config": {"method": "qwen3_next_mtp", "num_speculative_tokens": 2},
            "archs": ("qwen3_next",), "build": {"mtp_layers": 1}},
}
NO_PREFIX_CACHING = {"enable_prefix_caching": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma separated architectures")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma separated workloads")
    parser.add_argument("--seed", type=int, default=1, help="traffic seed")
    parser.add_argument("--engines", default="baseline,vllm,ours,restart",
                        help="comma separated subset of " + ",".join(workloads_report.ENGINES)
                        + " (with --spec, nodraft and vllm_nodraft run too)")
    parser.add_argument("--spec", choices=("none", *SPECS), default="none",
                        help="speculative decoding for the engines (see the module docstring)")


def connector(disk: Path, with_cpu: bool) -> dict[str, Any]:
    """The connector config of the ``ours`` (cpu + disk) and ``restart`` (disk) engines."""
    backends: list[dict[str, Any]] = [
        {"type": "disk", "name": "disk", "path": str(disk), "capacity_bytes": "4GiB", "load_weight": 0.5}
    ]
    if with_cpu:
        backends.insert(0, {"type": "cpu", "name": "cpu", "capacity_bytes": "4GiB"})
    return {"backends": backends}


def engine_plans(disk: Path, spec: str) -> dict[str, dict[str, Any]]:
    """What each engine runs: its connector, vLLM's prefix cache reset, its LLM arguments."""
    plans: dict[str, dict[str, Any]] = {
        "baseline": {"connector": None, "reset_prefix_cache": "wave"},
        "vllm": {"connector": None, "reset_prefix_cache": "never"},
        "ours": {"connector": connector(disk, True), "reset_prefix_cache": "wave"},
        "restart": {"connector": connector(disk, False), "reset_prefix_cache": "wave"},
    }
    if spec == "none":
        return plans
    drafting = {"speculative_config": SPECS[spec]["config"]}
    for engine in ("ours", "restart"):
        plans[engine]["llm_kwargs"] = {**NO_PREFIX_CACHING, **drafting}
    plans["baseline"]["llm_kwargs"] = NO_PREFIX_CACHING
    plans["vllm"]["llm_kwargs"] = drafting
    plans["nodraft"] = {"connector": connector(disk.with_name(disk.name + "-nodraft"), True),
                        "reset_prefix_cache": "wave", "llm_kwargs": NO_PREFIX_CACHING}
    plans["vllm_nodraft"] = {"connector": None, "reset_prefix_cache": "never"}
    return plans


#: engines a ``--spec`` run adds to those asked: our cache and vLLM's without drafting
SPEC_ENGINES = ["nodraft", "vllm_nodraft"]


def run_arch(arch: str, workloads: list[dict[str, Any]], engines: list[str], work: Path,
             model_dir: Path, spec: str = "none") -> dict[str, dict[str, Any]]:
    """Every engine of one arch over the same traffic; their records by engine name (an engine
    vLLM could not run, only under ``spec``: ``{"error": its last log line}``)."""
    from hybrid_offload.tools.bench.workload_run import run_engine_subprocess

    base = {"model": str(model_dir), "dtype": "bfloat16" if arch in BF16_ONLY else "float32",
            "workloads": workloads}
    disk = work / f"{arch}-disk"
    plans = engine_plans(disk, spec)
    runs = {}
    for engine in engines + (SPEC_ENGINES if spec != "none" else []):
        started = time.perf_counter()
        try:
            result = run_engine_subprocess({**base, **plans[engine]})
        except RuntimeError as exc:
            if spec == "none":
                raise
            runs[engine] = {"error": _first_error(str(exc))}
            logger.warning("%s %s failed with drafting on: %s", arch, engine, runs[engine]["error"])
            continue
        result.pop("log", None)
        result["wall_s"] = round(time.perf_counter() - started, 1)
        logger.info("%s %s: %.0fs", arch, engine, result["wall_s"])
        runs[engine] = result
        if engine == "ours":
            result["stored"] = stored_bytes(disk)
    return runs


def _first_error(log: str) -> str:
    """The root cause in a failed engine's log: its first line raising an error."""
    lines = [line.strip() for line in log.splitlines() if "Error: " in line]
    return (lines[0] if lines else log.strip().splitlines()[-1])[-200:]


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
    spec = getattr(args, "spec", "none")
    if spec != "none":
        archs = [a for a in archs if a in SPECS[spec]["archs"]]
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
            build = SPECS[spec]["build"] if spec != "none" else {}
            model_dir = build_model(arch, work / f"{arch}-model", **build)
            runs = run_arch(arch, workloads, engines, work, model_dir, spec)
            rows += workloads_report.workload_rows(arch, CHUNK_TOKENS, runs, arch not in BF16_ONLY)
            storage.append({"arch": arch, **runs["ours"].get("stored", {}),
                            "tokens": workloads_report.tokens_processed(runs["ours"])})
            print(workloads_report.table(rows[-len(names):]), flush=True)
    payload = {
        "args": {"archs": archs, "workloads": workloads, "engines": engines, "seed": args.seed,
                 "chunk_tokens": CHUNK_TOKENS, "spec": spec,
                 **({"speculative_config": SPECS[spec]["config"], "build": SPECS[spec]["build"]}
                    if spec != "none" else {})},
        "engines": {e: workloads_report.ENGINES[e] for e in engines},
        "rows": rows,
        "storage": storage,
        "wall_s": round(time.perf_counter() - began, 1),
    }
    name = "workloads" if spec == "none" else f"workloads-spec-{spec}"
    path = write_results(name, payload, out_dir=args.out, quick=args.quick)
    plots = workloads_report.plots(path, rows)
    print(workloads_report.table(rows))
    print(workloads_report.storage_table(storage))
    print(f"\nwrote {path} and {', '.join(str(p) for p in plots)} ({payload['wall_s']}s)")
    return 0
