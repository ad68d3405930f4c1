"""`hybrid-offload bench {backends,e2e,gpu,load,route,trace,workloads}`: each benchmark module registers its
own flags with ``add_arguments(parser)`` and runs with ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

BENCHMARKS = {
    "backends": "store/load GB/s and latency per backend vs physical ceilings and LMCache",
    "gpu": "the data path on a GPU (Qwen3-Next-80B-shaped cache): load/store GB/s vs PCIe ceilings",
    "e2e": "TTFT and prefill throughput per prompt length: cold, vLLM hit, our tiers",
    "load": "concurrency load against `vllm serve` by connector configuration",
    "trace": "a production trace through full tiers: served tokens by retention policy vs LRU and bounds",
    "route": "3 engines sharing Redis: round-robin vs routing by our KV-events index (cache share, TTFT)",
    "workloads": "share of the reusable prefix served on chat, agent, RAG and random traffic",
}


def _run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"hybrid_offload.tools.bench.{args.bench}")
    return int(module.run(args))


def add_bench(subparsers: Any) -> None:
    """Register `bench` and one sub-subcommand per benchmark module."""
    p = subparsers.add_parser("bench", help="run a benchmark (JSON + PNG under benchmarks/results/)")
    sub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, help_text in BENCHMARKS.items():
        q = sub.add_parser(name, help=help_text, description=help_text)
        q.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run in seconds)")
        q.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="results directory")
        module = importlib.import_module(f"hybrid_offload.tools.bench.{name}")
        module.add_arguments(q)
        q.set_defaults(handler=_run)
