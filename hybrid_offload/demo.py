"""``hybrid-offload demo``: the cache working on a hybrid model, start to finish.

1. Build a small random-weight model locally (no network).
2. A baseline engine without the connector answers the prompts (greedy).
3. Engine A with a cpu + disk cache: a cold pass, then the same prompts again (same-session
   hits from the cpu tier). vLLM's own prefix cache is reset before every request, so every
   hit is the connector's.
4. Engine A exits; engine B starts on the same disk directory (a restart): hits from disk.
5. Prints tokens loaded per backend, hit rate over the chunk-aligned prefix, TTFT cold vs hit,
   and whether every output equals the baseline.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_offload.session import run_session_subprocess

DOC_TOKENS = 2048
SUFFIX_LENGTHS = (3, 41, 97)
NUM_DOCS = 2


@dataclass(frozen=True)
class DemoOptions:
    arch: str = "qwen3_next"
    workdir: Path = Path("demo-output")
    max_tokens: int = 16
    async_scheduling: bool | None = None


def demo_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Documents of DOC_TOKENS tokens, each asked several questions (short suffixes)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(NUM_DOCS):
        doc = [rng.randrange(3, vocab_size) for _ in range(DOC_TOKENS)]
        for n in SUFFIX_LENGTHS:
            prompts.append(doc + [rng.randrange(3, vocab_size) for _ in range(n)])
    return prompts


def _connector(disk_dir: Path, with_cpu: bool) -> dict[str, Any]:
    backends: list[dict[str, Any]] = []
    if with_cpu:
        backends.append({"type": "cpu", "name": "cpu", "capacity_bytes": "512MiB", "load_weight": 1.0})
    backends.append(
        {"type": "disk", "name": "disk", "path": str(disk_dir), "capacity_bytes": "2GiB", "load_weight": 0.5}
    )
    return {"backends": backends}


def _pass_summary(label: str, data: dict[str, Any]) -> dict[str, Any]:
    sched = data["scheduler"]
    loaded = {name: c.get("loaded_tokens", 0) for name, c in sched.get("backends", {}).items()}
    aligned = sched.get("aligned_prompt_tokens", 0)
    external = sched.get("external_tokens", 0)
    return {
        "pass": label,
        "loaded_tokens": loaded,
        "aligned_prefix_tokens": aligned,
        "hit_rate": external / aligned if aligned else 0.0,
        "ttft_mean_s": statistics.mean(r["ttft_s"] for r in data["requests"]),
        "cold_ttfts_s": [r["ttft_s"] for r in data["requests"] if r["cached_tokens"] == 0],
        "tokens": [r["tokens"] for r in data["requests"]],
    }


def run_demo(options: DemoOptions) -> dict[str, Any]:
    """Run the whole demo; return the summary (also written to workdir/summary.json)."""
    from hybrid_offload.models import VOCAB_SIZE, build_model

    work = options.workdir.resolve()
    model_dir = work / f"model-{options.arch}"
    if not (model_dir / "config.json").exists():
        build_model(options.arch, model_dir)
    disk_dir = work / "disk-cache"
    shutil.rmtree(disk_dir, ignore_errors=True)
    prompts = demo_prompts(VOCAB_SIZE)
    llm_kwargs: dict[str, Any] = {}
    if options.async_scheduling is not None:
        llm_kwargs["async_scheduling"] = options.async_scheduling
    base = {
        "model": str(model_dir),
        "prompts": prompts,
        "max_tokens": options.max_tokens,
        "llm_kwargs": llm_kwargs,
        "reset_prefix_cache": "request",
    }
    baseline = run_session_subprocess({**base, "connector": None, "passes": 1})
    engine_a = run_session_subprocess({**base, "connector": _connector(disk_dir, True), "passes": 2})
    engine_b = run_session_subprocess({**base, "connector": _connector(disk_dir, False), "passes": 1})
    expected = [r["tokens"] for r in baseline["passes"][0]["requests"]]
    passes = [
        _pass_summary("cold (engine A, pass 1)", engine_a["passes"][0]),
        _pass_summary("same session (engine A, pass 2)", engine_a["passes"][1]),
        _pass_summary("after restart (engine B, disk only)", engine_b["passes"][0]),
    ]
    summary = {
        "arch": options.arch,
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "baseline_ttft_mean_s": statistics.mean(r["ttft_s"] for r in baseline["passes"][0]["requests"]),
        "passes": passes,
        "ttft_cold_s": statistics.mean(passes[0]["cold_ttfts_s"] or [float("nan")]),
        "ttft_hit_s": statistics.mean(p["ttft_mean_s"] for p in passes[1:]),
        "outputs_identical": all(p["tokens"] == expected for p in passes),
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"hybrid-offload demo: {summary['arch']}, {summary['prompts']} prompts of "
        f"{min(summary['prompt_tokens'])}-{max(summary['prompt_tokens'])} tokens"
    ]
    lines.append(f"  baseline (no connector) TTFT mean: {summary['baseline_ttft_mean_s'] * 1000:.1f} ms")
    for p in summary["passes"]:
        loaded = ", ".join(f"{k}={v}" for k, v in p["loaded_tokens"].items()) or "none"
        lines.append(f"  {p['pass']}")
        lines.append(f"    tokens loaded per backend: {loaded}")
        lines.append(
            f"    hit rate over chunk-aligned prefix: {p['hit_rate'] * 100:.1f}% "
            f"of {p['aligned_prefix_tokens']} tokens"
        )
        lines.append(f"    TTFT mean: {p['ttft_mean_s'] * 1000:.1f} ms")
    cold, hit = summary["ttft_cold_s"], summary["ttft_hit_s"]
    lines.append(
        f"  TTFT cold vs hit: {cold * 1000:.1f} ms vs {hit * 1000:.1f} ms "
        f"({cold / hit if hit else float('inf'):.2f}x; cold = requests that found nothing, "
        "hit = the second pass and the restart)"
    )
    lines.append(f"  outputs identical: {'yes' if summary['outputs_identical'] else 'NO'}")
    return "\n".join(lines)
