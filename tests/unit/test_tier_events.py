"""KV events for what our tiers gain and lose (connector/scheduler/events.py), through the
scheduler with fake requests carrying vLLM's real block hashes (sha256, hash block 4 tokens,
chunk 8 tokens: a page set's block is named by every second hash)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest
from scheduler_world import (
    ATTN,
    MAMBA,
    FakeRequest,
    World,
    cpu_config,
    make_spec,
    new_req,
    prompt,
    step,
    tier,
)
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

from hybrid_offload.backends import BackendConfig
from hybrid_offload.connector.metadata import OffloadWorkerMetadata
from hybrid_offload.connector.scheduler.events import HIDDEN_SALT
from hybrid_offload.core.kv_events import KVEventsSpec, medium_name
from hybrid_offload.core.layer_parts import LayerGrid
from hybrid_offload.core.spec import make_model_spec
from hybrid_offload.router import decode_batch

HASH_BLOCK = 4
SPEC = KVEventsSpec(HASH_BLOCK)


class HashedRequest(FakeRequest):
    """A fake request with vLLM's block hashes of its tokens (as the engine core computes them)."""

    @property
    def block_hashes(self) -> list[bytes]:
        init_none_hash(sha256)
        out: list[bytes] = []
        tokens = self.all_token_ids
        for start in range(0, len(tokens) - HASH_BLOCK + 1, HASH_BLOCK):
            block = tokens[start : start + HASH_BLOCK]
            out.append(hash_block_tokens(sha256, out[-1] if out else None, block))
        return out


def external(req: HashedRequest, end: int) -> int:
    return SPEC.external(req.block_hashes[end // HASH_BLOCK - 1])


def prefill(w: World, req: HashedRequest, tables: tuple[list[int], ...], budget: int = 0):
    """The request's whole prompt in steps of at most ``budget`` tokens (0: any) cut where the
    connector asks; metadata per step."""
    w.sched.get_num_new_matched_tokens(req, 0)
    w.sched.update_state_after_alloc(req, tables, 0)
    metas, computed, n = [], 0, len(req.prompt_token_ids)
    while computed < n:
        end = w.sched.prefill_stop(req.request_id, computed, min(n, computed + budget) if budget else n)
        rid = req.request_id
        out = (step(new=[new_req(rid, tables, 0)], scheduled={rid: end}) if computed == 0
               else step(cached=[(rid, None, computed)], scheduled={rid: end - computed}))
        metas.append(w.sched.build_connector_meta(out))
        computed = end
    return metas


@pytest.fixture
def events_world(worlds):
    def make(backends, **kw):
        return worlds(make_spec(8, 8), 8, backends, events=SPEC, **kw)
    return make


def test_a_stored_prompt_publishes_each_attention_chunk_and_its_state_in_vllm_hashes(events_world) -> None:
    w = events_world([cpu_config()])
    req = HashedRequest("r1", prompt(27))  # 3 chunks and 3 tokens: the tail is no chunk
    metas = prefill(w, req, ([10, 11, 12, 13], [0, 0, 22, 23]))
    assert w.sched.take_events() == []  # planned, not stored yet
    for meta in metas:
        w.complete(meta)
    events = w.sched.take_events()
    stored = [(e.group_idx, e.block_hashes, e.parent_block_hash, e.kv_cache_spec_kind) for e in events]
    assert stored == [
        (ATTN, [external(req, 8)], None, "full_attention"),
        (ATTN, [external(req, 16)], external(req, 8), "full_attention"),
        (ATTN, [external(req, 24)], external(req, 16), "full_attention"),
        (MAMBA, [external(req, 24)], external(req, 16), "mamba"),  # the state after 24 tokens
    ]
    first = events[0]
    assert isinstance(first, BlockStored)
    assert first.token_ids == req.prompt_token_ids[:8] and first.block_size == 8
    assert (first.medium, first.locality, first.ownership) == ("cpu", "LOCAL", "hybrid-offload")
    assert events[3].token_ids == req.prompt_token_ids[16:24]
    assert w.sched.take_events() == []  # taken once


def two_part_spec():
    """The attention group's two layers in two layer parts: its page sets have two pieces."""
    attn, mamba = make_spec(8, 8).groups
    attn = dataclasses.replace(attn, layer_names=("model.layers.0.attn", "model.layers.1.attn"))
    mamba = dataclasses.replace(mamba, layer_names=("model.layers.2.mixer",))
    return make_model_spec((attn, mamba), {"name": "fake-hybrid"}, max_model_len=4096, num_blocks=64,
                           grid=LayerGrid(3, (0, 1, 3)))


def test_a_set_is_published_once_every_piece_is_stored_and_removed_when_one_is_evicted(worlds) -> None:
    w = worlds(two_part_spec(), 8, [cpu_config()], events=SPEC)
    req = HashedRequest("r1", prompt(9))
    meta = prefill(w, req, ([10, 11], [21, 0]))[0]
    page = meta.stores[0].page
    assert page.group == ATTN and page.chunk_index == 0
    pieces = w.planner.piece_keys(page.key, ATTN)
    assert len(pieces) == 2
    report = OffloadWorkerMetadata(stored={"cpu": pieces[:-1]})
    w.sched.update_connector_output(report, None, None)
    assert w.sched.take_events() == []  # one piece of two: not yet
    w.sched.update_connector_output(OffloadWorkerMetadata(stored={"cpu": pieces}), None, None)
    (stored,) = [e for e in w.sched.take_events() if e.group_idx == ATTN]
    assert stored.block_hashes == [external(req, 8)]
    w.sched.update_connector_output(OffloadWorkerMetadata(evicted={"cpu": pieces[-1:]}), None, None)
    (removed,) = w.sched.take_events()
    assert isinstance(removed, BlockRemoved)
    assert (removed.block_hashes, removed.medium, removed.group_idx) == ([external(req, 8)], "cpu", ATTN)
    w.sched.update_connector_output(OffloadWorkerMetadata(evicted={"cpu": pieces}), None, None)
    assert w.sched.take_events() == []  # removed once


def test_a_shared_tier_that_lost_a_published_set_is_seen_by_a_lookup(events_world, tmp_path: Path) -> None:
    disk = tier(BackendConfig("disk", "disk", 1 << 30, options={"path": str(tmp_path / "disk")}))
    w = events_world([disk])
    req = HashedRequest("r1", prompt(17))
    metas = prefill(w, req, ([10, 11, 12], [0, 21, 22]))
    pages = [s.page for m in metas for s in m.stores if not s.hold]
    pieces = {p.key: w.planner.piece_keys(p.key, p.group) for p in pages}
    for p in pages:
        w.hold("disk", pieces[p.key])
    w.sched.update_connector_output(
        OffloadWorkerMetadata(stored={"disk": [k for keys in pieces.values() for k in keys]},
                              settled=list(pieces)), None, None
    )
    published = w.sched.take_events()
    assert {e.locality for e in published} == {"REMOTE"}
    assert {(e.group_idx, e.block_hashes[0]) for e in published} >= {
        (ATTN, external(req, 8)), (ATTN, external(req, 16)), (MAMBA, external(req, 16))
    }
    w.sched.request_finished(req)
    # another engine's eviction: the second chunk's attention pages vanish from the disk
    second = next(p for p in pages if p.group == ATTN and p.chunk_index == 1)
    writer = w._writers["disk"]
    writer.delete_batch(pieces[second.key])
    again = HashedRequest("r2", prompt(17))
    w.sched.get_num_new_matched_tokens(again, 0)
    removed = [e for e in w.sched.take_events() if isinstance(e, BlockRemoved)]
    medium = medium_name("disk", "disk", disk.backend.options)  # a shared tier: named with its store
    assert medium.startswith("disk@") and {e.medium for e in published} == {medium}
    assert [(e.group_idx, e.block_hashes, e.medium, e.locality) for e in removed] == [
        (ATTN, [external(req, 16)], medium, "REMOTE")
    ]


def test_no_events_without_a_vllm_hash_at_the_boundary_or_when_events_are_off(worlds, events_world) -> None:
    off = worlds(make_spec(8, 8), 8, [cpu_config()])
    req = HashedRequest("r1", prompt(17))
    for meta in prefill(off, req, ([10, 11, 12], [0, 21, 22])):
        off.complete(meta)
    assert off.sched.events is None and off.sched.take_events() == []

    w = events_world([cpu_config()])
    unhashed = FakeRequest("r2", prompt(17))  # no block hashes (vLLM computed none)
    unhashed.block_hashes = []  # type: ignore[attr-defined]
    for meta in prefill(w, unhashed, ([10, 11, 12], [0, 21, 22])):  # type: ignore[arg-type]
        w.complete(meta)
    assert w.sched.take_events() == []


def test_blocks_span_chunks_when_vllm_hashes_are_coarser(worlds, monkeypatch) -> None:
    """vLLM hashes every 16 tokens, chunks are 8: a block is two chunks, published once both
    are stored; a state is published only where a vLLM hash ends (16 and 32, not 8 or 24)."""
    monkeypatch.setattr(f"{__name__}.HASH_BLOCK", 16)
    coarse = KVEventsSpec(16)
    w = worlds(make_spec(8, 8), 8, [cpu_config()], events=coarse, checkpoint_interval=8)
    req = HashedRequest("r1", prompt(35))
    metas = prefill(w, req, ([10, 11, 12, 13, 14], [21, 22, 23, 24, 0]), budget=8)
    stored_pages = [(s.page.group, s.page.chunk_index) for m in metas for s in m.stores if not s.hold]
    assert (MAMBA, 2) in stored_pages and (MAMBA, 3) in stored_pages  # states at 24 and 32 stored
    w.complete(metas[0])  # chunk 0 only (the first step ends at 8, a state due there)
    assert w.sched.take_events() == []
    for meta in metas[1:]:
        w.complete(meta)
    events = w.sched.take_events()
    got = sorted((e.group_idx, e.block_hashes[0], e.block_size) for e in events)
    assert got == sorted([
        (ATTN, coarse.external(req.block_hashes[0]), 16),
        (ATTN, coarse.external(req.block_hashes[1]), 16),
        (MAMBA, coarse.external(req.block_hashes[0]), 16),
        (MAMBA, coarse.external(req.block_hashes[1]), 16),
    ])  # no state at 8 or 24: no vLLM hash ends there
    assert next(e for e in events if e.block_hashes[0] == coarse.external(req.block_hashes[1])).token_ids == \
        req.prompt_token_ids[16:32]


def test_a_cache_reset_removes_every_published_block(events_world) -> None:
    w = events_world([cpu_config()])
    req = HashedRequest("r1", prompt(17))
    for meta in prefill(w, req, ([10, 11, 12], [0, 21, 22])):
        w.complete(meta)
    published = {(e.group_idx, e.block_hashes[0]) for e in w.sched.take_events()}
    assert published
    w.sched.reset_cache()  # new weights: nothing stored so far is loaded again
    removed = w.sched.take_events()
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert {(e.group_idx, e.block_hashes[0]) for e in removed} == published
    w.sched.update_connector_output(OffloadWorkerMetadata(evicted={"cpu": w.pieces(
        [k for keys in w.keys(req.prompt_token_ids) for k in keys])}), None, None)
    assert w.sched.take_events() == []  # forgotten: removed once


def test_a_promoted_set_is_published_in_the_cpu_tier_once_stored_there(events_world, tmp_path: Path) -> None:
    """A load from disk promotes its pages into cpu: when the worker reports them stored, cpu
    publishes them (LOCAL), as for a store."""
    disk_config = BackendConfig("disk", "disk", 1 << 30, options={"path": str(tmp_path / "disk")})
    disk = tier(disk_config, load_weight=0.5)
    w = events_world([cpu_config(), disk])
    req = HashedRequest("r1", prompt(20))
    w.hold("disk", w.chunk_keys(req.prompt_token_ids, range(2)))
    n, _ = w.sched.get_num_new_matched_tokens(req, 0)
    assert n == 16
    w.sched.update_state_after_alloc(req, ([10, 11, 12], [0, 21, 22]), n)
    (job,) = w.sched.build_connector_meta(step()).loads
    assert {p.backends for p in job.promotions} == {("cpu",)}
    w.sched.take_events()  # what the lookup saw on disk
    pieces = [k for p in job.promotions for k in w.planner.piece_keys(p.key, p.group)]
    w.sched.update_connector_output(OffloadWorkerMetadata(stored={"cpu": pieces}), None, None)
    published = [e for e in w.sched.take_events() if isinstance(e, BlockStored)]
    assert {(e.medium, e.locality) for e in published} == {("cpu", "LOCAL")}
    assert {(e.group_idx, e.block_hashes[0]) for e in published} == {
        (ATTN, external(req, 8)), (ATTN, external(req, 16)), (MAMBA, external(req, 16))
    }


def test_events_without_token_ids_carry_hashes_only(worlds) -> None:
    """Issue 45 N4: ``kv_events_token_ids: false``: a block's tokens (the prompt) stay out of the
    events; what routers need, the hashes, is the same."""
    hashed = worlds(make_spec(8, 8), 8, [cpu_config()], events=SPEC)
    bare = worlds(make_spec(8, 8), 8, [cpu_config()], events=dataclasses.replace(SPEC, token_ids=False))
    published = []
    for w in (hashed, bare):
        req = HashedRequest("r1", prompt(27))
        for meta in prefill(w, req, ([10, 11, 12, 13], [0, 0, 22, 23])):
            w.complete(meta)
        published.append(w.sched.take_events())
    with_tokens, without = published
    assert [e.token_ids for e in without] == [[]] * len(with_tokens) and with_tokens[0].token_ids
    def named(events: list) -> list[tuple]:
        return [(e.block_hashes, e.parent_block_hash, e.group_idx, e.medium, e.block_size) for e in events]

    assert named(with_tokens) == named(without)


def test_salted_and_lora_requests_publish_vllms_extra_keys(worlds, tmp_path: Path) -> None:
    """Issue 45 N7: vLLM hashes a request with a ``cache_salt`` or a LoRA adapter with extra
    keys; our blocks carry them as vLLM's own events do (the salt on the first block, the LoRA
    name on every one), so a router that hashes tokens itself never matches them to a plain
    prompt. They were published without any. Without token ids the salt (a secret) is hidden."""
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    header = b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
    weights = len(header).to_bytes(8, "little") + header + bytes(16)
    (adapter / "adapter_model.safetensors").write_bytes(weights)
    lora = LoRARequest("sql", 1, str(adapter))
    cases = [
        ({"cache_salt": "tenant-a"}, [[("tenant-a",)], [None]]),
        ({"lora_request": lora, "cache_salt": "tenant-a"}, [[("sql", "tenant-a")], [("sql",)]]),
        ({}, [[None], [None]]),  # one entry per block, as vLLM's own
    ]
    bare = dataclasses.replace(SPEC, token_ids=False)
    hidden = ({"cache_salt": "tenant-a"}, [[(HIDDEN_SALT,)], [None]], bare)
    for kw, want, *spec in [*cases, hidden]:
        w = worlds(make_spec(8, 8), 8, [cpu_config()], events=spec[0] if spec else SPEC)
        req = HashedRequest("r1", prompt(17), **kw)
        for meta in prefill(w, req, ([10, 11, 12], [0, 21, 22])):
            w.complete(meta)
        events = w.sched.take_events()
        attention = [e for e in events if e.group_idx == ATTN]
        attention.sort(key=lambda e: e.parent_block_hash is not None)  # the first block first
        assert [e.extra_keys for e in attention] == want, kw
        # as a router reads them: keyed blocks are flagged (and never teach the hash block size)
        payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=attention))
        assert [e.has_extra_keys for e in decode_batch(payload).events] == [k != [None] for k in want]


def test_a_shared_tier_is_published_under_its_store(events_world, tmp_path: Path) -> None:
    """Issue 45 N14: two stores given one name are two media; one store seen by two engines
    (the same path on this host) is one. Only shared (REMOTE) tiers carry a store id."""
    def media(path: Path) -> set[tuple[str, str]]:
        disk = tier(BackendConfig("disk", "disk", 1 << 30, options={"path": str(path)}))
        w = events_world([cpu_config(), disk])
        req = HashedRequest("r1", prompt(17))
        metas = prefill(w, req, ([10, 11, 12], [0, 21, 22]))
        pages = [s.page for m in metas for s in m.stores if not s.hold]
        pieces = [k for p in pages for k in w.planner.piece_keys(p.key, p.group)]
        report = OffloadWorkerMetadata(stored={"cpu": pieces, "disk": pieces})
        w.sched.update_connector_output(report, None, None)
        return {(e.medium, e.locality) for e in w.sched.take_events()}

    one, same, other = media(tmp_path / "a"), media(tmp_path / "a"), media(tmp_path / "b")
    shared = {m for m, locality in one if locality == "REMOTE"}
    assert one == same and len(shared) == 1 and next(iter(shared)).startswith("disk@")
    assert ("cpu", "LOCAL") in one and {m for m, _ in other} - {m for m, _ in one} == {
        medium_name("disk", "disk", {"path": str(tmp_path / "b")})
    }
