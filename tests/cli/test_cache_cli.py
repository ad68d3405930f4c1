"""``hybrid-offload cache`` on real caches: real page files, a real redis-server, a real peer.

Every test writes real pages (``encode_page``) for two fingerprints through the real backend,
then runs the CLI as a subprocess and checks its output and exit status. The redis server and
the peer are started once per xdist worker (module fixtures; the ``xdist_group`` marks keep
each backend's tests on one worker); tests keep apart by a unique redis prefix, and the peer
is emptied before each test. The peer is a real :class:`PeerServer` in this process on a clock
the tests move, so pages age without sleeping (as redis pages do by RESTORE IDLETIME and disk
pages by their mtimes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from hybrid_offload import FORMAT_VERSION
from hybrid_offload.backends import Backend, BackendConfig, create_backend
from hybrid_offload.core.layer_parts import layers_digest
from hybrid_offload.core.model_card import CardGroup, ModelCard, card_key, encode_card
from hybrid_offload.core.page_format import PageHeader, decode_header, encode_page
from hybrid_offload.core.planner import key_digest
from hybrid_offload.core.spec import GroupKind, TensorSpec
from hybrid_offload.testing.services import (
    RedisServer,
    free_port,
    start_peer,
    start_redis_server,
)

REPO = Path(__file__).resolve().parents[2]
FP_A = "a1" * 16  # a hybrid model: attention group 0, Mamba group 1
FP_B = "b2" * 16  # an attention model stored as two TP-portable shards per page set
MiB = 1 << 20


# -- real pages ---------------------------------------------------------------------------------


def page_key(header: PageHeader) -> str:
    """The key an engine stores the page under (``cache verify`` checks it)."""
    digest = key_digest(header.chunk_hash, header.group_index, header.shard, header.shards,
                        header.layer_start, header.layer_end, header.layers)  # fmt: skip
    return f"{header.fingerprint.hex()}-{digest}"


def make_page(
    fp: str, group: int, chunk: int, shard: int = 0, shards: int = 1, part: int = 0, parts: int = 1
) -> tuple[str, bytes]:
    """A valid page and its key ``<fp>-<digest>``, of a model of 2 decoder layers: in one part
    (``parts`` 1) or two (a PP=2 engine's)."""
    if group == 0:
        heads = 2 // shards
        tensors = tuple(TensorSpec(f"L0.{kv}", (16, heads, 32), "bfloat16") for kv in "kv")
        kind = GroupKind.FULL_ATTENTION
    else:
        tensors = (TensorSpec("L0.conv", (4, 8), "float32"), TensorSpec("L0.ssm", (2, 4, 4), "float32"))
        kind = GroupKind.MAMBA
    seed = f"{fp}/{group}/{chunk}/{part}/{shard}".encode()
    chunk_hash = hashlib.blake2b(f"{fp}/{chunk}".encode(), digest_size=32).digest()  # a set's shards share it
    layers = layers_digest([f"model.layers.{part}.mixer"]) if parts > 1 else bytes(16)
    start, end = (part, part + 1) if parts > 1 else (0, 2)
    header = PageHeader(bytes.fromhex(fp), chunk_hash, group, kind, chunk, 16, tensors, shard, shards, start,
                        end, layers)  # fmt: skip
    payload = random.Random(seed).randbytes(sum(t.nbytes for t in tensors))
    return page_key(header), encode_page(header, payload)


def pages_a() -> dict[str, bytes]:
    return dict(make_page(FP_A, group, chunk) for chunk in range(3) for group in (0, 1))


def pages_b() -> dict[str, bytes]:
    return dict(make_page(FP_B, 0, chunk, shard, 2) for chunk in range(2) for shard in range(2))


def make_card(fp: str, name: str) -> tuple[str, bytes]:
    """A valid model card of ``fp`` (as an engine writes it at start-up) and its key."""
    groups = (CardGroup(0, "full_attention", 1, 1), CardGroup(1, "mamba", 1, 1))
    card = ModelCard(fp, name, None, ("TinyHybrid",), "bfloat16", "auto", 16, groups, FORMAT_VERSION,
                     time.time())  # fmt: skip
    return card_key(fp), encode_card(card)


def flipped(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


# -- the three caches ---------------------------------------------------------------------------


@dataclass
class Cache:
    """A real cache: CLI target arguments, a writer backend, and backend-specific surgery."""

    kind: str
    args: list[str]
    backend: Backend
    corrupt: Callable[[str, bytes], None]  # store a corrupted copy of the page
    make_old: Callable[[list[str]], str]  # age these pages; returns an --older-than that hits them
    extra: dict[str, Any] = field(default_factory=dict)

    def put(self, pages: dict[str, bytes]) -> None:
        assert self.backend.put_batch(list(pages.items())) == [True] * len(pages)


AGED_S = 8 * 86400  # what ``make_old`` ages pages by: ``--older-than 7d`` hits them


@dataclass
class InProcessPeer:
    """A real peer server in this process whose clock (``now``) the tests move."""

    server: Any
    now: list[float]

    @property
    def address(self) -> str:
        return str(self.server.address)


@pytest.fixture(scope="module")
def peer_server() -> Iterator[InProcessPeer]:
    from hybrid_offload.backends.nixl_peer.server import PeerOptions, PeerServer

    now = [1000.0]
    never = 10 * AGED_S  # moving the clock must not expire connections, leases or reservations
    options = PeerOptions(host="127.0.0.1", port=0, capacity_bytes=64 * MiB, lease_timeout_s=never,
                          alloc_timeout_s=never, idle_timeout_s=never, insecure=True)  # fmt: skip
    server = PeerServer(options, clock=lambda: now[0])
    server.start()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield InProcessPeer(server, now)
    finally:
        server.stop()
        thread.join(timeout=60)
        server.close()


def _disk_cache(tmp_path: Path) -> Cache:
    root = tmp_path / "cache"
    backend = create_backend(BackendConfig("disk", "w", 1 << 30, options={"path": str(root)}))

    def page_path(key: str) -> Path:
        namespace, digest = key.split("-")
        return root / namespace / digest[:2] / f"{digest}.page"

    def corrupt(key: str, data: bytes) -> None:
        raw = bytearray(page_path(key).read_bytes())
        raw[-1] ^= 0xFF  # flip a payload byte in place
        page_path(key).write_bytes(bytes(raw))

    def make_old(keys: list[str]) -> str:
        stamp = time.time() - AGED_S
        for key in keys:
            os.utime(page_path(key), (stamp, stamp))
        return "7d"

    return Cache("disk", ["--disk", str(root)], backend, corrupt, make_old, {"root": root})


def _segments_cache(tmp_path: Path) -> Cache:
    root = tmp_path / "cache"
    options = {"path": str(root), "layout": "segments"}
    backend = create_backend(BackendConfig("disk", "w", 1 << 30, options=options))

    def corrupt(key: str, data: bytes) -> None:
        assert backend.put_batch([(key, flipped(data))]) == [True]

    def make_old(keys: list[str]) -> str:
        pytest.skip("segment layout: a page's age is its put in the log, which tests cannot backdate")

    return Cache("disk_seg", ["--disk", str(root)], backend, corrupt, make_old, {"root": root})


def _redis_cache(server: RedisServer) -> Cache:
    prefix = f"cli{uuid.uuid4().hex[:10]}"
    options = {"url": server.url, "prefix": prefix}
    backend = create_backend(BackendConfig("redis", "w", 1 << 30, options=options))
    client = redis.Redis.from_url(server.url)

    def corrupt(key: str, data: bytes) -> None:
        client.set(f"{prefix}:p:{key}", flipped(data))

    def make_old(keys: list[str]) -> str:
        for key in keys:  # the server's idle time of a key is its LRU clock: set it, keep the TTL
            name = f"{prefix}:p:{key}"
            ttl = client.pttl(name)
            client.restore(name, max(ttl, 0), client.dump(name), replace=True, idletime=AGED_S)
        return "7d"

    return Cache("redis", ["--redis", server.url, "--redis-prefix", prefix], backend, corrupt, make_old,
                 {"client": client, "prefix": prefix})  # fmt: skip


def _peer_cache(peer: InProcessPeer) -> Cache:
    options = {"peers": [peer.address], "timeout_s": 5.0, "insecure": True}
    backend = create_backend(BackendConfig("nixl_peer", "w", 1 << 30, options=options))
    backend.delete_batch([info.key for info in backend.scan()])  # the peer is shared by the module

    def corrupt(key: str, data: bytes) -> None:
        assert backend.put_batch([(key, flipped(data))]) == [True]

    def make_old(keys: list[str]) -> str:
        peer.now[0] += AGED_S  # every page on the peer ages: callers put the young ones after
        return "7d"

    return Cache("nixl_peer", ["--peer", peer.address, "--peer-insecure"], backend, corrupt, make_old)


@pytest.fixture(
    params=[
        "disk",
        "disk_seg",
        pytest.param("redis", marks=pytest.mark.xdist_group("cache-cli-redis")),
        pytest.param("nixl_peer", marks=pytest.mark.xdist_group("cache-cli-peer")),
    ]
)
def cache(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cache]:
    if request.param == "disk":
        made = _disk_cache(tmp_path)
    elif request.param == "disk_seg":
        made = _segments_cache(tmp_path)
    elif request.param == "redis":
        made = _redis_cache(request.getfixturevalue("redis_server"))
    else:
        made = _peer_cache(request.getfixturevalue("peer_server"))
    try:
        yield made
    finally:
        made.backend.close()
        if "client" in made.extra:
            made.extra["client"].close()


def cli(*args: str, check: int | None = 0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m hybrid_offload cache ARGS``; assert the exit status ``check``."""
    result = subprocess.run(
        [sys.executable, "-m", "hybrid_offload", "cache", *args],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    if check is not None:
        assert result.returncode == check, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def cli_json(*args: str, check: int = 0) -> Any:
    return json.loads(cli(*args, "--json", check=check).stdout)


def sizes(pages: dict[str, bytes]) -> int:
    return sum(map(len, pages.values()))


# -- per backend --------------------------------------------------------------------------------


def test_ls_counts_pages_and_bytes_per_fingerprint(cache: Cache) -> None:
    a, b = pages_a(), pages_b()
    cache.put({**a, **b})
    listing = cli_json("ls", *cache.args)
    rows = {row["fingerprint"]: row for row in listing["fingerprints"]}
    assert set(rows) == {FP_A, FP_B}
    assert (rows[FP_A]["pages"], rows[FP_A]["bytes"]) == (6, sizes(a))
    assert (rows[FP_B]["pages"], rows[FP_B]["bytes"]) == (4, sizes(b))
    assert listing["total"] == {"fingerprints": 2, "pages": 10, "bytes": sizes(a) + sizes(b)}
    for row in rows.values():
        assert 0 <= row["oldest_age_s"] < 120 and 0 <= row["newest_age_s"] <= row["oldest_age_s"]
    text = cli("ls", *cache.args).stdout
    line_a = next(line for line in text.splitlines() if line.startswith(FP_A))
    assert line_a.split()[1:3] == ["6", str(sizes(a))]
    assert f"total: 2 fingerprints, 10 pages, {sizes(a) + sizes(b)} bytes" in text
    only_b = cli_json("ls", *cache.args, "--fingerprint", FP_B)
    assert [row["fingerprint"] for row in only_b["fingerprints"]] == [FP_B]


def test_inspect_prints_header_fields_and_tensor_table(cache: Cache) -> None:
    b = pages_b()
    cache.put({**pages_a(), **b})
    key, data = make_page(FP_B, 0, 1, shard=1, shards=2)
    info = cli_json("inspect", *cache.args, key)
    assert info["valid"] and info["header_checksum"] == "ok" and info["payload_checksum"] == "ok"
    assert info["fingerprint"] == FP_B and info["fingerprint_matches_key"]
    fields = ("group_index", "kind", "chunk_index", "num_tokens", "shard", "shards", "size")
    assert [info[f] for f in fields] == [0, "full_attention", 1, 16, 1, 2, len(data)]
    tensor = {"shape": [16, 1, 32], "dtype": "bfloat16", "bytes": 1024}
    assert info["tensors"] == [{"index": 0, **tensor}, {"index": 1, **tensor}]
    assert info["header_len"] + info["payload_len"] == len(data)
    text = cli("inspect", *cache.args, key).stdout
    lines = [line.split() for line in text.splitlines()]
    expected = [
        ["kind", "full_attention"],
        ["shards", "2"],
        ["chunk_hash", info["chunk_hash"]],
        ["1", "(16,", "1,", "32)", "bfloat16", "1024"],  # tensor table row
        ["payload_checksum", "ok"],
        ["valid", "yes"],
    ]
    for line in expected:
        assert line in lines, text
    first = cli_json("inspect", *cache.args, "--fingerprint", FP_B, "--first")
    assert first["key"] == min(b)
    cache.corrupt(key, data)
    bad = cli_json("inspect", *cache.args, key, check=1)
    assert not bad["valid"] and "checksum" in bad["payload_checksum"]


def test_verify_clean_then_corrupt_then_delete_bad(cache: Cache) -> None:
    a, b = pages_a(), pages_b()
    cache.put({**a, **b})
    clean = cli("verify", *cache.args, "--progress")
    assert f"verified 10 pages ({sizes(a) + sizes(b)} bytes): 10 ok, 0 corrupt" in clean.stdout
    assert "verified 10/10 pages" in clean.stderr
    victim = sorted(b)[2]
    cache.corrupt(victim, b[victim])
    found = cli("verify", *cache.args, check=1)
    assert f"corrupt {victim}: payload checksum mismatch" in found.stdout
    assert "9 ok, 1 corrupt" in found.stdout
    assert cli_json("verify", *cache.args, "--fingerprint", FP_A)["corrupt"] == 0  # A alone is clean
    deleted = cli_json("verify", *cache.args, "--delete-bad", check=1)
    assert (deleted["corrupt"], deleted["deleted"]) == (1, 1)
    assert deleted["corrupt_pages"][0]["key"] == victim
    assert cli_json("verify", *cache.args)["ok"] == 9
    assert cache.backend.contains_batch([victim]) == [False]


def test_gc_by_fingerprint_dry_run_then_for_real(cache: Cache) -> None:
    a, b = pages_a(), pages_b()
    cache.put({**a, **b})
    dry = cli("gc", *cache.args, "--fingerprint", FP_B, "--dry-run")
    assert f"would delete 4 pages ({sizes(b)} bytes" in dry.stdout
    assert cache.backend.contains_batch(list(b)) == [True] * 4
    done = cli_json("gc", *cache.args, "--fingerprint", FP_B)
    assert (done["deleted_pages"], done["selected_bytes"], done["kept_pages"]) == (4, sizes(b), 0)
    assert done["by_fingerprint"] == {FP_B: {"pages": 4, "bytes": sizes(b)}}
    assert cache.backend.contains_batch(list(b)) == [False] * 4
    assert [row["fingerprint"] for row in cli_json("ls", *cache.args)["fingerprints"]] == [FP_A]


def test_gc_by_age_and_max_bytes_evicts_oldest_first(cache: Cache) -> None:
    a, b = pages_a(), pages_b()
    cache.put(a)
    threshold = cache.make_old(list(a))
    cache.put(b)
    assert all(cache.backend.get_batch(list(b)))  # B was just used: only A is older than threshold
    dry = cli_json("gc", *cache.args, "--older-than", threshold, "--dry-run")
    assert (dry["selected_pages"], dry["deleted_pages"]) == (6, 0)
    assert set(dry["by_fingerprint"]) == {FP_A}
    one = cli_json("gc", *cache.args, "--max-bytes", str(sizes(a) + sizes(b) - 1))
    assert one["deleted_pages"] == 1 and set(one["by_fingerprint"]) == {FP_A}
    assert all(cache.backend.get_batch(list(b)))
    rest = cli("gc", *cache.args, "--older-than", threshold)
    assert "deleted 5 pages" in rest.stdout and "kept 4 pages" in rest.stdout
    listing = cli_json("ls", *cache.args)["fingerprints"]
    assert {row["fingerprint"]: row["pages"] for row in listing} == {FP_B: 4}
    page_b = len(next(iter(b.values())))  # 2048 payload bytes + header
    assert page_b > 2048 and 2 * page_b < 5 * 1024
    kib = cli_json("gc", *cache.args, "--max-bytes", "5KiB")  # of 4 pages 2 fit in 5 KiB
    assert kib["deleted_pages"] == 2 and kib["kept_bytes"] == 2 * page_b


def test_stats_per_fingerprint_and_group(cache: Cache) -> None:
    a, b = pages_a(), pages_b()
    cache.put({**a, **b})
    stats = cli_json("stats", *cache.args)
    by_fp = {fp["fingerprint"]: fp for fp in stats["fingerprints"]}
    groups_a = [(g["group_index"], g["kind"], g["pages"], g["shards"]) for g in by_fp[FP_A]["groups"]]
    assert groups_a == [(0, "full_attention", 3, [[0, 1]]), (1, "mamba", 3, [[0, 1]])]
    assert sum(g["bytes"] for g in by_fp[FP_A]["groups"]) == by_fp[FP_A]["bytes"] == sizes(a)
    [group_b] = by_fp[FP_B]["groups"]
    assert (group_b["pages"], group_b["bytes"], group_b["shards"]) == (4, sizes(b), [[0, 2], [1, 2]])
    sets = [(g["sets_complete"], g["sets_incomplete"]) for fp in (FP_A, FP_B) for g in by_fp[fp]["groups"]]
    assert sets == [(3, 0), (3, 0), (2, 0)]
    assert stats["unreadable"] == [] and stats["vanished"] == 0
    text = cli("stats", *cache.args, "--fingerprint", FP_B).stdout
    row = next(line for line in text.splitlines() if line.startswith(FP_B))
    assert row.split() == [FP_B, "0", "full_attention", "4", str(sizes(b)), "2/2", "0-2", "0-1/2"]
    assert FP_A not in text and "page sets lack" not in text


def test_stats_and_verify_count_page_sets_that_lack_a_shard(cache: Cache) -> None:
    """A page set loads only whole: one shard evicted or corrupt leaves the others useless."""
    b = pages_b()
    cache.put(b)
    lost, damaged = (key for key, data in b.items() if decode_header(data)[0].shard == 1)
    cache.backend.delete_batch([lost])
    cache.corrupt(damaged, b[damaged])
    stats = cli_json("stats", *cache.args)
    [group] = stats["fingerprints"][0]["groups"]
    assert (group["pages"], group["sets_complete"], group["sets_incomplete"]) == (3, 1, 1)  # headers only
    assert "1 page sets lack a layer part or shard" in cli("stats", *cache.args).stdout
    report = cli_json("verify", *cache.args, check=1)
    counts = ("ok", "corrupt", "sets_complete", "sets_incomplete")
    assert [report[k] for k in counts] == [2, 1, 0, 2]
    text = cli("verify", *cache.args, check=1).stdout
    assert "page sets of the ok pages: 0 complete, 2 lacking a layer part or shard" in text


def test_stats_and_verify_count_page_sets_that_lack_a_pipeline_stages_part(cache: Cache) -> None:
    """Pages written by the two stages of a PP=2 engine (two layer parts): one stage's page of
    chunk 1 was never stored. The parts a group has are those some set of it has."""
    pages = dict(make_page(FP_B, 1, chunk, part=part, parts=2) for chunk in range(3) for part in range(2))
    lost = next(k for k, data in pages.items() if decode_header(data)[0].chunk_index == 1)
    del pages[lost]
    cache.put(pages)
    [group] = cli_json("stats", *cache.args)["fingerprints"][0]["groups"]
    assert (group["parts"], group["sets_complete"], group["sets_incomplete"]) == ([[0, 1], [1, 2]], 2, 1)
    assert cli("stats", *cache.args).stdout.split("\n")[1].split()[5:7] == ["2/3", "0-1,1-2"]
    part = next(k for k, data in pages.items() if decode_header(data)[0].layer_start == 1)
    described = cli_json("inspect", *cache.args, part)
    assert (described["decoder_layers"], described["valid"]) == ([1, 2], True)
    assert described["layers_digest"] == layers_digest(["model.layers.1.mixer"]).hex()
    report = cli_json("verify", *cache.args)  # every page under its own key, layers and part included
    assert [report[k] for k in ("ok", "corrupt", "sets_complete", "sets_incomplete")] == [5, 0, 2, 1]


def big_page(fp: str, chunk: int, tokens: int = 1024) -> tuple[str, bytes]:
    """A valid attention page of 2 x (tokens, 8, 64) bfloat16 (2 MiB for 1024 tokens)."""
    tensors = tuple(TensorSpec(f"L0.{kv}", (tokens, 8, 64), "bfloat16") for kv in "kv")
    seed = f"{fp}/big/{chunk}".encode()
    header = PageHeader(bytes.fromhex(fp), hashlib.blake2b(seed, digest_size=32).digest(), 0,
                        GroupKind.FULL_ATTENTION, chunk, tokens, tensors, 0, 1)  # fmt: skip
    payload = random.Random(seed).randbytes(sum(t.nbytes for t in tensors))
    return page_key(header), encode_page(header, payload)


def server_sent_bytes(cache: Cache) -> int:
    return int(cache.extra["client"].info("stats")["total_net_output_bytes"])


def test_pages_larger_than_the_cap_are_refused_not_read(cache: Cache) -> None:
    """A value larger than ``--max-page-bytes`` (default 1 GiB) is reported, never loaded: verify
    and stats list it as too large (verify exits 1, it could not check it; --delete-bad leaves
    it), inspect refuses it."""
    a = pages_a()
    huge_key, huge = big_page(FP_A, 99, tokens=1536)  # a valid 3 MiB page
    cache.put({**a, huge_key: huge})
    sent = server_sent_bytes(cache) if cache.kind == "redis" else 0
    found = cli_json("verify", *cache.args, "--max-page-bytes", "1MiB", "--delete-bad", check=1)
    assert (found["ok"], found["corrupt"], found["deleted"]) == (6, 0, 0)
    assert found["too_large"] == [{"key": huge_key, "size": len(huge)}]
    if cache.kind == "redis":
        assert server_sent_bytes(cache) - sent < sizes(a) + 256 * 1024
    text = cli("verify", *cache.args, "--max-page-bytes", "1MiB", check=1).stdout
    assert f"too large {huge_key}: {len(huge)} bytes > --max-page-bytes {MiB}" in text
    refused = cli("inspect", *cache.args, huge_key, "--max-page-bytes", "1MiB", check=2)
    assert "--max-page-bytes" in refused.stderr
    assert cli_json("verify", *cache.args)["ok"] == 7  # the default cap (1 GiB) reads it
    assert cache.backend.contains_batch([huge_key]) == [True]
    stats = cli_json("stats", *cache.args, "--max-page-bytes", "1MiB")
    assert stats["too_large"] == [{"key": huge_key, "size": len(huge)}]
    [group0] = [g for g in stats["fingerprints"][0]["groups"] if g["group_index"] == 0]
    assert (group0["pages"], group0["bytes"]) == (3, sum(len(make_page(FP_A, 0, c)[1]) for c in range(3)))


def test_stats_reads_page_headers_only(cache: Cache) -> None:
    """stats needs the header of each page: redis sends only those bytes (GETRANGE), not the
    2 MiB pages; page bytes come from the listing."""
    pages = dict(big_page(FP_B, c) for c in range(4))
    cache.put(pages)
    sent = server_sent_bytes(cache) if cache.kind == "redis" else 0
    stats = cli_json("stats", *cache.args)
    [fp] = stats["fingerprints"]
    assert (fp["pages"], fp["bytes"]) == (4, sizes(pages))
    assert fp["groups"] == [{"group_index": 0, "kind": "full_attention", "pages": 4, "bytes": sizes(pages),
                             "shards": [[0, 1]], "parts": [[0, 0]], "sets_complete": 4,
                             "sets_incomplete": 0}]  # fmt: skip
    assert stats["unreadable"] == [] and stats["vanished"] == 0
    if cache.kind == "redis":
        assert server_sent_bytes(cache) - sent < 256 * 1024 < sizes(pages)


# -- model cards --------------------------------------------------------------------------------

FP_C = "c3" * 16  # a model that wrote its card but no pages yet


def test_model_cards_name_the_models_and_are_not_pages(cache: Cache) -> None:
    a, b = pages_a(), pages_b()
    (key_a, card_a), (key_c, card_c) = make_card(FP_A, "org/hybrid-a"), make_card(FP_C, "/models/c")
    cache.put({**a, **b, key_a: card_a, key_c: card_c})
    listing = cli_json("ls", *cache.args)
    rows = {row["fingerprint"]: row for row in listing["fingerprints"]}
    assert {fp: (row["pages"], row["bytes"], row["model"]) for fp, row in rows.items()} == {
        FP_A: (6, sizes(a), "org/hybrid-a"), FP_B: (4, sizes(b), None), FP_C: (0, 0, "/models/c")}
    card = rows[FP_A]["card"]
    assert (card["fingerprint"], card["chunk_tokens"], card["architectures"]) == (FP_A, 16, ["TinyHybrid"])
    assert card["groups"] == [{"index": 0, "kind": "full_attention", "layers": 1, "shards": 1},
                              {"index": 1, "kind": "mamba", "layers": 1, "shards": 1}]  # fmt: skip
    assert rows[FP_B]["card"] is None and listing["total"]["pages"] == 10
    text = cli("ls", *cache.args).stdout.splitlines()
    assert text[0].split()[-1] == "MODEL"
    assert {line.split()[0]: line.split()[-1] for line in text[1:-1]} == {
        FP_A: "org/hybrid-a", FP_B: "?", FP_C: "/models/c"}

    info = cli_json("inspect", *cache.args, key_a)
    assert (info["type"], info["name"], info["valid"], info["fingerprint_matches_key"]) == (
        "model card", "org/hybrid-a", True, True)
    lines = [line.split() for line in cli("inspect", *cache.args, key_a).stdout.splitlines()]
    assert ["name", "org/hybrid-a"] in lines and ["1", "mamba", "1", "1"] in lines, lines
    assert cli_json("inspect", *cache.args, "--fingerprint", FP_A, "--first")["key"] == min(a)  # a page

    verified = cli_json("verify", *cache.args)
    counts = ("pages", "bytes", "ok", "corrupt", "cards", "cards_ok", "cards_corrupt")
    assert [verified[k] for k in counts] == [10, sizes(a) + sizes(b), 10, 0, 2, 2, 0]
    assert "verified 2 model cards: 2 ok, 0 corrupt" in cli("verify", *cache.args).stdout

    stats = cli_json("stats", *cache.args)
    by_fp = {fp["fingerprint"]: fp for fp in stats["fingerprints"]}
    assert {fp: (e["model"], e["pages"], len(e["groups"])) for fp, e in by_fp.items()} == {
        FP_A: ("org/hybrid-a", 6, 2), FP_B: (None, 4, 1), FP_C: ("/models/c", 0, 0)}
    assert stats["unreadable"] == []
    text = cli("stats", *cache.args).stdout.splitlines()
    assert f"{FP_A} all 6 {sizes(a)} model: org/hybrid-a" in [" ".join(line.split()) for line in text]


def test_verify_counts_a_corrupted_card_as_corrupt(cache: Cache) -> None:
    a = pages_a()
    key, card = make_card(FP_A, "org/hybrid-a")
    cache.put({**a, key: card})
    cache.corrupt(key, card)
    found = cli("verify", *cache.args, check=1)
    assert f"corrupt model card {key}: model card checksum mismatch" in found.stdout
    assert "verified 6 pages" in found.stdout and "1 model cards: 0 ok, 1 corrupt" in found.stdout
    report = cli_json("verify", *cache.args, check=1)
    assert (report["ok"], report["corrupt"], report["cards_corrupt"]) == (6, 0, 1)
    error = "model card checksum mismatch"
    assert report["corrupt_pages"] == [{"key": key, "size": len(card), "error": error, "card": True}]
    assert [row["model"] for row in cli_json("ls", *cache.args)["fingerprints"]] == [None]  # not trusted
    assert [u["key"] for u in cli_json("stats", *cache.args)["unreadable"]] == [key]
    assert cli_json("inspect", *cache.args, key, check=1)["valid"] is False
    assert cli_json("verify", *cache.args, "--delete-bad", check=1)["deleted"] == 1
    assert cache.backend.contains_batch([key]) == [False]
    assert cli_json("verify", *cache.args)["cards"] == 0


def test_gc_by_fingerprint_removes_the_card(cache: Cache) -> None:
    a, b = pages_a(), pages_b()
    cards = dict([make_card(FP_A, "org/hybrid-a"), make_card(FP_B, "org/attn-b")])
    cache.put({**a, **b, **cards})
    done = cli_json("gc", *cache.args, "--fingerprint", FP_B)
    assert (done["deleted_pages"], done["selected_cards"], done["kept_pages"]) == (5, 1, 0)
    assert cache.backend.contains_batch([card_key(FP_B), card_key(FP_A)]) == [False, True]
    listing = cli_json("ls", *cache.args)["fingerprints"]
    assert [(row["fingerprint"], row["model"], row["pages"]) for row in listing] == [
        (FP_A, "org/hybrid-a", 6)
    ]
    everything = cli("gc", *cache.args, "--max-bytes", "0")  # by size: a card goes like a page
    assert "deleted 7 pages" in everything.stdout and "1 of them model cards" in everything.stdout
    assert cli_json("ls", *cache.args)["fingerprints"] == []


# -- disk, redis specifics ----------------------------------------------------------------------


def test_disk_gc_and_verify_leave_foreign_files_and_mtimes(tmp_path: Path) -> None:
    cache = _disk_cache(tmp_path)
    root = cache.extra["root"]
    with cache.backend:
        a = pages_a()
        cache.put(a)
        cache.make_old(list(a))
    ns_dir = root / FP_A
    fan_dir = next(p for p in ns_dir.iterdir() if p.is_dir())
    foreign = [root / "README.txt", ns_dir / "notes", fan_dir / "zz.page", fan_dir / "x.page.bak"]
    live_tmp = fan_dir / f".{'0' * 32}.{os.getpid()}.abcdef.tmp"  # a live writer's temp file
    for path in [*foreign, live_tmp]:
        path.write_bytes(b"not a page")
    before = {p: p.stat().st_mtime for p in root.rglob("*.page")}
    assert cli_json("verify", "--disk", str(root))["ok"] == 6
    assert {p: p.stat().st_mtime for p in root.rglob("*.page")} == before, "reads must not touch mtimes"
    assert cli_json("gc", "--disk", str(root), "--max-bytes", "0")["deleted_pages"] == 6
    assert all(p.read_bytes() == b"not a page" for p in [*foreign, live_tmp])
    assert cli_json("ls", "--disk", str(root))["total"]["pages"] == 0


def test_verify_flags_a_valid_page_under_another_fingerprint(tmp_path: Path) -> None:
    cache = _disk_cache(tmp_path)
    key_a, data_a = make_page(FP_A, 0, 0)
    stolen = f"{FP_B}-{key_a.split('-')[1]}"
    with cache.backend:
        cache.put({key_a: data_a, stolen: data_a})
    result = cli("verify", *cache.args, check=1)
    assert f"corrupt {stolen}: header fingerprint {FP_A} is not the key's namespace {FP_B}" in result.stdout
    info = cli_json("inspect", *cache.args, stolen, check=1)
    assert info["payload_checksum"] == "ok" and not info["fingerprint_matches_key"] and not info["valid"]


@pytest.mark.xdist_group("cache-cli-redis")
def test_redis_gc_never_touches_other_keys(redis_server: RedisServer, tmp_path: Path) -> None:
    cache = _redis_cache(redis_server)
    client, prefix = cache.extra["client"], cache.extra["prefix"]
    others = {f"{prefix}:p:not-a-page": b"1", f"{prefix}x:p:{FP_A}-{'0' * 32}": b"2", "unrelated": b"3"}
    try:
        cache.put(pages_a())
        for name, value in others.items():
            client.set(name, value)
        assert cli_json("gc", *cache.args, "--max-bytes", "0")["deleted_pages"] == 6
        assert {name: client.get(name) for name in others} == others
        assert cache.backend.used_bytes() == 0
    finally:
        client.delete(*others)
        cache.backend.close()
        client.close()


# -- choosing the target; bad input ------------------------------------------------------------


def test_config_name_and_backend_config_targets(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    cache = _disk_cache(tmp_path)
    with cache.backend:
        cache.put(pages_b())
    config = tmp_path / "serve.yaml"
    config.write_text(
        "kv_connector: HybridOffloadConnector\nkv_connector_module_path: hybrid_offload.connector\n"
        "kv_role: kv_both\nkv_connector_extra_config:\n  backends:\n"
        "  - {type: cpu, name: cpu}\n"
        f"  - {{type: disk, name: mydisk, path: '{root}', capacity_bytes: 1KiB}}\n"
    )
    listing = cli_json("ls", "--config", str(config), "--name", "mydisk")
    assert listing["backend"] == {"type": "disk", "name": "mydisk"} and listing["total"]["pages"] == 4
    entry = tmp_path / "one.json"
    entry.write_text(json.dumps({"type": "disk", "name": "d", "path": str(root), "capacity_bytes": 1}))
    assert cli_json("verify", "--backend-config", str(entry))["ok"] == 4  # opening never evicts
    wrong = cli("ls", "--config", str(config), "--name", "nope", check=2)
    assert "no backend named 'nope' (backends: 'cpu', 'mydisk')" in wrong.stderr
    cpu = cli("ls", "--config", str(config), "--name", "cpu", check=2)  # in-process: nothing to list
    assert "lives inside the engine's worker process" in cpu.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([], "one of the arguments --disk --redis --peer --backend-config --config is required"),
        (["--disk", "/x", "--redis", "redis://h:1/0"], "not allowed with argument"),
        (["--disk", "{missing}"], "is not a directory"),
        (["--name", "x", "--disk", "{tmp}"], "--name picks a backend of --config"),
        (["--config", "{tmp}/none.yaml", "--name", "x"], "cannot read config"),
        (["--backend-config", "{tmp}/bad.yaml"], "backend: backend type 'disk': option 'path' is required"),
        (["--redis", "http://127.0.0.1:1/0"], "option 'url': scheme must be one of"),
        (["--redis", "redis://:hunter2@127.0.0.1:1/0"], "'redis://:***@127.0.0.1:1/0' holds a password"),
        (["--peer", "nohost"], "'peers': peer address must be 'host:port'"),
        (["--disk", "{tmp}", "--fingerprint", "xyz"], "want a fingerprint of 8-64 hex digits"),
    ],
)
def test_bad_input_exits_2_naming_the_problem(tmp_path: Path, args: list[str], needle: str) -> None:
    (tmp_path / "bad.yaml").write_text("type: disk\n")
    args = [a.format(tmp=tmp_path, missing=tmp_path / "missing") for a in args]
    result = cli("ls", *args, check=2)
    assert needle in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("action", "needle"),
    [
        (["gc"], "gc needs --older-than, --max-bytes and/or --fingerprint"),
        (["gc", "--older-than", "7 days"], "want a duration like 90s, 30m, 12h or 7d"),
        (["gc", "--max-bytes", "lots"], "want a size like 1234, 500MB or 10GiB"),
        (["inspect"], "give a page KEY, or --fingerprint FP --first"),
        (["inspect", "../etc/passwd"], "invalid page key"),
        (["inspect", f"{FP_A}-{'0' * 32}"], "no page"),
        (["verify", "--max-page-bytes", "lots"], "want a size like 1234, 500MB or 10GiB"),
    ],
)
def test_bad_action_arguments_exit_2(tmp_path: Path, action: list[str], needle: str) -> None:
    result = cli(action[0], "--disk", str(tmp_path), *action[1:], check=2)
    assert needle in result.stderr, result.stderr


def test_unreachable_backends_exit_3(tmp_path: Path) -> None:
    port = free_port()
    down = cli("ls", "--redis", f"redis://127.0.0.1:{port}/0", check=3)
    assert "backend unavailable" in down.stderr and f"127.0.0.1:{port}" in down.stderr
    peer_down = cli("verify", "--peer", f"127.0.0.1:{port}", "--peer-insecure", check=3)
    assert "backend unavailable" in peer_down.stderr


def test_peer_token_from_a_file_or_the_environment_never_argv(tmp_path: Path) -> None:
    """``--peer-token-file`` / ``--peer-token-env`` reach a peer that wants a token; a literal
    ``--peer-token`` is refused naming both, and the secret is never echoed."""
    secret = "cli-peer-secret-42"
    peer = start_peer(4 * MiB, secret)
    try:
        (tmp_path / "token").write_text(secret + "\n")
        by_file = cli_json("ls", "--peer", peer.address, "--peer-token-file", str(tmp_path / "token"))
        assert by_file["fingerprints"] == []
        env = {**os.environ, "HOP_CLI_PEER_TOKEN": secret}
        by_env = subprocess.run(
            [sys.executable, "-m", "hybrid_offload", "cache", "ls", "--peer", peer.address,
             "--peer-token-env", "HOP_CLI_PEER_TOKEN"],
            capture_output=True, text=True, timeout=120, cwd=REPO, env=env, check=False,
        )  # fmt: skip
        assert by_env.returncode == 0, by_env.stderr
        literal = cli("ls", "--peer", peer.address, "--peer-token", secret, check=2)
        assert "--peer-token-file" in literal.stderr and "--peer-token-env" in literal.stderr
        assert secret not in literal.stderr + literal.stdout
        (tmp_path / "wrong").write_text("nope")
        wrong = cli("ls", "--peer", peer.address, "--peer-token-file", str(tmp_path / "wrong"), check=3)
        assert "wrong token" in wrong.stderr
        missing = cli("ls", "--peer", peer.address, "--peer-token-file", str(tmp_path / "none"), check=2)
        assert "--peer-token-file" in missing.stderr
        alone = cli("ls", "--disk", str(tmp_path), "--peer-token-file", str(tmp_path / "token"), check=2)
        assert "--peer-token-file only goes with --peer" in alone.stderr
    finally:
        peer.kill()


def test_redis_password_from_a_file_or_the_environment_never_argv(tmp_path: Path) -> None:
    """A Redis with AUTH is reached with ``--redis-password-file`` / ``--redis-password-env``;
    without them the server refuses (exit 3); the password never shows in the output."""
    password = "cli-redis-pw-7"
    server = start_redis_server(tmp_path / "redis", "--requirepass", password)
    try:
        (tmp_path / "pw").write_text(password + "\n")
        options = {"url": server.url, "password_file": str(tmp_path / "pw")}
        with create_backend(BackendConfig("redis", "redis", 1 << 30, options=options)) as backend:
            assert backend.put_batch([make_page("ab" * 16, 0, 0)]) == [True]
        by_file = cli_json("ls", "--redis", server.url, "--redis-password-file", str(tmp_path / "pw"))
        assert [(f["fingerprint"], f["pages"]) for f in by_file["fingerprints"]] == [("ab" * 16, 1)]
        by_env = subprocess.run(
            [sys.executable, "-m", "hybrid_offload", "cache", "stats", "--redis", server.url,
             "--redis-password-env", "HOP_CLI_REDIS_PW"],
            capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
            env={**os.environ, "HOP_CLI_REDIS_PW": password},
        )  # fmt: skip
        assert by_env.returncode == 0, by_env.stderr
        refused = cli("ls", "--redis", server.url, check=3)
        assert "backend unavailable" in refused.stderr and password not in refused.stderr
        missing = cli("ls", "--redis", server.url, "--redis-password-file", str(tmp_path / "none"), check=2)
        assert "--redis-password-file" in missing.stderr
        alone = cli("ls", "--disk", str(tmp_path), "--redis-password-env", "HOP_CLI_REDIS_PW", check=2)
        assert "--redis-password-env only goes with --redis" in alone.stderr
    finally:
        server.stop()


def test_verify_with_the_cache_secret_refuses_unsigned_and_forged_pages(tmp_path: Path) -> None:
    """With ``--secret-file``, verify and inspect check signatures: a page signed under the
    engines' secret is ok, an unsigned one or one signed under another secret is corrupt (and
    ``--delete-bad`` removes it); without the secret all three verify (checksums only)."""
    from hybrid_offload.core.page_format import decode_page
    from hybrid_offload.core.secrets import Secret

    cache = _disk_cache(tmp_path)
    (tmp_path / "secret").write_text("engines-secret\n")
    pages = {}
    signers = (Secret(b"engines-secret").subkey("page"), None, Secret(b"forger").subkey("page"))
    for chunk, key in enumerate(signers):
        page_key, data = make_page(FP_A, 0, chunk)
        header, payload = decode_page(data)
        pages[page_key] = encode_page(header, bytes(payload), key=key)
    cache.put(pages)
    good, unsigned, forged = pages
    plain = cli_json("verify", *cache.args)
    assert (plain["ok"], plain["corrupt"]) == (3, 0)
    signed = cli_json("verify", *cache.args, "--secret-file", str(tmp_path / "secret"), check=1)
    assert (signed["ok"], signed["corrupt"]) == (1, 2)
    assert {p["key"] for p in signed["corrupt_pages"]} == {unsigned, forged}
    info = cli_json("inspect", *cache.args, good, "--secret-file", str(tmp_path / "secret"))
    assert (info["signed"], info["valid"]) == (True, True)
    info = cli_json("inspect", *cache.args, unsigned, "--secret-file", str(tmp_path / "secret"), check=1)
    assert (info["signed"], info["valid"]) == (False, False)
    cli("verify", *cache.args, "--secret-file", str(tmp_path / "secret"), "--delete-bad", check=1)
    again = cli_json("verify", *cache.args, "--secret-file", str(tmp_path / "secret"))
    assert (again["pages"], again["ok"], again["corrupt"]) == (1, 1, 0)
    cache.put({make_page(FP_A, 0, 9)[0]: pages[good]})  # a signed page copied under another key
    moved = cli_json("verify", *cache.args, "--secret-file", str(tmp_path / "secret"), check=1)
    assert (moved["ok"], moved["corrupt"]) == (1, 1)
    assert "wrong key" in moved["corrupt_pages"][0]["error"]
    missing = cli("verify", *cache.args, "--secret-file", str(tmp_path / "none"), check=2)
    assert "--secret-file" in missing.stderr


def test_what_a_card_says_never_reaches_the_terminal_raw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31 L5: model cards are unsigned, so any writer of the tier chooses their text. A
    name carrying terminal escapes and a forged line is printed escaped; a ``written_at`` of
    1e300 makes the card invalid instead of crashing ``inspect``."""
    cache = _disk_cache(tmp_path)
    try:
        evil = "org/m\x1b]0;owned\x07\nverified 999 pages: 999 ok, 0 corrupt\x1b[2J"
        key, card = make_card(FP_A, evil)
        groups = (CardGroup(0, "full_attention", 1, 1),)
        far = ModelCard(FP_C, "far", None, ("TinyHybrid",), "bfloat16", "auto", 16, groups, FORMAT_VERSION,
                        1e300)  # fmt: skip
        with monkeypatch.context() as forger:  # what our writer refuses, a forger writes
            forger.setattr("hybrid_offload.core.model_card._timestamp", lambda v: True)
            forged = encode_card(far)
        cache.put({**pages_a(), key: card, card_key(FP_C): forged})
        for args in (("ls",), ("stats",), ("inspect", key)):
            shown = cli(*args, *cache.args).stdout
            assert "\x1b" not in shown and "\x07" not in shown, args
            assert "verified 999 pages" not in shown.splitlines(), args
            assert "\\x1b]0;owned" in shown, args
        info = cli_json("inspect", *cache.args, card_key(FP_C), check=1)
        assert info["valid"] is False and "written_at" in info["error"]
    finally:
        cache.backend.close()


def test_with_the_secret_only_signed_cards_name_a_model(tmp_path: Path) -> None:
    """Issue 31 L5: with ``--secret-file`` a card must be signed under the engines' secret to
    name its model (``ls``, ``stats``) and to verify; without it both cards are read."""
    from hybrid_offload.core.secrets import Secret

    cache = _disk_cache(tmp_path)
    try:
        (tmp_path / "secret").write_text("engines-secret\n")
        (tmp_path / "secret").chmod(0o600)
        signed = ModelCard(FP_A, "org/real", None, ("TinyHybrid",), "bfloat16", "auto", 16,
                           (CardGroup(0, "full_attention", 1, 1),), FORMAT_VERSION, time.time())  # fmt: skip
        forged = dataclasses.replace(signed, fingerprint=FP_C, name="org/forged")
        cache.put({card_key(FP_A): encode_card(signed, Secret(b"engines-secret").subkey("page")),
                   card_key(FP_C): encode_card(forged)})  # fmt: skip
        secret = ("--secret-file", str(tmp_path / "secret"))
        models = {r["fingerprint"]: r["model"] for r in cli_json("ls", *cache.args, *secret)["fingerprints"]}
        assert models == {FP_A: "org/real", FP_C: None}
        models = {r["fingerprint"]: r["model"] for r in cli_json("ls", *cache.args)["fingerprints"]}
        assert models == {FP_A: "org/real", FP_C: "org/forged"}
        checked = cli_json("verify", *cache.args, *secret, check=1)
        assert (checked["cards_ok"], checked["cards_corrupt"]) == (1, 1)
        assert cli_json("verify", *cache.args)["cards_ok"] == 2
    finally:
        cache.backend.close()


@pytest.mark.xdist_group("cache-cli-redis")
def test_a_page_cannot_hide_behind_a_forged_index_size(redis_server: RedisServer) -> None:
    """Issue 31 L5: Redis listings take sizes from the shared index, which any client of the
    server can write. A page listed smaller than it is reads as a miss; ``verify`` used to
    count it as vanished (a corrupt page hid behind it); now it is corrupt, named."""
    cache = _redis_cache(redis_server)
    try:
        pages = pages_a()
        cache.put(pages)
        hidden = min(pages)
        admin = redis.Redis.from_url(redis_server.url)
        admin.hset(cache.backend._index.size, hidden, 10)  # type: ignore[attr-defined]
        admin.close()
        report = cli_json("verify", *cache.args, check=1)
        assert (report["ok"], report["corrupt"], report["vanished"]) == (len(pages) - 1, 1, 0)
        assert report["corrupt_pages"][0]["key"] == hidden
        assert "listing says" in report["corrupt_pages"][0]["error"]
    finally:
        cache.backend.close()


def test_sets_written_at_different_layouts_are_each_complete() -> None:
    """A 2-layer model's sets: one written whole (PP=1), one in two parts (PP=2), both
    complete; one PP=2 set lacking a part is not."""
    from hybrid_offload.tools.cli.cache_stats import PageSets

    layer = (TensorSpec("L.conv", (4, 8), "float32"), TensorSpec("L.ssm", (2, 4, 4), "float32"))

    def header(chunk: int, start: int, end: int) -> PageHeader:
        return PageHeader(bytes.fromhex(FP_B), bytes([chunk]) * 32, 1, GroupKind.MAMBA, chunk, 16,
                          layer * (end - start), 0, 1, start, end, bytes(16))  # fmt: skip

    sets = PageSets()
    for h in (header(0, 0, 2), header(1, 0, 1), header(1, 1, 2), header(2, 1, 2)):
        sets.add(FP_B, h)
    assert sets.counts()[(FP_B, 1)] == {"complete": 2, "incomplete": 1}
