"""`hybrid-offload bench trace`: hits when the tier is full, on a real production trace.

Replays a Mooncake-format trace (default: the conversation trace in ``../shared/data/traces/``)
through one tier per (model geometry, policy, tier size) with :mod:`.trace_model`, our own
retention code at full scale. Geometries are read from published model configs with vLLM's own
page sizes (:func:`~hybrid_offload.testing.vllm_scheduler.geometry`); tier sizes are fractions
of the working set (every distinct chunk's attention and a state at every boundary). Served
tokens are reported against a tier that never evicts and holds a state at every boundary (the
most any tier serves).

Policies (:data:`POLICIES`): ``lru-dense`` (a state at every 512-token boundary, plain LRU: the
baseline everyone starts from), ``lru`` (the connector's store rules and its deepest-first
refresh, plain LRU: our default before resume points), ``resume`` (:class:`ResumePointPolicy`
with the store path's hints), ``resume-sessions`` (the same with the application's session
hint, taken from the trace: does a later request extend this one), and two bounds that know
the future: ``oracle-admission`` (LRU storing only pages a later hit uses) and ``belady``.
``hierarchy`` rows: a cpu tier of ``--hierarchy`` percent above a disk tier of each larger size
(resume points, write-through), with and without the promotion of disk hits into the cpu tier:
served tokens and the share the cpu tier served.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_offload.tools.bench.common import format_table, line_plot, write_results

if TYPE_CHECKING:  # the model imports vLLM (the scheduler's sightings): not at CLI start-up
    from hybrid_offload.tools.bench.trace_model import Geometry, Replay, Rules, Traffic

logger = logging.getLogger(__name__)

DEFAULT_TRACE = Path("../shared/data/traces/mooncake_conversation.jsonl")
MODELS = ("qwen3_next_80b", "nemotron_h_8b", "falcon_h1_34b")
SIZES_PCT = (1.0, 2.0, 5.0, 10.0, 25.0, 50.0)
POLICIES = ("lru-dense", "lru", "resume", "resume-sessions", "oracle-admission", "belady")
#: requests of the trace a ``--quick`` run replays
QUICK_REQUESTS = 1500


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    parser.add_argument("--models", default=",".join(MODELS), help="comma separated model geometries")
    parser.add_argument("--sizes", default=",".join(f"{s:g}" for s in SIZES_PCT),
                        help="tier sizes, percent of the working set")  # fmt: skip
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma separated policies")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--interval", type=int, default=1024, help="checkpoint_interval_tokens")
    parser.add_argument("--step-tokens", type=int, default=8192, help="prefill step (max_num_batched_tokens)")
    parser.add_argument("--hierarchy", type=float, default=1.0,
                        help="a cpu tier of this percent above each larger size's disk tier (resume points)")
    parser.add_argument("--engine", type=Path, default=None,
                        help="also replay the trace scaled down through vLLM engines of this model "
                             "directory (a tiny hybrid from `hybrid-offload make-model`) and the simulator")
    parser.add_argument("--engine-requests", type=int, default=300, help="requests of the scaled replay")
    parser.add_argument("--engine-block", type=int, default=32, help="tokens a hash id in the scaled replay")
    parser.add_argument("--engine-sizes", default="2,10", help="tier sizes of the scaled replay, percent")
    parser.add_argument("--engine-sessions", action="store_true",
                        help="also replay with every request's session hint (kv_transfer_params)")


def _fixed(nbytes: int) -> Callable[[], float]:
    """A tier capacity of ``nbytes`` (bound now, not to a loop's variable)."""
    return lambda: nbytes


def replay(traffic: Traffic, geometry: Geometry, capacity: int, policy: str, rules: Rules,
           uses: dict[str, list[int]]) -> Replay:  # fmt: skip
    """One replay of ``policy`` (see the module docstring)."""
    from hybrid_offload.backends.retention import ResumePointPolicy
    from hybrid_offload.tools.bench.trace_model import NextUsePolicy, Replay, Rules

    if policy == "lru-dense":
        r = Replay(traffic, geometry, capacity, Rules(rules.interval, rules.step_tokens, dense=True))
    elif policy == "lru":
        r = Replay(traffic, geometry, capacity, rules)
    elif policy in ("resume", "resume-sessions"):
        hints = "sessions" if policy == "resume-sessions" else "pages"
        r = Replay(traffic, geometry, capacity, rules, ResumePointPolicy(lambda: capacity), hints=hints)
    elif policy == "oracle-admission":
        r = Replay(traffic, geometry, capacity, rules, admit=uses.__contains__)
    elif policy == "belady":
        r = Replay(traffic, geometry, capacity, rules, NextUsePolicy(uses), admit=uses.__contains__)
    else:
        raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    r.run()
    return r


Rows = list[dict[str, Any]]


def model_rows(traffic: Traffic, model: str, rules: Rules, sizes: list[float], policies: list[str],
               cpu_pct: float) -> tuple[dict[str, Any], Rows, Rows]:  # fmt: skip
    """One geometry: its bytes and bounds, a row per (size, policy), and the hierarchy rows (a
    cpu tier of ``cpu_pct`` above each larger disk size, resume points)."""
    from hybrid_offload.backends.retention import ResumePointPolicy
    from hybrid_offload.testing.vllm_scheduler import geometry
    from hybrid_offload.tools.bench.trace_model import Geometry, Replay, Rules, unlimited, uses_of

    attention, state = geometry(model)
    geo = Geometry(model, attention, state)
    base = unlimited(traffic, geo, rules)
    uses = uses_of(traffic, base.hit_chunks)
    dense = Rules(rules.interval, rules.step_tokens, dense=True)
    total = unlimited(traffic, geo, dense).outcome.served_tokens  # the most any tier serves
    working_set = traffic.working_set(geo)

    def pct_of_total(served: int) -> float:
        return round(100 * served / total, 2) if total else 0.0

    rows = []
    for pct in sizes:
        capacity = int(working_set * pct / 100)
        for policy in policies:
            started = time.perf_counter()
            r = replay(traffic, geo, capacity, policy, rules, uses)
            rows.append({
                "model": model, "policy": policy, "size_pct": pct, "capacity_bytes": capacity,
                "served_tokens": r.outcome.served_tokens, "served_pct": pct_of_total(r.outcome.served_tokens),
                "hits": r.outcome.hits, "evictions": r.outcome.evictions,
                "seconds": round(time.perf_counter() - started, 2),
            })  # fmt: skip
            logger.info("%s %s %g%%: %.1f%%", model, policy, pct, rows[-1]["served_pct"])
    hierarchy = []
    for pct, promote in ((p, promote) for p in sizes if p > cpu_pct for promote in (False, True)):
        cpu, disk = int(working_set * cpu_pct / 100), int(working_set * pct / 100)
        r = Replay(traffic, geo, cpu, rules, ResumePointPolicy(_fixed(cpu)), hints="pages",
                   lower=[(disk, ResumePointPolicy(_fixed(disk)))], promote=promote)  # fmt: skip
        r.run()
        hierarchy.append({
            "model": model, "cpu_pct": cpu_pct, "disk_pct": pct, "promote": promote,
            "served_pct": pct_of_total(r.outcome.served_tokens),
            "cpu_share_pct": round(100 * r.outcome.served_by[0] / max(1, r.outcome.served_tokens), 2),
        })  # fmt: skip
    info = {
        "attention_bytes_per_token": attention, "state_bytes": state,
        "chunk_bytes": geo.chunk_bytes(traffic.chunk),
        "working_set_bytes": working_set, "unlimited_served_tokens": total,
        "unlimited_served_tokens_our_rules": base.outcome.served_tokens,
    }  # fmt: skip
    return info, rows, hierarchy


def engine_rows(args: argparse.Namespace) -> Rows:
    """The scaled replay through engines of ``--engine`` at each ``--engine-sizes`` (none without)."""
    if args.engine is None:
        return []
    from hybrid_offload.tools.bench.trace_engine import engine_replay

    requests = min(args.engine_requests, 60) if args.quick else args.engine_requests
    rows = []
    for pct in (float(s) for s in args.engine_sizes.split(",")):
        for sessions in (False, True) if args.engine_sessions else (False,):
            row = engine_replay(args.engine, args.trace, requests, args.engine_block, pct, sessions=sessions)
            logger.info("engine replay %g%%%s: engine %.2f%%, simulator %.2f%%, tokens identical: %s", pct,
                        " (session hints)" if sessions else "", row["engine_served_pct"],
                        row["sim_served_pct"], row["identical_tokens"])  # fmt: skip
            rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    from hybrid_offload.tools.bench.trace_file import load_trace
    from hybrid_offload.tools.bench.trace_model import Rules, Traffic

    if not args.trace.is_file():
        raise SystemExit(f"--trace: {args.trace} is not a file (a Mooncake-format JSONL trace, e.g. "
                         "FAST25-release/traces/conversation_trace.jsonl of kvcache-ai/Mooncake)")
    policies = args.policies.split(",")
    for p in policies:
        if p not in POLICIES:
            raise SystemExit(f"--policies: unknown {p!r}; expected some of {', '.join(POLICIES)}")
    limit = QUICK_REQUESTS if args.quick and args.limit is None else args.limit
    traffic = Traffic(load_trace(args.trace, limit=limit))
    rules = Rules(args.interval, args.step_tokens)
    sizes = [float(s) for s in args.sizes.split(",")]
    rows: Rows = []
    hierarchy: Rows = []
    geometries: dict[str, dict[str, Any]] = {}
    for model in args.models.split(","):
        geometries[model], model_table, model_hierarchy = model_rows(traffic, model, rules, sizes, policies,
                                                                     args.hierarchy)  # fmt: skip
        rows += model_table
        hierarchy += model_hierarchy
    engine = engine_rows(args)
    payload = {
        "args": {"trace": str(args.trace), "requests": len(traffic), "sizes_pct": sizes, "policies": policies,
                 "interval": args.interval, "step_tokens": args.step_tokens, "chunk": traffic.chunk},
        "traffic": {"requests": len(traffic), "prompt_tokens": sum(traffic.lengths),
                    "distinct_chunks": traffic.distinct_chunks},
        "geometries": geometries, "rows": rows, "hierarchy": hierarchy, "engine_replay": engine,
    }  # fmt: skip
    path = write_results("trace", payload, args.out, args.quick)
    print(format_table(rows, ["model", "policy", "size_pct", "served_pct", "hits", "evictions", "seconds"]))
    for model in geometries:
        mine = [r for r in rows if r["model"] == model]
        series = {p: [r["served_pct"] for r in mine if r["policy"] == p] for p in policies}
        line_plot(path.with_name(f"{path.stem}-{model}.png"), f"{model}: served tokens, tier full", sizes,
                  series, "tier size (% of the working set)", "% of an unlimited tier's tokens")  # fmt: skip
    print(format_table(hierarchy, ["model", "cpu_pct", "disk_pct", "promote", "served_pct", "cpu_share_pct"]))
    if engine:
        print(format_table(engine, ["model", "requests", "size_pct", "engine_served_pct", "sim_served_pct",
                                    "requests_differing", "identical_tokens"]))  # fmt: skip
    print(f"results: {path}")
    return 0
