"""`hybrid-offload bench load`: concurrency load against `vllm serve`, by connector configuration.

For each configuration a real OpenAI server is started on a free loopback port
(:mod:`hybrid_offload.testing.services.vllm_server`; ``hybrid-offload serve`` with a generated
config, or plain vLLM for ``none``), and the same seeded workloads are sent by N concurrent streaming clients
(:mod:`hybrid_offload.tools.bench.load_client`):

* ``shared`` at every concurrency: documents and multi-turn chats with repeated long prefixes
  (a new seed per concurrency, the same seeds in every configuration);
* ``distinct`` at one concurrency: nothing shared, 0 % hits: the connector's pure overhead.

Configurations: ``none`` (no connector), ``cpu``, ``cpu+disk``, ``cpu+disk+redis`` (a
redis-server started here), ``restart-disk`` (the ``cpu+disk`` server restarted on the same
disk directory, then the same workloads again: what a restart recovers from disk). vLLM's own
KV cache is kept small (``--kv-cache-mib``) so that the shared working set does not fit in it,
which is the situation an external cache is for.

Per row: req/s and output tok/s over the wall time, TTFT p50/p99, TPOT p50, errors, and hit
rates from ``/metrics`` deltas: external (``vllm:external_prefix_cache_hits_total`` over
``vllm:prompt_tokens_total``), vLLM's own prefix cache, and our tokens loaded per tier
(``hybrid_offload_loaded_tokens_total``). Results go to ``<out>/load[-quick].json`` with PNG
plots next to it; the return code is 1 when any request failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hybrid_offload.testing.services import Metrics, ServeProcess, fetch_metrics, start_redis_server
from hybrid_offload.tools.bench.common import bar_plot, format_table, line_plot, write_results
from hybrid_offload.tools.bench.load_client import (
    WorkloadShape,
    distinct_workload,
    run_load,
    shared_prefix_workload,
    summarize,
)
from hybrid_offload.tools.cli.serve import serve_env

logger = logging.getLogger(__name__)

CONFIGS = ("none", "cpu", "cpu+disk", "cpu+disk+redis", "restart-disk")
QUICK_CONFIGS = ("cpu+disk",)
CONCURRENCY = (10, 50, 200)
#: requests per concurrency level of the shared workload (full run)
REQUESTS = {10: 80, 50: 150, 200: 200}
DISTINCT_CONCURRENCY = 50
QUICK_CONCURRENCY, QUICK_REQUESTS = 4, 12
#: the full run's workload: 16 documents and 16 chats do not fit in the small vLLM cache
FULL_SHAPE = WorkloadShape(docs=16, chats=16)
QUICK_SHAPE = WorkloadShape(docs=2, chats=2)
SERVER_ENV: dict[str, str] = {}
START_TIMEOUT_S = 300.0
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"
LOCAL_QUERIES = "vllm:prefix_cache_queries_total"
OUR_LOADED = "hybrid_offload_loaded_tokens_total"
TABLE_COLUMNS = (
    "config",
    "workload",
    "concurrency",
    "requests",
    "errors",
    "req_per_s",
    "out_tok_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "ext_hit_rate",
    "local_hit_rate",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of this benchmark (``--quick`` and ``--out`` are added by the CLI)."""
    from hybrid_offload.testing.models import ARCHS

    parser.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=None,
        help=f"configurations (default: all; --quick: {' '.join(QUICK_CONFIGS)})",
    )
    parser.add_argument(
        "--concurrency",
        nargs="+",
        type=int,
        default=None,
        help=f"client counts of the shared workload (default: {CONCURRENCY})",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per concurrency level (default: 80/150/200 for 10/50/200)",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--arch", choices=ARCHS, default="falcon_h1", help="embedded tiny model")
    parser.add_argument(
        "--kv-cache-mib",
        type=int,
        default=48,
        help="vLLM's own KV cache (MiB; 48 MiB is ~32k tokens of the tiny falcon_h1)",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="server logs, configs and disk tiers (default: a temp dir)"
    )


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Configurations and (workload, concurrency, requests, seed) steps from the flags."""
    quick = bool(args.quick)
    configs = list(args.configs or (QUICK_CONFIGS if quick else CONFIGS))
    levels = list(args.concurrency or ((QUICK_CONCURRENCY,) if quick else CONCURRENCY))
    steps = []
    for i, c in enumerate(levels):
        n = args.requests or (QUICK_REQUESTS if quick else REQUESTS.get(c, max(c, 100)))
        steps.append({"workload": "shared", "concurrency": c, "requests": max(n, 1), "seed": 100 + i})
    distinct_c = QUICK_CONCURRENCY if quick else DISTINCT_CONCURRENCY
    n = args.requests or (QUICK_REQUESTS if quick else REQUESTS.get(distinct_c, 100))
    steps.append({"workload": "distinct", "concurrency": distinct_c, "requests": n, "seed": 900})
    shape = QUICK_SHAPE if quick else FULL_SHAPE
    return {"configs": configs, "steps": steps, "shape": asdict(shape)}


def backends_for(config: str, workdir: Path, redis_url: str | None) -> list[dict[str, Any]] | None:
    """The ``backends`` list of a configuration (None: no connector).

    Each configuration gets its own disk directory, so none starts with another's pages; the
    ``restart-disk`` server is given ``cpu+disk``'s list (and so its directory).
    """
    if config == "none":
        return None
    tiers: list[dict[str, Any]] = [
        {"type": "cpu", "name": "cpu", "capacity_bytes": "2GiB", "load_weight": 1.0},
    ]
    if "disk" in config:
        tiers.append(
            {
                "type": "disk",
                "name": "disk",
                "path": str(workdir / f"disk-{config.replace('+', '_')}"),
                "capacity_bytes": "8GiB",
                "load_weight": 0.5,
                "fsync": False,
            }
        )
    if "redis" in config:
        assert redis_url is not None
        tiers.append(
            {"type": "redis", "name": "redis", "url": redis_url, "capacity_bytes": "2GiB", "load_weight": 0.8}
        )
    return tiers


def empty_disk_tiers(config: str, workdir: Path) -> None:
    """Remove ``config``'s disk directories: a ``--workdir`` used before holds an earlier run's
    pages, which would be hits (only ``restart-disk`` is meant to find pages)."""
    for tier in backends_for(config, workdir, "redis://unused") or []:
        if tier["type"] == "disk":
            shutil.rmtree(tier["path"], ignore_errors=True)


def _config_file(config: str, workdir: Path, redis_url: str | None) -> Path | None:
    backends = backends_for(config, workdir, redis_url)
    if backends is None:
        return None
    path = workdir / f"{config.replace('+', '_')}.json"
    path.write_text(json.dumps({"backends": backends}, indent=2))
    return path


@contextlib.contextmanager
def _redis_if_needed(configs: list[str], workdir: Path) -> Iterator[str | None]:
    if not any("redis" in c for c in configs):
        yield None
        return
    with start_redis_server(workdir / "redis", log_name="redis.log") as redis:
        yield redis.url


def _warm_up(server: ServeProcess) -> None:
    """One short request, so the first measured one does not pay for lazy initialisation."""
    server.complete([5, 6, 7, 8], max_tokens=2)


def _hit_rates(before: Metrics, after: Metrics) -> dict[str, Any]:
    def delta(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    prompt = delta(PROMPT_TOKENS)
    queries = delta(LOCAL_QUERIES)
    loaded = {tier: delta(OUR_LOADED, backend=tier) for tier in ("cpu", "disk", "redis")}
    return {
        "server_prompt_tokens": int(prompt),
        "ext_hit_tokens": int(delta(EXTERNAL_HITS)),
        "ext_hit_rate": delta(EXTERNAL_HITS) / prompt if prompt else 0.0,
        "local_hit_rate": delta(LOCAL_HITS) / queries if queries else 0.0,
        "loaded_tokens_by_tier": {k: int(v) for k, v in loaded.items() if v},
    }


def run_steps(
    server: ServeProcess, config: str, steps: list[dict[str, Any]], shape: WorkloadShape, max_tokens: int
) -> list[dict[str, Any]]:
    """Every step against one running server; one row per step."""
    rows = []
    for step in steps:
        make = shared_prefix_workload if step["workload"] == "shared" else distinct_workload
        workload = make(step["requests"], step["seed"], shape)
        before = fetch_metrics(server.base_url)
        c = step["concurrency"]
        results, wall = run_load(server.base_url, str(server.model), workload, c, max_tokens)
        time.sleep(0.5)  # let the last stores and metrics land
        row = {"config": config, "workload": step["workload"], "concurrency": step["concurrency"]}
        row.update(summarize(results, wall))
        row.update(_hit_rates(before, fetch_metrics(server.base_url)))
        logger.info("%s", {k: row.get(k) for k in TABLE_COLUMNS})
        rows.append(row)
    return rows


def _serve(
    model: Path, workdir: Path, config: str, config_path: Path | None, args: argparse.Namespace
) -> ServeProcess:
    vllm_args = [
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--kv-cache-memory-bytes",
        str(args.kv_cache_mib << 20),
    ]
    log = workdir / "logs" / f"{config.replace('+', '_')}.log"
    # `hybrid-offload serve`'s environment defaults, also for plain vLLM (a fair baseline)
    env = serve_env({**os.environ, **SERVER_ENV}, vllm_args, model.is_dir())
    return ServeProcess(model, log, config=config_path, env=env, vllm_args=vllm_args)


def run_configs(args: argparse.Namespace, the_plan: dict[str, Any], model: Path, workdir: Path) -> dict:
    """Run every configuration; returns ``{"rows": [...], "startup_s": {config: s}}``."""
    shape = WorkloadShape(**the_plan["shape"])
    rows: list[dict[str, Any]] = []
    startup: dict[str, float] = {}
    configs = the_plan["configs"]
    with _redis_if_needed(configs, workdir) as redis_url:
        for config in configs:
            base = "cpu+disk" if config == "restart-disk" else config
            if config != "restart-disk":
                empty_disk_tiers(config, workdir)
            server = _serve(model, workdir, config, _config_file(base, workdir, redis_url), args)
            began = time.monotonic()
            logger.info("starting the %s server", config)
            server.start(START_TIMEOUT_S)
            startup[config] = round(server.startup_s, 1)
            try:
                _warm_up(server)
                rows += run_steps(server, config, the_plan["steps"], shape, args.max_tokens)
            except BaseException:
                logger.error("server log tail:\n%s", server.log_tail(60))
                raise
            finally:
                server.stop()
            logger.info("%s done in %.1fs", config, time.monotonic() - began)
    return {"rows": rows, "startup_s": startup}


def plots(rows: list[dict[str, Any]], json_path: Path) -> list[Path]:
    """Throughput bars and TTFT p50/p99 lines, PNGs next to ``json_path``."""
    configs = list(dict.fromkeys(r["config"] for r in rows))
    keys = list(dict.fromkeys((r["workload"], r["concurrency"]) for r in rows))

    def value(config: str, key: tuple[str, int], column: str) -> float:
        found = [r[column] for r in rows if (r["config"], r["workload"], r["concurrency"]) == (config, *key)]
        return float(found[0]) if found else float("nan")

    stem = json_path.with_suffix("")
    series = {f"{w} c={c}": [value(cfg, (w, c), "req_per_s") for cfg in configs] for w, c in keys}
    out = [
        bar_plot(
            Path(f"{stem}-throughput.png"), "Load: requests/s by configuration", configs, series, "requests/s"
        )
    ]
    shared = sorted(c for w, c in keys if w == "shared")
    for q in ("p50", "p99"):
        lines = {cfg: [value(cfg, ("shared", c), f"ttft_{q}_ms") for c in shared] for cfg in configs}
        out.append(
            line_plot(
                Path(f"{stem}-ttft_{q}.png"),
                f"Load: TTFT {q}, shared-prefix workload",
                shared,
                lines,
                "concurrent clients",
                f"TTFT {q} (ms)",
            )
        )
    return out


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write JSON and PNGs; 1 if any request failed."""
    from hybrid_offload.tools.cli.serve import embedded_model

    the_plan = plan(args)
    began = time.monotonic()
    model = embedded_model(args.arch)
    owned = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="bench-load-")) if owned else Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        done = run_configs(args, the_plan, model, workdir)
    finally:
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)
    rows = done["rows"]
    settings = {"arch": args.arch, "max_tokens": args.max_tokens, "kv_cache_mib": args.kv_cache_mib}
    settings.update(the_plan)
    payload = {
        "args": settings,
        "rows": rows,
        "startup_s": done["startup_s"],
        "total_s": round(time.monotonic() - began, 1),
    }
    path = write_results("load", payload, out_dir=args.out, quick=args.quick)
    pngs = plots(rows, path)
    print(format_table(rows, TABLE_COLUMNS))
    print(f"server start (s): {done['startup_s']}; total {payload['total_s']}s")
    print(f"wrote {path} and {', '.join(p.name for p in pngs)}")
    return 1 if any(r["errors"] for r in rows) else 0
