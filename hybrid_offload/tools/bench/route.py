"""`hybrid-offload bench route`: routing requests over 3 engines by our KV-events index.

Three ``vllm serve`` engines of a tiny hybrid model (float32 where the arch allows) share ONE
Redis tier (``configs/redis.json`` with the URL of a redis-server started here), each with
vLLM's prefix caching and KV events on. vLLM *connects* its PUB socket to a non-wildcard
endpoint, so every engine gets its own loopback port that the bench's
:class:`~hybrid_offload.router.EventSubscriber` binds (and a replay port that vLLM binds); all
three feed one :class:`~hybrid_offload.router.CacheIndex`: vLLM's own GPU blocks (medium
``GPU``) and, once the connector publishes them, the pages of our Redis tier (``REMOTE``, pooled
across the engines).

Traffic (:func:`.route_traffic.make_users`): users that each hold one session, turns in order,
several users in flight at once (``--concurrency``): ``chat`` users (every turn = the previous prompt + the
generated reply + a new message: :func:`hybrid_offload.tools.bench.traffic.chat`) and ``agent``
users (one system prompt shared by every agent, then the same growing history of replies and
tool outputs). Lengths are drawn from ranges, never aligned to a block or a chunk. Requests go
to ``/v1/completions`` as token ids, streamed (TTFT = send to the first streamed token), with
``return_token_ids`` (the reply goes into the next turn) and the cached prompt tokens from the
usage (``--enable-prompt-tokens-details``).

Routing modes (:class:`.route_traffic.Picker`), run one after another on the same engines and the same seeded
traffic: ``round_robin``; ``index`` (``CacheIndex.route`` over the 3 engines with their requests
in flight as ``load``: the most restorable tokens win, GPU weighted 1.0 and a tier 0.9, ties go
to the least busy); ``sticky`` (crc32 of the user id). Before each mode the engines are made
cold again: Redis flushed (twice, around a wait for late stores), vLLM's prefix caches reset
(``/reset_prefix_cache``, ``VLLM_SERVER_DEV_MODE=1``) and the subscribers switched to a new,
empty index. Each mode's index ingests every event, whichever mode routes.

Per mode: the share of prompt tokens served from caches (the usage's ``cached_tokens``) and,
from ``/metrics`` deltas over the three engines, the split into vLLM's own cache (GPU medium:
``local_cache_hit``) and the connector (``external_kv_transfer``); the reusable share (what
earlier prompts and replies of all users share with a request, floored to the finest grain
any cache serves at: the gcd of vLLM's hash block and the connector's chunk; a bound that no
routing can beat); TTFT mean / p50 / p90; the router's cost per request
(time in ``route()`` including hashing, mean and p99); events ingested per second and the
subscribers' counters (gaps, resyncs); requests per engine. The load average at start and end
is recorded. Results: ``<out>/route[-quick].json``, ``route-served.png`` and ``route-ttft.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_offload.tools.bench.common import format_table, write_results
from hybrid_offload.tools.bench.route_report import (
    TABLE_COLUMNS,
    add_counts,
    chunk_tokens_from_log,
    counters_of,
    hash_block_size_from_log,
    metric_delta,
    plots,
    summarize_mode,
)
from hybrid_offload.tools.bench.route_traffic import (
    MODES,
    QUICK_SHAPE,
    Picker,
    TrafficShape,
    User,
    make_users,
)
from hybrid_offload.tools.bench.traffic import VOCAB_HIGH, VOCAB_LOW, PrefixIndex

logger = logging.getLogger(__name__)

ENGINES = 3
DEFAULT_CONFIG = Path("configs/redis.json")
START_TIMEOUT_S = 420.0
REQUEST_TIMEOUT_S = 900.0
#: seconds without a new event before the engines count as quiet (between modes)
QUIET_S = 1.5
QUIET_MAX_S = 30.0

# ---- the run -----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of this benchmark (``--quick`` and ``--out`` are added by the CLI)."""
    from hybrid_offload.testing.models import ARCHS

    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="routing modes, in order"
    )
    parser.add_argument("--arch", choices=ARCHS, default="falcon_h1", help="embedded tiny model")
    parser.add_argument("--dtype", default=None, help="vLLM --dtype (default: float32; bf16 for qwen3_next)")
    parser.add_argument("--chat-users", type=int, default=None, help="chat users (default 4; --quick 2)")
    parser.add_argument("--agent-users", type=int, default=None, help="agent users (default 4; --quick 2)")
    parser.add_argument("--turns", type=int, default=None, help="turns per user (default 8; --quick 3)")
    parser.add_argument("--reply", type=int, default=None, help="tokens generated per turn (default 48)")
    parser.add_argument("--concurrency", type=int, default=3, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=1, help="traffic seed")
    parser.add_argument("--kv-cache-mib", type=int, default=96, help="vLLM's own KV cache per engine (MiB)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="the shared-tier connector config; its redis URL is replaced")  # fmt: skip
    parser.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment of the engines (repeatable)")  # fmt: skip
    parser.add_argument(
        "--workdir", type=Path, default=None, help="logs, configs, redis (default: a temp dir)"
    )


def shape_from(args: argparse.Namespace) -> TrafficShape:
    base = QUICK_SHAPE if args.quick else TrafficShape()
    changes = {
        k: v
        for k, v in {"chat_users": args.chat_users, "agent_users": args.agent_users, "turns": args.turns,
                     "reply": args.reply}.items()
        if v is not None
    }  # fmt: skip
    return dataclasses.replace(base, **changes)


def connector_config(template: Path, redis_url: str, workdir: Path) -> Path:
    """``template`` (a shipped shared-tier config) with every redis backend's URL replaced by
    ``redis_url`` and the cache secret kept in ``workdir`` (``hybrid-offload serve`` validates it
    and creates the secret); written to ``workdir``."""
    import yaml  # reads the JSON files too

    config = yaml.safe_load(Path(template).read_text())
    extra = config["kv_connector_extra_config"]
    for backend in extra.get("backends") or []:
        if backend.get("type") == "redis":
            backend["url"] = redis_url
    if "secret_file" in extra:
        extra["secret_file"] = str(workdir / "cache-secret")
    path = workdir / f"route-{template.stem}.json"
    path.write_text(json.dumps(config, indent=2))
    return path


@dataclass
class Engine:
    """One engine of the run: its server, its KV events ports and its subscriber."""

    name: str
    server: Any
    events_port: int
    replay_port: int
    subscriber: Any = None


def _engine_env(args: argparse.Namespace, vllm_args: list[str], model: Path) -> dict[str, str]:
    from hybrid_offload.tools.cli.serve import serve_env

    env = serve_env({**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, vllm_args, model.is_dir())
    for item in args.engine_env:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def make_engines(
    args: argparse.Namespace, model: Path, config: Path, workdir: Path, max_len: int
) -> list[Engine]:
    from hybrid_offload.testing.models import BF16_ONLY_ARCHS
    from hybrid_offload.testing.services import ServeProcess
    from hybrid_offload.testing.services.common import free_port

    dtype = args.dtype or ("bfloat16" if args.arch in BF16_ONLY_ARCHS else "float32")
    engines = []
    for i in range(ENGINES):
        events_port, replay_port = free_port(), free_port()
        kv_events = {
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "",
        }  # fmt: skip
        vllm_args = [
            "--enforce-eager", "--dtype", dtype, "--max-model-len", str(max_len),
            "--kv-cache-memory-bytes", str(args.kv_cache_mib << 20), "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv_events),
        ]  # fmt: skip
        env = _engine_env(args, vllm_args, model)
        server = ServeProcess(
            model, workdir / "logs" / f"e{i}.log", config=config, env=env, vllm_args=vllm_args
        )
        engines.append(Engine(f"e{i}", server, events_port, replay_port))
    return engines


def _start_all(engines: Sequence[Engine]) -> None:
    """Start every server at once (threads); the first failure is raised after all returned."""
    errors: list[BaseException] = []

    def start(engine: Engine) -> None:
        try:
            engine.server.start(START_TIMEOUT_S)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(e,), daemon=True) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _events_total(engines: Sequence[Engine]) -> float:
    return sum(counters_of(e.subscriber).get("events", 0) for e in engines)


def wait_quiet(engines: Sequence[Engine], quiet_s: float = QUIET_S, max_s: float = QUIET_MAX_S) -> None:
    """Until no subscriber has ingested a new event for ``quiet_s`` (at most ``max_s``)."""
    deadline = time.monotonic() + max_s
    last, since = _events_total(engines), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = _events_total(engines)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


def make_cold(engines: Sequence[Engine], redis_url: str, index: Any) -> None:
    """Every cache empty again: Redis flushed, vLLM's prefix caches reset, then every subscriber
    feeds ``index`` (a new, empty one: ``reset_engine`` keeps pooled tiers, and the flush removed
    the pool's blocks behind the engines' backs).

    vLLM publishes the ``AllBlocksCleared`` of a reset with its next step, i.e. at the head of
    the next mode's first batch of that engine: it lands in ``index`` before any new block."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        wait_quiet(engines)
        client.flushall()
        for engine in engines:
            engine.server.reset_prefix_cache(timeout=60.0)
        wait_quiet(engines)
        client.flushall()  # stores that landed after the first flush
    finally:
        client.close()
    for engine in engines:
        engine.subscriber.index = index


def _warm_up(engines: Sequence[Engine]) -> None:
    """A few requests per engine (lazy initialisation, first prefill of each size)."""
    rng = random.Random(7)
    for engine in engines:
        for n in (40, 700):
            engine.server.complete([rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)], max_tokens=4)


async def _drive(
    users: list[User], urls: dict[str, str], model: str, picker: Picker, concurrency: int,
    chunk: int, index: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    import aiohttp

    from hybrid_offload.tools.bench.load_client import stream_completion

    gate = asyncio.Semaphore(concurrency)
    seen = PrefixIndex(chunk)
    records: list[dict[str, Any]] = []
    began = time.perf_counter()

    async def session(user: User, http: aiohttp.ClientSession) -> None:
        try:
            wave = next(user.gen)
        except StopIteration:
            return
        turn = 0
        while True:
            (req,) = wave
            prompt = list(req.prompt)
            async with gate:
                engine = picker.pick(user.name, prompt)
                route_s = picker.route_s[-1] if picker.mode == "index" else None
                media: dict[str, int] = {}
                if picker.mode == "index":  # what the index expects the engine to restore
                    media = index.restorable(engine, prompt)
                reusable = seen.reusable(prompt)
                seen.add(prompt)  # a request sent while this one runs may find its prefill
                sent = time.perf_counter() - began
                picker.started(engine)
                try:
                    result = await stream_completion(
                        http, urls[engine] + "/v1/completions", model, user.kind, prompt, req.max_tokens,
                        REQUEST_TIMEOUT_S, {"return_token_ids": True},
                    )  # fmt: skip
                finally:
                    picker.finished(engine)
            seen.add(prompt + result.output_ids)
            record = {
                "user": user.name, "kind": user.kind, "turn": turn, "engine": engine,
                "sent_s": round(sent, 3), "prompt_tokens": len(prompt), "cached_tokens": result.cached_tokens,
                "reusable": reusable,
                "ttft_s": result.ttft_s, "output_tokens": result.output_tokens, "error": result.error,
            }  # fmt: skip
            if route_s is not None:
                record["route_us"] = round(route_s * 1e6, 1)
                record["predicted"] = max(media.values(), default=0)
                record["predicted_by_medium"] = media
            records.append(record)
            if result.error is not None:
                logger.warning("%s turn %d on %s failed: %s", user.name, turn, engine, result.error)
                return
            try:
                wave = user.gen.send([result.output_ids])
            except StopIteration:
                return
            turn += 1

    # a new connection per request: uvicorn closes idle ones after 5 s, and a pooled connection
    # it closed meanwhile fails the next request ("Server disconnected")
    connector = aiohttp.TCPConnector(limit=concurrency * 2, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        await asyncio.gather(*(session(u, http) for u in users))
    return records


def run_mode(
    mode: str, engines: list[Engine], index: Any, shape: TrafficShape, args: argparse.Namespace, chunk: int,
    model: str,
) -> dict[str, Any]:  # fmt: skip
    """One routing mode over cold engines: returns its row (with the request records)."""
    from hybrid_offload.testing.services import fetch_metrics

    names = [e.name for e in engines]
    picker = Picker(mode, names, index)
    users = make_users(shape, args.seed)
    urls = {e.name: e.server.base_url for e in engines}
    load_start = os.getloadavg()
    before = {e.name: fetch_metrics(e.server.base_url) for e in engines}
    counters_before = [counters_of(e.subscriber) for e in engines]
    began = time.perf_counter()
    records = asyncio.run(_drive(users, urls, model, picker, args.concurrency, chunk, index))
    wall = time.perf_counter() - began
    wait_quiet(engines, quiet_s=1.0, max_s=10.0)  # the last stores' events
    after = {e.name: fetch_metrics(e.server.base_url) for e in engines}
    counters_after = [counters_of(e.subscriber) for e in engines]
    metrics = add_counts(metric_delta(before[n], after[n]) for n in names)
    events = add_counts(
        {k: v - b.get(k, 0) for k, v in a.items()}
        for a, b in zip(counters_after, counters_before, strict=True)
    )
    row = summarize_mode(mode, records, picker.route_s, metrics, events, wall)
    row["load_average"] = {
        "start": [round(x, 2) for x in load_start],
        "end": [round(x, 2) for x in os.getloadavg()],
    }
    row["records"] = records
    logger.info("%s", {k: row.get(k) for k in TABLE_COLUMNS})
    return row


@dataclasses.dataclass
class _Run:
    engines: list[Engine]
    index: Any
    redis_url: str
    hash_block_size: int | None
    chunk: int
    startup_s: float


def _open_run(args: argparse.Namespace, model: Path, workdir: Path, redis_url: str, max_len: int) -> _Run:
    """Subscribers bound, servers started and warm, the index configured (caller stops them)."""
    from hybrid_offload.router import CacheIndex, EventSubscriber

    config = connector_config(args.config, redis_url, workdir)
    engines = make_engines(args, model, config, workdir, max_len)
    index = CacheIndex(hash_block_size=None, seed=os.environ.get("PYTHONHASHSEED"))
    for e in engines:
        e.subscriber = EventSubscriber(
            index, e.name, f"tcp://127.0.0.1:{e.events_port}",
            replay_endpoint=f"tcp://127.0.0.1:{e.replay_port}", topic="", bind=True,
        )  # fmt: skip
        e.subscriber.start()
    began = time.monotonic()
    _start_all(engines)
    startup = time.monotonic() - began
    log = engines[0].server.log()
    hash_block = hash_block_size_from_log(log)
    # the finest granularity any cache serves at: vLLM's hash block, the connector's chunk
    grain = math.gcd(hash_block or 0, chunk_tokens_from_log(log) or 0) or 128
    _warm_up(engines)
    wait_quiet(engines)
    learned = index.hash_block_size  # from the warm-up's events
    if hash_block is not None and learned is not None and learned != hash_block:
        raise RuntimeError(f"the index learned hash blocks of {learned} tokens, vLLM logs {hash_block}")
    return _Run(engines, index, redis_url, hash_block or learned, grain, startup)


def fresh_index(run: _Run) -> Any:
    """An empty index that knows the engines' hash block size."""
    from hybrid_offload.router import CacheIndex

    return CacheIndex(hash_block_size=run.hash_block_size, seed=os.environ.get("PYTHONHASHSEED"))


def _close_run(engines: Sequence[Engine]) -> None:
    for e in engines:
        e.server.stop()
    for e in engines:
        if e.subscriber is not None:
            e.subscriber.close()


def run_modes(args: argparse.Namespace, model: Path, workdir: Path, shape: TrafficShape) -> dict[str, Any]:
    from hybrid_offload.testing.services import start_redis_server

    max_len = shape.max_prompt() + shape.reply + 64
    rows = []
    with start_redis_server(workdir / "redis", log_name="redis.log") as redis_server:
        run = _open_run(args, model, workdir, redis_server.url, max_len)
        try:
            for mode in args.modes:
                run.index = fresh_index(run)
                make_cold(run.engines, run.redis_url, run.index)
                logger.info("mode %s", mode)
                rows.append(run_mode(mode, run.engines, run.index, shape, args, run.chunk, str(model)))
        except BaseException:
            for e in run.engines:
                logger.error("%s log tail:\n%s", e.name, e.server.log_tail(40))
            raise
        finally:
            # whole-run counters (start-up and warm-up included: a subscriber that missed the
            # first batches replays them there)
            totals = {e.name: counters_of(e.subscriber) for e in run.engines}
            _close_run(run.engines)
    return {
        "rows": rows,
        "subscribers": totals,
        "startup_s": round(run.startup_s, 1),
        "hash_block_size": run.hash_block_size,
        "reusable_granularity": run.chunk,
        "max_model_len": max_len,
    }


@contextlib.contextmanager
def _workdir(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    path = Path(tempfile.mkdtemp(prefix="bench-route-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    """Run every mode, print the table, write JSON and PNGs; 1 if any request failed."""
    from hybrid_offload.tools.cli.serve import embedded_model

    shape = shape_from(args)
    from hybrid_offload.testing.models import BF16_ONLY_ARCHS

    load_start = os.getloadavg()
    began = time.monotonic()
    model = embedded_model(args.arch)
    with _workdir(args.workdir) as workdir:
        done = run_modes(args, model, workdir, shape)
    rows = done.pop("rows")
    settings = {
        "arch": args.arch, "dtype": args.dtype or ("bfloat16" if args.arch in BF16_ONLY_ARCHS else "float32"),
        "modes": list(args.modes), "engines": ENGINES, "concurrency": args.concurrency, "seed": args.seed,
        "kv_cache_mib": args.kv_cache_mib, "config": str(args.config), "engine_env": list(args.engine_env),
        "shape": dataclasses.asdict(shape),
        "between_modes": "same engines; Redis flushed, vLLM prefix caches reset, index reset",
    }  # fmt: skip
    payload = {
        "args": settings,
        **done,
        "load_average": {
            "start": [round(x, 2) for x in load_start],
            "end": [round(x, 2) for x in os.getloadavg()],
        },
        "rows": rows,
        "total_s": round(time.monotonic() - began, 1),
    }
    path = write_results("route", payload, out_dir=args.out, quick=args.quick)
    pngs = plots(rows, path)
    print(format_table(rows, TABLE_COLUMNS))
    print(f"load average {payload['load_average']}; server start {done['startup_s']}s; "
          f"total {payload['total_s']}s")  # fmt: skip
    print(f"wrote {path} and {', '.join(p.name for p in pngs)}")
    return 1 if any(r["errors"] for r in rows) else 0
