"""What the connector costs a request it cannot help: cold TTFT with and without it.

Builds a tiny model (``--arch``, float32 unless Qwen3-Next), then runs the ``random`` traffic of
``hybrid-offload bench workloads`` (6 prompts of 1k-16k tokens, one at a time, each asked
twice; vLLM's prefix cache reset before every request) in ``--rounds`` rounds of four engines,
alternating: no connector; the connector (cpu + disk); the connector with
``checkpoint_interval_tokens: 0`` (stops only at tails); the connector with read-only backends
(no stops, no stores). Prints per engine the mean TTFT of the first asking of every prompt
(misses) and of the second (hits), and writes all samples as JSON to ``--out``.

Usage: ``.venv/bin/python benchmarks/miss_cost.py [--arch falcon_h1] [--rounds 2] [--out f.json]``.
Noisy on a shared 2-core machine (±15 % between runs of one engine): compare means of rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from hybrid_offload.testing.models import build_model
from hybrid_offload.tools.bench.traffic import SIZES
from hybrid_offload.tools.bench.workload_run import run_engine_subprocess


def connector(disk: Path, **extra: Any) -> dict[str, Any]:
    read_only = extra.pop("read_only", False)
    backends = [
        {"type": "cpu", "name": "cpu", "capacity_bytes": "4GiB", "read_only": read_only},
        {"type": "disk", "name": "disk", "path": str(disk), "capacity_bytes": "4GiB", "load_weight": 0.5,
         "read_only": read_only},
    ]
    return {"backends": backends, **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="falcon_h1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("miss_cost.json"))
    args = parser.parse_args()
    samples: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="hybrid-offload-miss-cost-") as tmp:
        model = build_model(args.arch, Path(tmp, "model"))
        spec = {"model": str(model), "dtype": "bfloat16" if args.arch == "qwen3_next" else "float32",
                "workloads": [{"name": "random", "seed": 1, "size": SIZES["full"]["random"]}],
                "reset_prefix_cache": "wave"}
        for rnd in range(args.rounds):
            engines = {
                "no connector": None,
                "connector": connector(Path(tmp, f"a{rnd}")),
                "interval 0": connector(Path(tmp, f"b{rnd}"), checkpoint_interval_tokens=0),
                "read-only": connector(Path(tmp, f"c{rnd}"), read_only=True),
            }
            for name, conn in engines.items():
                run = run_engine_subprocess({**spec, "connector": conn})
                rows = [r for wave in run["workloads"]["random"]["waves"] for r in wave]
                half = len(rows) // 2
                samples.setdefault(name, []).append({
                    "miss_ttft_ms": [round(1e3 * r["ttft_s"], 1) for r in rows[:half]],
                    "second_ttft_ms": [round(1e3 * r["ttft_s"], 1) for r in rows[half:]],
                    "second_cached": [r["cached"] for r in rows[half:]],
                })
    args.out.write_text(json.dumps(samples, indent=1))
    for name, runs in samples.items():
        miss = statistics.mean(statistics.mean(r["miss_ttft_ms"]) for r in runs)
        second = statistics.mean(statistics.mean(r["second_ttft_ms"]) for r in runs)
        print(f"{name:13s} miss {miss:7.1f} ms   second asking {second:7.1f} ms   "
              f"(rounds: {[round(statistics.mean(r['miss_ttft_ms'])) for r in runs]})")


if __name__ == "__main__":
    main()
