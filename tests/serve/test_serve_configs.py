"""Every ready-made config in configs/ serves: ``hybrid-offload serve`` starts vLLM's OpenAI
server with it, requests are answered, and a repeated long prompt is loaded from our tiers.

Stems are discovered at collection (``configs/*.json``): a new config is covered without
editing this file. External services a config names (Redis, a Redis Cluster, NIXL cache
peers, the disk directory) are started here on free ports / temp dirs, and only those fields
are rewritten, in a copy of the config. Per stem:

1. ``/v1/completions`` answers a short text prompt.
2. A long prompt (3 connector chunks and a tail) is sent cold: no external hit.
3. vLLM's own prefix cache is dropped (``POST /reset_prefix_cache``, dev mode, which leaves
   the connector alone), the prompt is sent again: ``vllm:external_prefix_cache_hits``
   grows by exactly the chunk-aligned prefix, ``vllm:prefix_cache_hits`` not at all, and the
   greedy output tokens are identical.
4. ``/metrics`` carries vLLM's connector counters (and ours, once the Prometheus exporter
   lands).
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_runs import CHUNK_TOKENS, VOCAB

from hybrid_offload.core.secrets import create_secret_file
from hybrid_offload.testing.deadlines import wait_until
from hybrid_offload.testing.services import (
    Metrics,
    ServeProcess,
    start_peer,
    start_redis_cluster,
    start_redis_server,
    start_serve,
)
from hybrid_offload.tools.cli.serve import load_config_file

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
STEMS = sorted(p.stem for p in CONFIGS.glob("*.json"))
ARCH = "falcon_h1"  # cheapest tiny hybrid that serves on CPU (attention + Mamba2)
SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # exposes POST /reset_prefix_cache
}
VLLM_ARGS = ["--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "4"]
#: Stems served with vLLM's default CPU executor: the worker in its own process, connector
#: metadata pickled between scheduler and worker (what `make serve` runs). The others run the
#: worker inside EngineCore (uni executor), which saves one ~15 s process start per server.
SEPARATE_WORKER_STEMS = frozenset({"cpu_disk"})
PEER_CAPACITY = 256 << 20
#: vLLM's counters of tokens the connector supplied, and of vLLM's own prefix cache hits
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"
#: ours (hybrid_offload/connector/prometheus.py)
OUR_LOOKUPS = "hybrid_offload_lookups_total"
OUR_LOADED = "hybrid_offload_loaded_tokens_total"
OUR_STORED_PAGES = "hybrid_offload_stored_pages_total"


def test_every_config_is_covered() -> None:
    assert {"cpu", "disk", "cpu_disk", "redis", "cpu_redis", "redis_cluster", "nixl_peer"} <= set(STEMS)
    for stem in STEMS:
        assert (CONFIGS / f"{stem}.yaml").exists(), f"{stem}.json has no .yaml twin"


@pytest.mark.parametrize("stem", STEMS)
def test_yaml_twin_loads_like_json(stem: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # where the shared tiers' secrets are created
    yaml_config = load_config_file(CONFIGS / f"{stem}.yaml", create_secrets=True)
    assert yaml_config == load_config_file(CONFIGS / f"{stem}.json")


# ---- external services, only the fields that name them rewritten ----------------------------


@contextlib.contextmanager
def localized_config(stem: str, tmp_path: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """A copy of ``configs/<stem>.json`` whose services run here; yields (path, config)."""
    config = json.loads((CONFIGS / f"{stem}.json").read_text())
    extra = config["kv_connector_extra_config"]
    if "secret_file" in extra:  # serve creates it (checked here)
        extra["secret_file"] = str(tmp_path / "secrets" / "cache-secret")
    with contextlib.ExitStack() as stack:
        for backend in extra["backends"]:
            _localize_backend(backend, tmp_path, stack)
        path = tmp_path / f"{stem}.json"
        path.write_text(json.dumps(config, indent=2))
        yield path, config


def _localize_backend(backend: dict[str, Any], tmp_path: Path, stack: contextlib.ExitStack) -> None:
    kind = backend["type"]
    name = backend.get("name", kind)
    if kind == "cpu":
        return
    if kind == "disk":
        backend["path"] = str(tmp_path / f"disk-{name}")
    elif kind == "redis":
        server = start_redis_server(tmp_path / f"redis-{name}")
        stack.callback(server.stop)
        backend["url"] = server.url
    elif kind == "redis-cluster":
        cluster = start_redis_cluster(tmp_path / f"cluster-{name}", n=3)
        stack.callback(cluster.stop)
        if "url" in backend:
            backend["url"] = f"redis://{cluster.startup_nodes[0]}"
        if "startup_nodes" in backend:
            backend["startup_nodes"] = list(cluster.startup_nodes)
    elif kind == "nixl_peer":
        backend["token_file"] = str(tmp_path / "secrets" / "peer-token")
        create_secret_file(backend["token_file"])
        token = Path(backend["token_file"]).read_text().strip()
        addresses = []
        for _ in backend["peers"]:
            peer = start_peer(PEER_CAPACITY, token)
            stack.callback(peer.kill)
            addresses.append(peer.address)
        backend["peers"] = addresses
    else:
        raise AssertionError(f"backend type {kind!r}: teach localized_config which fields name a service")


# ---- the server test --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def serve_model(model_dir) -> Path:
    return model_dir(ARCH)


@pytest.fixture(params=STEMS)
def served(request: pytest.FixtureRequest, serve_model: Path, tmp_path: Path) -> Iterator[ServeProcess]:
    """A healthy server for one config stem; its start time goes into the test report."""
    env, args = dict(SERVER_ENV), list(VLLM_ARGS)
    if request.param not in SEPARATE_WORKER_STEMS:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # lets the CPU platform keep the uni executor
        args += ["--distributed-executor-backend", "uni"]
    with localized_config(request.param, tmp_path) as (path, _config):
        server = start_serve(path, serve_model, tmp_path / "logs", env=env, vllm_args=args)
        request.node.user_properties.append(("server_start_s", round(server.startup_s, 1)))
        print(f"server start ({request.param}): {server.startup_s:.1f}s")
        try:
            yield server
        finally:
            server.stop()


def long_prompt(chunk: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(3 * chunk + 20)]


def greedy(server: ServeProcess, prompt: str | list[int], max_tokens: int) -> list[int]:
    reply = server.complete(
        prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, return_token_ids=True
    )
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length", reply
    assert reply["usage"]["completion_tokens"] == max_tokens, reply
    return list(choice["token_ids"])


def settle_stores(server: ServeProcess, backends: set[str], pages: int, timeout: float = 60.0) -> None:
    """Wait until every backend in ``backends`` reports ``pages`` more stored pages.

    Stores are asynchronous (a store thread in the worker), and what the worker did reaches
    the scheduler and ``/metrics`` only with its report on a later engine step; an idle server
    takes no step. So each poll runs one unrelated short request (live traffic does this by
    itself), and one more runs after the counters are there: the scheduler's view of a tier
    private to the worker (``cpu``) travels with the same reports.
    """
    stored: dict[str, float] = {}

    def reported() -> bool:
        greedy(server, [5, 6, 7, 8], max_tokens=1)
        stored.update({b: server.metrics().total(OUR_STORED_PAGES, backend=b) for b in backends})
        return all(n >= pages for n in stored.values())

    wait_until(reported, lambda: f"stores reported ({stored}, want {pages} each)", timeout_s=timeout,
               poll_s=0.2)  # fmt: skip
    greedy(server, [5, 6, 7, 8], max_tokens=1)


def test_config_serves_and_reuses_our_tiers(served: ServeProcess) -> None:
    config = json.loads(served.config.read_text())
    extra = config["kv_connector_extra_config"]
    chunk = extra.get("chunk_tokens") or CHUNK_TOKENS[ARCH]
    backends = {b.get("name", b["type"]) for b in extra["backends"]}
    writable = {b.get("name", b["type"]) for b in extra["backends"] if not b.get("read_only")}
    with served.log_on_failure():
        reply = served.complete("The quick brown fox", max_tokens=4, temperature=0.0, ignore_eos=True)
        assert isinstance(reply["choices"][0]["text"], str) and reply["usage"]["completion_tokens"] == 4

        prompt = long_prompt(chunk, seed=0)
        aligned = (len(prompt) - 1) // chunk * chunk  # the longest chunk-aligned prefix we load
        before = served.metrics()
        cold = greedy(served, prompt, max_tokens=8)
        # ARCH has one attention and one Mamba group: a page per aligned chunk, one state page
        settle_stores(served, writable, pages=aligned // chunk + 1)
        served.reset_prefix_cache()  # vLLM's own cache only (reset_external defaults to false)
        mid = served.metrics()
        cold_hits = mid.total(EXTERNAL_HITS) - before.total(EXTERNAL_HITS)
        assert cold_hits == 0, "the cold request got external hits from empty tiers"
        warm = greedy(served, prompt, max_tokens=8)
        after = served.metrics()

        assert warm == cold
        assert after.total(LOCAL_HITS) == mid.total(LOCAL_HITS), "vLLM's prefix cache was not dropped"
        assert after.total(EXTERNAL_HITS) - mid.total(EXTERNAL_HITS) == aligned
        _check_our_metrics(mid, after, backends, aligned)


def _check_our_metrics(mid: Metrics, after: Metrics, backends: set[str], aligned: int) -> None:
    """Our exporter's counters: lookups counted, the hit's tokens loaded from a configured tier."""
    for name in (OUR_LOOKUPS, OUR_LOADED):
        assert name in after.names(), f"{name} missing from /metrics"
        assert after.label_values(name, "backend") <= backends, after.label_values(name, "backend")
    assert after.total(OUR_LOOKUPS) > mid.total(OUR_LOOKUPS)
    loaded = {b: after.total(OUR_LOADED, backend=b) - mid.total(OUR_LOADED, backend=b) for b in backends}
    assert sum(loaded.values()) == aligned, loaded
