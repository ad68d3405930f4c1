"""`hybrid-offload bench e2e`: TTFT and prefill throughput per prompt length and cache scenario.

A random-weight hybrid model (``hybrid_offload.testing.models``) answers prompts of several lengths with
``max_tokens=1``, so the time to first token is the prefill time. Scenarios, each one engine
pass of :mod:`hybrid_offload.testing.session` (one process per engine):

* ``cold``: nothing cached anywhere (engine A, pass 1; it stores into every tier asked for);
* ``vllm``: the same prompts again with vLLM's own prefix cache kept (engine A, pass 2);
* ``cpu``: vLLM's cache reset, our cpu tier loads (engine A, pass 3);
* ``disk``: a new engine process on the same disk directory (a restart), disk tier only;
* ``disk_seg``: the same with the disk backend's segment layout (``layout: segments``);
* ``redis``: a new engine whose only tier is a real loopback redis-server;
* ``nixl_peer``: a new engine whose only tier is a real ``hybrid-offload peer`` process.

Prompts are random token ids, independent per length and repeat, of exactly the target
length: only whole chunks load, the tail after the last chunk boundary is recomputed in every
scenario. Every engine runs one warm-up prompt per length first (stored by the cold pass), and
an engine that loads loads them again in a pass of its own before its measured pass (``warm``,
not reported): a server's first load of each size pays one-time costs (page faults of fresh
staging memory, first calls) that its steady state does not. Bytes moved per request are
computed from the page sizes of the connector's groups (one page per chunk per attention group,
one state page per Mamba/GDN group) and checked against the worker's byte counters per pass.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hybrid_offload.testing.services import start_peer, start_redis_server
from hybrid_offload.tools.bench import e2e_report
from hybrid_offload.tools.bench.e2e_ceilings import KIND as TIER_KIND
from hybrid_offload.tools.bench.e2e_ceilings import load_shape, store_shape
from hybrid_offload.tools.bench.e2e_ceilings import measure as measure_ceiling

logger = logging.getLogger(__name__)

SCENARIOS = ("cold", "vllm", "cpu", "disk", "disk_seg", "redis", "nixl_peer")
#: the unreported pass in which an engine loads the warm-up prompts before its measured pass
WARM = "warm"
FULL = {"layers": 8, "hidden": 256, "lengths": "1024,2048,4096,8192,16384", "repeats": 3,
        "scenarios": ",".join(SCENARIOS)}  # fmt: skip
QUICK = {"layers": 4, "hidden": 256, "lengths": "1024,2048", "repeats": 1, "scenarios": "cold,vllm,cpu,disk"}
TIER_CAPACITY = "1GiB"
VOCAB_LOW = 3  # token ids below are pad / bos / eos


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of this benchmark (defaults depend on ``--quick``; see ``FULL`` and ``QUICK``)."""
    parser.add_argument("--arch", default="qwen3_next", help="model architecture (testing.models)")
    parser.add_argument("--layers", type=int, default=None, help="layers (full 8, quick 4)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (256)")
    parser.add_argument("--lengths", default=None, help="prompt lengths in tokens, comma separated")
    parser.add_argument("--repeats", type=int, default=None, help="prompts per length (median TTFT)")
    parser.add_argument(
        "--scenarios", default=None, help=f"comma separated subset of {','.join(SCENARIOS)} (cold always)"
    )
    parser.add_argument("--model-dir", type=Path, default=None, help="model directory (built if missing)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed")
    parser.add_argument(
        "--tp-shards",
        type=int,
        default=None,
        help="the connector's tp_shards (default: the connector's default)",
    )
    parser.add_argument(
        "--connector",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a kv_connector_extra_config entry for every engine (VALUE parsed as JSON "
        "where it is JSON), e.g. load_switch_interval_s=0.0001; repeatable",
    )


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The effective settings: flags given, else the quick or full defaults. Raises ValueError."""
    base = QUICK if args.quick else FULL
    lengths = [int(x) for x in str(args.lengths or base["lengths"]).split(",") if x.strip()]
    scenarios = [s.strip() for s in str(args.scenarios or base["scenarios"]).split(",") if s.strip()]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown or not lengths or min(lengths) < 2:
        raise ValueError(f"bad --scenarios {unknown} or --lengths {lengths}")
    layers = args.layers or base["layers"]
    hidden = args.hidden or base["hidden"]
    model_dir = args.model_dir or Path(tempfile.gettempdir(), "hybrid-offload-bench-models",
                                       f"{args.arch}-L{layers}-H{hidden}")  # fmt: skip
    return {
        "arch": args.arch,
        "layers": layers,
        "hidden": hidden,
        "lengths": sorted(lengths),
        "repeats": args.repeats or base["repeats"],
        "scenarios": [s for s in SCENARIOS if s in scenarios or s == "cold"],
        "model_dir": str(model_dir),
        "seed": args.seed,
        "tp_shards": args.tp_shards,
        "connector": _connector_options(args.connector),
    }


def _connector_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` flags as a dict (JSON values where they parse). Raises ValueError."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--connector {pair!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def make_prompts(lengths: list[int], repeats: int, seed: int, vocab: int) -> list[list[int]]:
    """``repeats`` rounds over ``lengths``, each prompt independent random ids in [3, vocab)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, vocab) for _ in range(n)] for _ in range(repeats) for n in lengths]


def _ensure_model(settings: dict[str, Any]) -> Path:
    """Build the model once (deterministic bytes, so a cached directory is reused)."""
    from hybrid_offload.testing.models import build_model

    path = Path(settings["model_dir"])
    if not (path / "config.json").exists():
        build_model(settings["arch"], path, layers=settings["layers"], hidden=settings["hidden"])
    return path


def _backend(kind: str, work: Path, urls: dict[str, str]) -> dict[str, Any]:
    """The connector backend entry of tier ``kind`` (named after the scenario)."""
    entry: dict[str, Any] = {"type": TIER_KIND.get(kind, kind), "name": kind, "capacity_bytes": TIER_CAPACITY}
    if kind in ("disk", "disk_seg"):
        entry["path"] = str(work / kind)
        entry["layout"] = "segments" if kind == "disk_seg" else "files"
    elif kind == "redis":
        entry.update(url=urls["redis"], prefix="bench-e2e")
    elif kind == "nixl_peer":
        entry["peers"], entry["insecure"] = [urls["nixl_peer"]], True  # the bench's own peer on loopback
    return entry


def _engine_runs(settings: dict[str, Any]) -> list[tuple[list[str], list[str]]]:
    """(scenario per pass, tiers) of every engine process, in order."""
    tiers = [t for t in ("cpu", "disk", "disk_seg", "redis", "nixl_peer") if t in settings["scenarios"]]
    first = [s for s in ("cold", "vllm") if s in settings["scenarios"]]
    first += [WARM, "cpu"] if "cpu" in settings["scenarios"] else []
    runs = [(first, tiers or ["cpu"])]
    runs += [([WARM, t], [t]) for t in tiers if t != "cpu"]
    return runs


def _resets(passes: list[str]) -> list[str]:
    """Per pass: keep vLLM's cache after the cold pass only when the next pass is ``vllm``."""
    modes = []
    restarted = "cold" not in passes
    for i, scenario in enumerate(passes):
        nxt = passes[i + 1] if i + 1 < len(passes) else None
        modes.append("never" if nxt == "vllm" else "pass")
        if restarted and scenario != WARM:
            modes[-1] = "request"  # a restarted engine: every hit must be the connector's
    return modes


def _run_engine(
    settings: dict[str, Any], prompts: list[list[int]], passes: list[str], tiers: list[str],
    work: Path, urls: dict[str, str],
) -> dict[str, Any]:  # fmt: skip
    """One engine process: ``passes`` over ``prompts`` with the connector on ``tiers``.

    The cold pass starts with one warm-up prompt per length (the same in every engine), dropped
    from its result; a ``warm`` pass runs only them (the engine loads them: one-time costs of
    prefill and of the load path are paid there). The session's own 64-token warm-up is too
    short for that.
    """
    from hybrid_offload.testing.models import VOCAB_SIZE
    from hybrid_offload.testing.session import run_session_subprocess

    warmups = make_prompts(settings["lengths"], 1, settings["seed"] + 1000, VOCAB_SIZE)
    pass_prompts = {"cold": [*warmups, *prompts], WARM: warmups}

    spec = {
        "model": settings["model_dir"],
        "prompts": prompts,
        "pass_prompts": [pass_prompts.get(p, prompts) for p in passes],
        "max_tokens": 1,
        "passes": len(passes),
        "reset_prefix_cache": _resets(passes),
        "connector": {
            "backends": [_backend(t, work, urls) for t in tiers],
            **({"tp_shards": settings["tp_shards"]} if settings.get("tp_shards") else {}),
            **settings.get("connector", {}),
        },
        "llm_kwargs": {"max_model_len": max(settings["lengths"]) + 64},
    }
    started = time.perf_counter()
    result = run_session_subprocess(spec, timeout=1800)
    result["engine_wall_s"] = time.perf_counter() - started
    for scenario, data in zip(passes, result["passes"], strict=True):
        if scenario == "cold":
            rows = data["requests"]
            data["warmups"], data["requests"] = rows[: len(warmups)], rows[len(warmups) :]
    result.pop("log", None)
    return result


def run_scenarios(settings: dict[str, Any], progress: Any = None) -> dict[str, dict[str, Any]]:
    """Run every engine of the plan; per scenario, the session pass and the engine's groups.

    Starts redis-server / the cache peer only when their scenarios are asked for; everything
    started (services, temporary directories) is gone when this returns or raises. After the
    engines, each tier scenario gets the ceiling of its loads (``"ceiling"``) and the cold pass
    the ceiling of each tier's stores (``"store_ceilings"``, see
    :mod:`~hybrid_offload.tools.bench.e2e_ceilings`).
    """
    from hybrid_offload.testing.models import VOCAB_SIZE

    prompts = make_prompts(settings["lengths"], settings["repeats"], settings["seed"], VOCAB_SIZE)
    out: dict[str, dict[str, Any]] = {}
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hybrid-offload-bench-e2e-")))
        urls: dict[str, str] = {}
        if "redis" in settings["scenarios"]:
            redis = start_redis_server(work / "redis", log_name="redis.log", start_timeout_s=30)
            urls["redis"] = stack.enter_context(redis).url
        if "nixl_peer" in settings["scenarios"]:
            urls["nixl_peer"] = stack.enter_context(start_peer(1 << 30)).address
        for passes, tiers in _engine_runs(settings):
            if progress is not None:
                progress.set_description(f"engine {'+'.join(passes)}")
            result = _run_engine(settings, prompts, passes, tiers, work, urls)
            previous: dict[str, Any] = {}
            for scenario, data in zip(passes, result["passes"], strict=True):
                if scenario == WARM:  # not reported: the next pass's counters start after it
                    previous = data["worker_total"]
                    continue
                out[scenario] = {
                    "pass": data,
                    "worker_before": previous,
                    "groups": result["groups"],
                    "chunk_tokens": result["chunk_tokens"],
                    "tiers": tiers,
                    "engine_wall_s": result["engine_wall_s"],
                }
                previous = data["worker_total"]
            if progress is not None:
                progress.update(1)
        if progress is not None:
            progress.set_description("ceilings")
        for scenario, entry in out.items():  # after the engines (the raw NIXL read overwrites the pool)
            shape = None if scenario in e2e_report.NO_TRANSFER else load_shape(e2e_report.measured(entry))
            if shape is not None:
                entry["ceiling"] = measure_ceiling(scenario, shape, work, urls)
        if "cold" in out:  # the cold pass stores into every tier of its engine
            stores = e2e_report.measured(out["cold"])["backends"]
            shapes = {tier: store_shape(stores[tier]) for tier in out["cold"]["tiers"] if tier in stores}
            out["cold"]["store_ceilings"] = {
                tier: measure_ceiling(tier, shape, work, urls, op="store")
                for tier, shape in shapes.items()
                if shape is not None
            }
    return out


def _log_summary(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        logger.info("%s %d tokens: TTFT %.3fs", row["scenario"], row["prompt_tokens"], row["ttft_s"])


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write JSON + PNGs under ``args.out``; 0 on success."""
    from tqdm import tqdm

    from hybrid_offload.tools.bench.common import format_table, write_results

    settings = _settings(args)
    began = time.perf_counter()
    engines = len(_engine_runs(settings))
    with tqdm(total=engines + 1, desc="build model", unit="step") as bar:
        _ensure_model(settings)
        bar.update(1)
        raw = run_scenarios(settings, bar)
    rows = e2e_report.rows(settings, raw)
    _log_summary(rows)
    summaries = e2e_report.scenario_summaries(raw)
    payload: dict[str, Any] = {
        "args": settings,
        "rows": rows,
        "ratios": e2e_report.ratios(rows),
        "in_engine": e2e_report.in_engine(summaries),
        "in_engine_stores": e2e_report.in_engine_stores(raw),
        "scenarios": summaries,
        "wall_s": round(time.perf_counter() - began, 1),
    }
    path = write_results("e2e", payload, out_dir=args.out, quick=args.quick)
    plots = e2e_report.plots(path, rows)
    print(e2e_report.table(rows))
    print("\nloads inside the engine (GB/s) next to the ceiling of the same run; ms per load by phase")
    print(format_table(payload["in_engine"], e2e_report.IN_ENGINE_COLUMNS))
    print("\nstores inside the engine (the cold pass: vLLM's step loop busy) next to the same run's ceiling")
    print(format_table(payload["in_engine_stores"], e2e_report.STORE_COLUMNS))
    print(f"\nwrote {path} and {', '.join(str(p) for p in plots)} ({payload['wall_s']}s)")
    return 0
