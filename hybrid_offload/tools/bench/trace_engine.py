"""`bench trace --engine MODEL`: the simulator checked against real vLLM engines, scaled down.

The first ``requests`` of the trace, at ``block`` tokens a hash id instead of 512 (lengths in
proportion, :func:`~.trace_file.scaled`), go one by one through vLLM's default multi-process
engine with a cpu tier of ``size_pct`` of the scaled working set (in this model's bytes), and
through :class:`~.trace_model.Replay` with the same tier, chunk, checkpoint interval and
prefill step, its page bytes those the engine stores (:func:`engine_geometry`). vLLM's own
prefix cache is reset before every request, so every cached token is the connector's. A second
engine without the connector gives the tokens every request must generate (float32). With
``sessions`` every request carries the application's session hint (``"ends"`` where no later
request extends it) and the simulator describes pages with it (``hints="sessions"``).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from hybrid_offload.backends.retention import ResumePointPolicy
from hybrid_offload.tools.bench.trace_file import TRACE_BLOCK_TOKENS, load_trace, scaled
from hybrid_offload.tools.bench.trace_model import Geometry, Replay, Rules, Traffic, unlimited

__all__ = ["engine_geometry", "engine_replay"]

#: vLLM's prefill step in the scaled engine (``max_num_batched_tokens``)
STEP_TOKENS = 512


def engine_geometry(model: Path, dtype: str, connector: dict[str, Any]) -> Geometry:
    """The bytes one chunk's attention page sets and one state's page sets take in this engine's
    tiers (every piece and header), measured: a short run of the same engine (vLLM's default,
    multi-process) stores one prompt in a disk tier, whose pages are then read back."""
    from hybrid_offload.core.page_format import PageFormatError, decode_header
    from hybrid_offload.core.spec import GroupKind
    from hybrid_offload.tools.bench.workload_run import run_engine_subprocess

    with tempfile.TemporaryDirectory(prefix="hybrid-offload-probe-") as tmp:
        prompt = Path(tmp, "probe.jsonl")
        ids = list(range(1 << 30, (1 << 30) + 4))  # ids no trace uses
        prompt.write_text(json.dumps({"timestamp": 0, "input_length": 4 * TRACE_BLOCK_TOKENS - 1,
                                      "output_length": 1, "hash_ids": ids}) + "\n")  # fmt: skip
        disk = {"type": "disk", "name": "disk", "path": str(Path(tmp, "disk")), "capacity_bytes": 1 << 30}
        run_engine_subprocess({
            "model": str(model), "dtype": dtype, "max_model_len": 4096, "sequential": True, "warmup": False,
            "connector": {**connector, "backends": [disk]},
            "workloads": [{"name": "trace", "size": {"path": str(prompt), "requests": 1,
                                                     "block": connector["chunk_tokens"], "reply": 1}}],
        })  # fmt: skip
        sizes: dict[bool, int] = {True: 0, False: 0}
        sets: dict[bool, set[bytes]] = {True: set(), False: set()}
        for page in Path(tmp, "disk").rglob("*"):
            try:
                header, _, _ = decode_header(page.read_bytes()) if page.is_file() else (None, 0, 0)
            except PageFormatError:
                continue  # the tier's own files (its usage record)
            if header is not None:
                state = header.kind is GroupKind.MAMBA
                sizes[state] += page.stat().st_size
                sets[state].add(header.chunk_hash)
    chunk = connector["chunk_tokens"]
    return Geometry(model.name, sizes[False] / len(sets[False]) / chunk, sizes[True] // len(sets[True]))


def engine_replay(
    model: Path, trace: Path, requests: int, block: int, size_pct: float, dtype: str = "float32",
    baseline: bool = True, sessions: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Served tokens of the scaled trace through the engine and through the simulator, as % of
    a tier that never evicts and holds a state at every boundary (module docstring)."""
    from hybrid_offload.tools.bench.workload_run import run_engine_subprocess
    from hybrid_offload.tools.bench.workloads_report import identical

    trace_requests = scaled(load_trace(trace, limit=requests), block)
    traffic = Traffic(trace_requests, chunk=block)
    max_model_len = max(r.input_length for r in trace_requests) + 64
    rules = Rules(interval=1024 * block // TRACE_BLOCK_TOKENS, step_tokens=STEP_TOKENS)
    connector: dict[str, Any] = {"chunk_tokens": block, "checkpoint_interval_tokens": rules.interval}
    geometry = engine_geometry(model, dtype, {**connector, "backends": [{"type": "cpu", "name": "cpu"}]})
    dense = Rules(rules.interval, rules.step_tokens, dense=True)
    total = unlimited(traffic, geometry, dense).outcome.served_tokens
    capacity = int(traffic.working_set(geometry) * size_pct / 100)
    connector["backends"] = [{"type": "cpu", "name": "cpu", "capacity_bytes": capacity}]
    hints = "sessions" if sessions else "pages"
    sim = Replay(traffic, geometry, capacity, rules, ResumePointPolicy(lambda: capacity), hints=hints)
    sim.run()
    spec: dict[str, Any] = {
        "model": str(model), "dtype": dtype, "max_model_len": max_model_len, "sequential": True,
        "warmup": False, "llm_kwargs": {"max_num_batched_tokens": STEP_TOKENS},
        "workloads": [{"name": "trace", "size": {"path": str(trace), "requests": requests, "block": block,
                                                 "reply": 2, "sessions": int(sessions)}}],
    }  # fmt: skip
    ours = run_engine_subprocess({**spec, "connector": connector})
    waves = ours["workloads"]["trace"]["waves"]
    served = [sum((r["report"] or {}).get("served_tokens", 0) for r in wave) for wave in waves]
    same = None
    if baseline:
        base = run_engine_subprocess({**spec, "connector": None})
        same = identical(base["workloads"]["trace"]["waves"], waves)
    engine_pct = 100 * sum(served) / total if total else 0.0
    sim_pct = 100 * sim.outcome.served_tokens / total if total else 0.0
    per_request = [(e, s * block) for e, s in zip(served, sim.hit_chunks, strict=True)]
    return {
        "model": geometry.model, "requests": len(trace_requests), "block": block, "size_pct": size_pct,
        "sessions": sessions,
        "capacity_bytes": capacity, "attention_bytes_per_token": geometry.attention_bytes_per_token,
        "state_bytes": geometry.state_bytes,
        "engine_served_pct": round(engine_pct, 2), "sim_served_pct": round(sim_pct, 2),
        "requests_differing": sum(1 for e, s in per_request if e != s), "identical_tokens": same,
        "per_request_engine_sim_tokens": per_request,
    }  # fmt: skip
