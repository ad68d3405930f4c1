"""OffloadWorker with real torch KV tensors and real backends, no vLLM engine.

Attention layers are vLLM CPU attention tensors ``(num_blocks, kv_heads, block_size,
2 * head_size)`` bf16, written through vLLM's own cache-write op so that the expected K/V per
token is known independently of ``kv_layout``; Mamba layers are int8 page views
``(num_blocks, 1, 1, state_bytes)`` with a block stride of the padded page size. All groups
index their blocks by the same global block ids.
"""

from __future__ import annotations

import itertools
import sys
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from worker_world import (
    ATTN,
    ATTN_LAYERS,
    BS,
    DIM,
    HEADS,
    MAMBA,
    MAMBA_LAYERS,
    MAMBA_PAGE,
    NUM_BLOCKS,
    World,
    attn_page_len,
    cpu,
    first_page_len,
    load_job,
    make_spec,
    stored_world,
    unavailable,
)

from hybrid_offload.backends import (
    BackendClosedError,
    BackendConfig,
    BackendUnavailableError,
    BuffersInUseError,
    create_backend,
)
from hybrid_offload.backends.retention import Retention
from hybrid_offload.connector.config import Tier
from hybrid_offload.connector.metadata import (
    ClearRange,
    CommitJob,
    LoadJob,
    LoadSegment,
    OffloadMetadata,
    PageJob,
    Promotion,
    StoreJob,
    TouchJob,
)
from hybrid_offload.connector.worker.offload_worker import OffloadWorker
from hybrid_offload.connector.worker.page_codec import PageCodec
from hybrid_offload.connector.worker.switch_interval import LoadSwitchInterval
from hybrid_offload.core.metrics import LOAD_PHASES
from hybrid_offload.core.page_format import decode_page
from hybrid_offload.core.planner import HybridOffloadPlanner


class Gate(threading.Event):
    """Set it to let gated calls through; ``returned`` is set once one of them has returned."""

    def __init__(self) -> None:
        super().__init__()
        self.returned = threading.Event()


def gate(backend: Any, method: str) -> Gate:
    """Make ``backend.<method>`` wait until the returned gate is set (30 s only on a hang)."""
    opened = Gate()
    backend = getattr(backend, "raw", backend)  # the backend itself, not a SetKeyed view
    original = getattr(backend, method)

    def gated(*args: Any, **kwargs: Any) -> Any:
        try:
            assert opened.wait(30), "gate never opened"
            return original(*args, **kwargs)
        finally:
            opened.returned.set()

    setattr(backend, method, gated)
    return opened


def expected_attn_payload(written: dict[str, tuple[torch.Tensor, torch.Tensor]], first: int, n: int) -> bytes:
    """Canonical payload: per layer K [token][head][dim], then V."""
    parts = []
    for layer in ATTN_LAYERS:
        k, v = written[layer]
        parts.append(torch.stack([k[first : first + n], v[first : first + n]]).contiguous().view(torch.uint8))
    return b"".join(p.numpy().tobytes() for p in parts)


def read_tokens(w: World, table: list[int], first: int, n: int) -> list[torch.Tensor]:
    """K/V of tokens [first, first + n) per layer as (2, T, H, D), read through the layout."""
    layout = w.worker.layouts[ATTN]
    out = [torch.empty(2, n, HEADS, DIM, dtype=torch.bfloat16) for _ in ATTN_LAYERS]
    layout.gather(layout.token_index(table, first, n), out)  # type: ignore[union-attr]
    return out


def assert_only_blocks_changed(before: dict[str, torch.Tensor], w: World, allowed: set[int]) -> None:
    for name, tensor in {**w.cache.attn, **w.cache.storage}.items():
        for b in range(NUM_BLOCKS):
            if b in allowed:
                continue
            if name in w.cache.attn:
                same = torch.equal(tensor[b], before[name][b])
            else:
                same = torch.equal(
                    tensor[b * MAMBA_PAGE : (b + 1) * MAMBA_PAGE],
                    before[name][b * MAMBA_PAGE : (b + 1) * MAMBA_PAGE],
                )
            assert same, f"{name} block {b} was written"


# ---- stores -----------------------------------------------------------------------------------
@pytest.mark.parametrize("recycled", [False, True], ids=["fresh", "recycled"])
@pytest.mark.parametrize("chunk", [BS, BS // 2], ids=["chunk=block", "chunk=block/2"])
def test_stored_pages_decode_to_the_blocks_contents_in_canonical_order(
    world, chunk: int, recycled: bool
) -> None:
    w = world(chunk=chunk)
    if recycled:  # store rows given back by earlier steps hold other pages' bytes: all overwritten
        for size in (1 << 10, 1 << 14, 1 << 16, 1 << 20):
            w.worker.stores.store_rows.give(torch.full((size,), 0xA5, dtype=torch.uint8))
    table, mamba_table = [3, 7, 5], [4, 9, 2]
    written = w.cache.write_tokens(table, 0, 24)
    w.cache.fill_states(mamba_table)
    pages = [w.attn_page(c, table) for c in range(24 // chunk)]
    pages += [
        w.mamba_page(8 // chunk - 1, (mamba_table[0],)),
        w.mamba_page(24 // chunk - 1, (mamba_table[2],)),
    ]
    expected_states = {
        p.key: b"".join(w.cache.state(layer, p.block_ids[0]) for layer in MAMBA_LAYERS) for p in pages[-2:]
    }

    w.worker.copy_out([StoreJob(p, ("cpu",)) for p in pages])
    for tensor in [*w.cache.attn.values(), *w.cache.storage.values()]:
        tensor.zero_()  # the copy is taken in copy_out, not later on the store thread
    w.worker.flush(10)

    stored = w.backend("cpu").get_batch([p.key for p in pages])
    for page, data in zip(pages, stored, strict=True):
        assert data is not None, page
        codec = w.worker.codecs[page.group]
        header, payload = decode_page(data, codec.header(page, codec.written[0]))
        assert (header.group_index, header.chunk_index, header.num_tokens) == (
            page.group,
            page.chunk_index,
            chunk,
        )
        if page.group == ATTN:
            assert bytes(payload) == expected_attn_payload(written, page.chunk_index * chunk, chunk)
        else:
            assert bytes(payload) == expected_states[page.key]
    counters = w.counters()
    assert counters["pages_copied_out"] == len(pages)
    assert counters["backends"]["cpu"]["stored_pages"] == len(pages)
    assert counters["stores_dropped"] == 0
    assert counters["copy_out_seconds"] > 0
    lengths = sum(first_page_len(w.worker.codecs[p.group]) for p in pages)
    assert w.worker.stores.store_rows.free_bytes >= lengths  # given back once stored, for the next steps


def test_rows_a_backend_may_still_read_are_never_reused(world) -> None:
    """Issue 31 L3: a put whose transfer could not be stopped (BuffersInUseError) may still
    read its pages' rows after it returns: they are retired, not given back for the next step;
    after an ordinary failure they are given back."""
    clock = [0.0]
    w = world(unavailable("cpu"), chunk=BS, clock=lambda: clock[0])  # one copying puts
    faulty = w.faulty("cpu")
    table = [3, 7, 5]
    w.cache.write_tokens(table, 0, 24)
    for error, given_back in ((BuffersInUseError("a WRITE did not stop"), False),
                              (BackendUnavailableError("down"), True)):  # fmt: skip
        clock[0] += 60.0  # past any backoff: the put reaches the backend
        free, puts = w.worker.stores.store_rows.free_bytes, faulty.calls.get("put_batch", 0)
        faulty.fail("put_batch", error=error)
        w.worker.copy_out([StoreJob(w.attn_page(c, table), ("cpu",)) for c in range(3)])
        w.worker.flush(10)
        assert (w.worker.stores.store_rows.free_bytes > free) is given_back, error
        assert w.counters()["backends"]["cpu"]["store_failures"] > 0
        assert faulty.calls["put_batch"] == puts + 1  # reached it (not skipped): failed as injected


def test_copy_out_before_kv_caches_are_registered_is_a_no_op() -> None:
    spec = make_spec()
    planner = HybridOffloadPlanner(spec, BS)
    worker = OffloadWorker(spec, planner, (Tier(cpu()),), 1 << 30)
    try:
        hashes = planner.chunk_hashes(list(range(8)))
        page = PageJob(planner.page_key(hashes[0], ATTN), ATTN, 0, hashes[0], (1,))
        worker.copy_out([StoreJob(page, ("cpu",))])
        worker.flush(10)
        meta = worker.worker_meta()  # nothing stored; the page is settled (lookups go on)
        assert meta is not None and not meta.stored and meta.settled == [page.key]
    finally:
        worker.shutdown(10)


# ---- loads --------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [BS, BS // 2], ids=["chunk=block", "chunk=block/2"])
def test_load_round_trip_into_other_blocks(world, chunk: int) -> None:
    w = world(chunk=chunk)
    src, src_state = [3, 7, 5], 2
    w.cache.write_tokens(src, 0, 24)
    w.cache.fill_states([src_state])
    k = 24 // chunk
    w.worker.copy_out(
        [StoreJob(w.attn_page(c, src), ("cpu",)) for c in range(k)]
        + [StoreJob(w.mamba_page(k - 1, (src_state,)), ("cpu",))]
    )
    w.worker.flush(10)

    dst, dst_states = [11, 6, 13], (12, 14, 15)
    w.cache.fill_states(list(dst_states))  # stale contents, padding included
    before = w.cache.snapshot()
    job = load_job((*(w.attn_page(c, dst) for c in range(k)), w.mamba_page(k - 1, dst_states)))
    w.worker.start_loads([job])
    recving, failed = w.finish("req")
    assert recving == {"req"} and failed == set()

    for name, cache in w.cache.attn.items():
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(cache[d], cache[s]), (name, d)
    for layer in MAMBA_LAYERS:
        for d in dst_states:
            assert w.cache.state(layer, d) == w.cache.state(layer, src_state)
            pad = w.cache.block_bytes(layer, d)[w.cache.state_bytes :]
            assert torch.equal(
                pad, before[layer].view(torch.uint8)[d * MAMBA_PAGE : (d + 1) * MAMBA_PAGE][-len(pad) :]
            )
    assert_only_blocks_changed(before, w, set(dst) | set(dst_states))
    counters = w.counters()
    assert counters["pages_loaded"] == k + 1
    assert counters["missing_pages"] == counters["bad_pages"] == 0
    assert w.worker.write_finished_loads() == (set(), set())  # reported once


def test_a_written_load_counts_where_its_time_went(world) -> None:
    ticks = itertools.count(1.0)  # every reading of the timer is one second later
    w, pages, _ = stored_world(world, timer=lambda: next(ticks))
    w.worker.start_loads([load_job(tuple(pages))])  # submitted at 1
    w.finish("req")  # load thread: started 2, read 3 -> 4, verified 5, finished 6; written 7 -> 8
    c = w.counters()
    assert c["loads_written"] == 1
    assert {p: c[f"load_{p}_seconds"] for p in LOAD_PHASES} == {
        "queued": 1.0, "prepare": 2.0, "read": 1.0, "verify": 1.0, "ready": 1.0, "write": 1.0, "total": 7.0,
    }
    w.worker.start_loads([load_job((w.attn_page(5, [1, 2, 3]),), req_id="gone")])  # never stored
    assert w.finish("gone")[1] == {"gone"}
    assert w.counters()["loads_written"] == 1  # a failed load is not a written one


def test_load_leaves_skipped_tokens_alone(world) -> None:
    """skip_tokens: vLLM already holds the first tokens of the chunk (partial local hit)."""
    w = world()
    src, dst = [3, 7], [9, 10]
    written = w.cache.write_tokens(src, 0, 16)
    w.worker.copy_out([StoreJob(w.attn_page(c, src), ("cpu",)) for c in range(2)])
    w.worker.flush(10)
    local = w.cache.write_tokens(dst, 0, 3)  # what vLLM computed itself
    job = load_job((w.attn_page(0, dst, skip=3), w.attn_page(1, dst)))
    w.worker.start_loads([job])
    assert w.finish("req")[1] == set()
    for layer, got in zip(ATTN_LAYERS, read_tokens(w, dst, 0, 16), strict=True):
        assert torch.equal(got[0, :3], local[layer][0]) and torch.equal(got[1, :3], local[layer][1])
        assert torch.equal(got[0, 3:], written[layer][0][3:16]) and torch.equal(
            got[1, 3:], written[layer][1][3:16]
        )


def test_load_ending_inside_a_block_zeroes_the_rest_of_it(world) -> None:
    """vLLM does not zero blocks a connector loads into; stale bytes after the loaded tokens
    (e.g. a former Mamba state's, NaN as bf16) must not stay where the kernel reads a tile."""
    w = world(chunk=BS // 2)
    src, dst = [3, 7], [9, 10]
    written = w.cache.write_tokens(src, 0, 12)
    w.worker.copy_out([StoreJob(w.attn_page(c, src), ("cpu",)) for c in range(3)])
    w.worker.flush(10)
    for cache in w.cache.attn.values():
        cache[10].fill_(float("nan"))  # stale contents of the load's last block
    before = w.cache.snapshot()
    job = load_job(tuple(w.attn_page(c, dst) for c in range(3)))
    job = LoadJob(job.req_id, job.segments, job.fallbacks, (ClearRange(ATTN, 10, 4, BS - 4),))
    w.worker.start_loads([job])
    assert w.finish("req")[1] == set()
    for layer, got in zip(ATTN_LAYERS, read_tokens(w, dst, 0, 12), strict=True):
        assert torch.equal(got[0], written[layer][0]) and torch.equal(got[1], written[layer][1])
    for got in read_tokens(w, dst, 12, BS - 4):
        assert not got.isnan().any() and not got.any()
    assert_only_blocks_changed(before, w, set(dst))


# Contract of a failed load (worker docstring; vLLM runs with kv_load_failure_policy=recompute):
# the request is reported in finished_recving *and* failed_recving, never raises, and vLLM
# recomputes it. The target blocks may have been written partially (the current implementation
# verifies every page before scattering, but nothing relies on that): only blocks outside the job
# are guaranteed untouched.
def test_missing_page_fails_the_load(world) -> None:
    w, _, before = stored_world(world)
    dst = [11, 6, 13, 14]
    job = load_job((*(w.attn_page(c, dst) for c in range(4)), w.mamba_page(3, (12,))))
    w.worker.start_loads([job])
    recving, failed = w.finish("req")
    assert recving == failed == {"req"}
    assert w.counters()["missing_pages"] == 2  # chunk 3's attention page and its Mamba state
    assert_only_blocks_changed(before, w, {*dst, 12})


@pytest.mark.parametrize("damage", ["evicted", "corrupt"])
def test_page_missing_or_bad_in_its_backend_loads_from_a_fallback(world, damage: str) -> None:
    """Evicted (or corrupted) in "a" between lookup and load: read from "b", no failed request."""
    w, pages, before = stored_world(world, cpu("a"), cpu("b"))
    a = w.backend("a")
    if damage == "evicted":
        a.delete_batch([pages[1].key])
    else:
        data = bytearray(a.get_batch([pages[1].key])[0])
        data[-1] ^= 0x40
        a.put_batch([(pages[1].key, bytes(data))])
    w.worker.worker_meta()  # drain the stores
    dst = [11, 6, 13]
    job = LoadJob(
        "req",
        (LoadSegment("a", (*(w.attn_page(c, dst) for c in range(3)), w.mamba_page(2, (12,)))),),
        ("a", "b"),
    )
    w.worker.start_loads([job])
    assert w.finish("req") == ({"req"}, set())
    for name, cache in w.cache.attn.items():
        for s, d in zip([3, 7, 5], dst, strict=True):
            assert torch.equal(cache[d], cache[s]), (name, d)
    counters = w.counters()
    assert counters["backends"]["a"]["loaded_pages"] == 3
    assert counters["backends"]["b"]["loaded_pages"] == 1
    assert counters["bad_pages"] == (damage == "corrupt") and counters["missing_pages"] == 0
    samples = w.worker.worker_meta().load_samples
    assert [ok for _, _, ok in samples["a"]] == [True] and len(samples["b"]) == 1
    assert all(n > 0 and s > 0 for n, s, _ in samples["a"] + samples["b"])
    assert_only_blocks_changed(before, w, {*dst, 12})


def test_segments_read_each_page_from_its_own_backend(world) -> None:
    """A ranged load: chunk 0 from "a", chunks 1-2 and the state from "b"."""
    w, pages, _ = stored_world(world, cpu("a"), cpu("b"))
    w.backend("a").delete_batch([p.key for p in pages[1:]])
    w.backend("b").delete_batch([pages[0].key])
    dst = [11, 6, 13]
    job = LoadJob(
        "req",
        (
            LoadSegment("a", (w.attn_page(0, dst),)),
            LoadSegment("b", (w.attn_page(1, dst), w.attn_page(2, dst), w.mamba_page(2, (12,)))),
        ),
    )
    w.worker.start_loads([job])
    assert w.finish("req") == ({"req"}, set())
    assert w.counters()["backends"]["a"]["loaded_pages"] == 1
    assert w.counters()["backends"]["b"]["loaded_pages"] == 3
    for layer in MAMBA_LAYERS:
        assert w.cache.state(layer, 12) == w.cache.state(layer, 2)


@pytest.mark.parametrize("damage", ["payload-byte", "header-byte", "truncated", "other-page"])
def test_corrupt_page_fails_the_load_and_is_deleted(world, damage: str) -> None:
    w, pages, before = stored_world(world)
    backend = w.backend("cpu")
    victim = pages[1]
    data = bytearray(backend.get_batch([victim.key])[0])
    if damage == "payload-byte":
        data[-1] ^= 0x40
    elif damage == "header-byte":
        data[40] ^= 0x01
    elif damage == "truncated":
        data = data[:-2]
    else:  # a valid page, stored under the wrong key
        data = bytearray(backend.get_batch([pages[0].key])[0])
    assert backend.put_batch([(victim.key, bytes(data))]) == [True]
    w.worker.worker_meta()  # drain the stores

    dst = [11, 6, 13]
    job = load_job((*(w.attn_page(c, dst) for c in range(3)), w.mamba_page(2, (12, 14))))
    w.worker.start_loads([job])
    recving, failed = w.finish("req")
    assert recving == failed == {"req"}
    assert w.counters()["bad_pages"] == 1
    assert backend.contains_batch([p.key for p in pages]) == [True, False, True, True]
    assert w.worker.worker_meta().evicted == {"cpu": [w.piece_key(victim.key)]}  # the mirror forgets it
    assert_only_blocks_changed(before, w, {*dst, 12, 14})


def test_request_finished_during_its_load_is_reported_once_as_received(world) -> None:
    """Only finished_recving: vLLM frees a finished request's blocks on that report itself, and a
    second report as finished_sending would make vLLM free them twice."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    from hybrid_offload.connector import HybridOffloadConnector

    w, pages, _ = stored_world(world)
    opened = gate(w.backend("cpu"), "lease_batch")
    job = load_job(tuple(replace(p, block_ids=(b,)) for p, b in zip(pages, (11, 6, 13, 12), strict=True))
    )
    w.worker.start_loads([job])
    assert w.worker.write_finished_loads() == (set(), set())  # in flight while vLLM finishes the request
    facade = SimpleNamespace(worker=w.worker)
    results = HybridOffloadConnector.get_transfer_results(facade, {"req"})  # type: ignore[arg-type]
    assert (results.finished_sending, results.finished_recving) == (set(), set())
    opened.set()
    w.wait_loaded("req")
    results = HybridOffloadConnector.get_transfer_results(facade, set())  # type: ignore[arg-type]
    assert results.finished_sending == set() and results.failed_recving == set()
    assert results.finished_recving == {"req"}

    # vLLM 0.32's scheduler frees the aborted request on finished_recving and asserts on a second free
    freed: list[str] = []
    request = SimpleNamespace(request_id="req", status=RequestStatus.FINISHED_ABORTED)
    sched = SimpleNamespace(
        connector=SimpleNamespace(update_connector_output=lambda output: None),
        requests={"req": request},
        finished_recving_kv_req_ids=set(),
        _set_kv_fetch_stage=lambda *args: None,
    )
    sched._free_blocks = lambda r: (freed.append(r.request_id), sched.requests.pop(r.request_id))
    Scheduler._update_from_kv_xfer_finished(sched, results)  # type: ignore[arg-type]
    assert freed == ["req"]


def test_a_full_backend_evicts_a_chain_from_its_deep_end(world) -> None:
    """Pages go to a backend deepest first (and are read deepest first), so its LRU keeps the
    prefix, which every deeper page needs, and drops the state and the last chunks first."""
    w = world(cpu(capacity=3 * attn_page_len()))
    table = [3, 7, 5]
    w.cache.write_tokens(table, 0, 24)
    w.cache.fill_states([2])
    pages = [w.attn_page(c, table) for c in range(3)] + [w.mamba_page(2, (2,))]
    w.worker.copy_out([StoreJob(p, ("cpu",)) for p in pages])
    w.worker.flush(10)
    held = w.backend("cpu").contains_batch([p.key for p in pages])
    assert held[0] and held[1] and not held[3]  # the prefix stays, the state went first
    # a load refreshes the prefix last as well: a new page then evicts the deep end again
    w.worker.start_loads([load_job(tuple(p for p, h in zip(pages, held, strict=True) if h))])
    w.finish("req")
    extra = w.attn_page(4, [1, 2, 3, 4, 6])
    w.cache.write_tokens([1, 2, 3, 4, 6], 32, 8)
    w.worker.copy_out([StoreJob(extra, ("cpu",))])
    w.worker.flush(10)
    assert w.backend("cpu").contains_batch([pages[0].key, pages[1].key]) == [True, True]


def test_a_touched_chain_is_evicted_from_its_deep_end_across_turns(world) -> None:
    """Turn 2 of a chat stores the extension of turn 1's chain after it; the touch that ends
    turn 2 (deepest first, the state before the attention) makes a full backend evict in
    exactly that order: turn 2's state, then its attention (which no state needs any more),
    and the prefix every page needs last. Without the touch turn 1's prefix would go first,
    leaving turn 2's pages unloadable."""
    spec = make_spec()
    lens = [first_page_len(PageCodec(spec, spec.groups[g], BS)) for g in (ATTN, MAMBA)]
    w = world(cpu(capacity=4 * lens[0] + 2 * lens[1]))
    table = [3, 7, 5, 9]
    w.cache.write_tokens(table, 0, 32)
    w.cache.fill_states([2, 4])
    turn1 = [w.attn_page(0, table), w.attn_page(1, table), w.mamba_page(1, (2,))]
    turn2 = [w.attn_page(2, table), w.attn_page(3, table), w.mamba_page(3, (4,))]
    for pages in (turn1, turn2):
        w.worker.save(OffloadMetadata(stores=[StoreJob(p, ("cpu",)) for p in pages]))
    chain = tuple((w.planner.page_key(w.hashes[c], g), g) for c in (3, 2, 1, 0) for g in (MAMBA, ATTN))
    w.worker.save(OffloadMetadata(touches=[TouchJob(chain, ("cpu",))]))
    w.worker.flush(10)
    backend = w.backend("cpu")
    order = [k for k, _ in chain if backend.contains_batch([k])[0]]  # oldest first
    assert len(order) == 6
    for i in range(8):
        backend.put_batch([(w.planner.page_key(w.planner.chunk_hashes([i] * BS)[0], ATTN), bytes(lens[0]))])
        present = backend.contains_batch(order)
        gone = present.index(True) if any(present) else len(order)
        assert present == [False] * gone + [True] * (len(order) - gone)
    assert backend.contains_batch(order) == [False] * 6


# ---- held copies ----------------------------------------------------------------------------------
def test_held_pages_are_stored_only_when_committed(world) -> None:
    w = world()
    table, state_blocks = [3, 7, 5], [2, 4]
    w.cache.write_tokens(table, 0, 24)
    w.cache.fill_states(state_blocks)
    unkeyed = PageJob("", ATTN, 2, b"", (5,))
    w.worker.save(OffloadMetadata(stores=[
        StoreJob(unkeyed, (), "r1", hold=True),
        StoreJob(PageJob("", MAMBA, 1, b"", (2,)), (), "r1", hold=True),
    ]))
    first_state = b"".join(w.cache.state(layer, 2) for layer in MAMBA_LAYERS)
    # a later state of the same request and group replaces the held one
    w.worker.save(OffloadMetadata(stores=[StoreJob(PageJob("", MAMBA, 2, b"", (4,)), (), "r1", hold=True)]))
    expected_state = b"".join(w.cache.state(layer, 4) for layer in MAMBA_LAYERS)
    assert expected_state != first_state
    for tensor in [*w.cache.attn.values(), *w.cache.storage.values()]:
        tensor.zero_()  # held copies were taken when the step ended
    w.worker.flush(10)
    assert w.worker.worker_meta() is None  # nothing stored, nothing to settle yet

    attn, state, old_state = w.attn_page(2, table), w.mamba_page(2, (4,)), w.mamba_page(1, (2,))
    w.worker.save(OffloadMetadata(
        commits=[CommitJob("r1", attn, ("cpu",)), CommitJob("r1", state, ("cpu",)),
                 CommitJob("r1", old_state, ("cpu",))],  # replaced: settled, not stored
        releases=["r1"],
    ))
    w.worker.flush(10)
    meta = w.worker.worker_meta()
    assert meta is not None and sorted(meta.stored["cpu"]) == sorted(map(w.piece_key, [attn.key, state.key]))
    assert sorted(meta.settled) == sorted([attn.key, state.key, old_state.key])
    data = w.backend("cpu").get_batch([state.key])[0]
    _, payload = decode_page(data, w.worker.codecs[MAMBA].header(state, w.worker.codecs[MAMBA].written[0]))
    assert bytes(payload) == expected_state


def test_release_drops_what_a_request_holds(world) -> None:
    w = world(max_pending=attn_page_len())
    w.cache.write_tokens([3], 0, 8)
    hold = StoreJob(PageJob("", ATTN, 0, b"", (3,)), (), "r1", hold=True)
    w.worker.save(OffloadMetadata(stores=[hold]))
    # the hold budget is full: a second request's copy is dropped and counted
    w.worker.save(OffloadMetadata(stores=[StoreJob(PageJob("", ATTN, 0, b"", (3,)), (), "r2", hold=True)]))
    assert w.counters()["stores_dropped"] == 1
    w.worker.save(OffloadMetadata(releases=["r1"]))
    w.worker.save(OffloadMetadata(stores=[StoreJob(PageJob("", ATTN, 0, b"", (3,)), (), "r2", hold=True)]))
    assert w.counters()["stores_dropped"] == 1  # room again
    page = w.attn_page(0, [3])
    w.worker.save(OffloadMetadata(commits=[CommitJob("r1", page, ("cpu",))]))  # released: no page
    w.worker.flush(10)
    meta = w.worker.worker_meta()
    assert meta is not None and not meta.stored and meta.settled == [page.key]


# ---- bounded store queue ---------------------------------------------------------------------------
def test_stores_beyond_max_pending_bytes_are_dropped(world) -> None:
    w = world(max_pending=1)
    w.cache.write_tokens([3, 7, 5], 0, 24)
    pages = [w.attn_page(c, [3, 7, 5]) for c in range(3)]
    w.worker.copy_out([StoreJob(p, ("cpu",)) for p in pages])
    w.worker.flush(10)
    assert w.counters()["stores_dropped"] == 3
    assert w.counters()["pages_copied_out"] == 0
    meta = w.worker.worker_meta()
    assert meta is not None and not meta.stored and meta.settled == [p.key for p in pages]
    assert w.backend("cpu").contains_batch([p.key for p in pages]) == [False] * 3


def test_full_store_queue_drops_without_blocking(world) -> None:
    page_len = attn_page_len()
    w = world(max_pending=page_len + page_len // 2)
    w.cache.write_tokens([3, 7, 5], 0, 24)
    p0, p1, p2 = (w.attn_page(c, [3, 7, 5]) for c in range(3))
    opened = gate(w.backend("cpu"), "put_batch")
    w.worker.copy_out([StoreJob(p0, ("cpu",)), StoreJob(p1, ("cpu",))])  # p1 does not fit beside p0
    w.worker.copy_out([StoreJob(p2, ("cpu",))])  # p0 still pending: dropped, not waited for
    assert not opened.returned.is_set()  # both returned while p0's put was still held in the gate
    assert w.counters()["stores_dropped"] == 2
    opened.set()
    w.worker.flush(10)
    assert w.backend("cpu").contains_batch([p0.key, p1.key, p2.key]) == [True, False, False]
    w.worker.copy_out([StoreJob(p2, ("cpu",))])  # room again
    w.worker.flush(10)
    assert w.backend("cpu").contains_batch([p2.key]) == [True]
    assert w.counters()["stores_dropped"] == 2


# ---- reports to the scheduler -------------------------------------------------------------------
def test_worker_meta_reports_stores_once_and_cpu_evictions(world, tmp_path: Path) -> None:
    page_len = attn_page_len()
    disk = BackendConfig("disk", "disk", 1 << 30, options={"path": str(tmp_path / "disk")})
    w = world(cpu(capacity=2 * page_len + 10), disk)
    w.cache.write_tokens([3, 7, 5], 0, 24)
    pages = [w.attn_page(c, [3, 7, 5]) for c in range(3)]
    keys = [w.piece_key(p.key) for p in pages]
    w.worker.copy_out([StoreJob(p, ("cpu", "disk")) for p in pages[:2]])
    w.worker.copy_out([StoreJob(pages[2], ("cpu", "disk"))])
    w.worker.flush(10)
    meta = w.worker.worker_meta()
    assert meta is not None
    # each batch goes in deepest first: keys 1, 0, then 2 (which evicts the oldest, key 1)
    assert meta.stored == {"cpu": [keys[1], keys[0], keys[2]], "disk": [keys[1], keys[0], keys[2]]}
    assert meta.evicted == {"cpu": [keys[1]]}  # LRU; the disk backend's index is shared: no report
    assert w.worker.worker_meta() is None


# ---- promotion ---------------------------------------------------------------------------------
def promotion_world(world, tmp_path: Path, **kwargs: Any) -> tuple[World, list[PageJob], LoadJob]:
    """Pages stored in cpu and disk, then gone from cpu (evicted); a load of them from disk that
    promotes them into cpu."""
    disk = BackendConfig("disk", "disk", 1 << 30, options={"path": str(tmp_path / "disk")})
    w, pages, _ = stored_world(world, cpu(), disk, **kwargs)
    w.backend("cpu").delete_batch([p.key for p in pages])
    w.worker.worker_meta()  # drain the stores' reports
    dst = [11, 6, 13]
    load = (*(w.attn_page(c, dst) for c in range(3)), w.mamba_page(2, (12,)))
    hint = Retention("unit-x", weight=0.5)
    promotions = tuple(Promotion(p.key, p.group, ("cpu",), hint) for p in load)
    job = LoadJob("req", (LoadSegment("disk", load),), ("disk",), promotions=promotions)
    return w, pages, job


def test_a_load_promotes_what_it_read_into_the_faster_tier(world, tmp_path: Path) -> None:
    """After the load is written the store thread puts the pages, as read and checked, into the
    cpu tier (hints first), reports them stored, and gives the staging memory back."""
    w, pages, job = promotion_world(world, tmp_path)
    described: list[tuple[str, Retention]] = []
    cpu_tier = w.backend("cpu").raw
    real_describe = cpu_tier.describe_batch
    cpu_tier.describe_batch = lambda hints: (described.extend(hints), real_describe(hints))[1]
    w.worker.start_loads([job])
    assert w.finish("req") == ({"req"}, set())
    w.worker.flush(10)
    keys = [w.piece_key(p.key) for p in pages]
    disk = w.backend("disk")
    assert w.backend("cpu").get_batch([p.key for p in pages]) == disk.get_batch([p.key for p in pages])
    assert sorted(w.worker.worker_meta().stored["cpu"]) == sorted(keys)
    assert sorted(k for k, _ in described) == sorted(keys) and {r.weight for _, r in described} == {0.5}
    counters = w.counters()
    assert counters["pages_promoted"] == 4 and counters["promotions_dropped"] == 0
    assert counters["backends"]["cpu"]["stored_pages"] == 8  # 4 stored, 4 promoted
    assert w.worker.loads.staging.free_bytes > 0  # given back after the puts


def test_a_failed_load_promotes_nothing(world, tmp_path: Path) -> None:
    w, pages, job = promotion_world(world, tmp_path)
    w.backend("disk").delete_batch([pages[1].key])
    w.worker.start_loads([job])
    assert w.finish("req") == ({"req"}, {"req"})
    w.worker.flush(10)
    assert w.backend("cpu").contains_batch([p.key for p in pages]) == [False] * 4
    assert w.counters()["pages_promoted"] == 0


def test_promotions_past_the_pending_budget_are_dropped(world, tmp_path: Path) -> None:
    """The load itself is not affected; its staging goes back at once."""
    w, pages, job = promotion_world(world, tmp_path, max_pending=4 * attn_page_len())
    opened = gate(w.backend("disk"), "put_batch")
    w.worker.copy_out([StoreJob(w.attn_page(0, [3]), ("disk",))])  # pending while the gate holds it
    w.worker.start_loads([job])
    assert w.finish("req") == ({"req"}, set())
    opened.set()
    w.worker.flush(10)
    assert w.backend("cpu").contains_batch([p.key for p in pages]) == [False] * 4
    assert w.counters()["promotions_dropped"] == 4
    assert w.worker.loads.staging.free_bytes > 0


# ---- broken backends ---------------------------------------------------------------------------
def test_unavailable_backend_never_raises_into_the_caller(world) -> None:
    w, pages, _ = stored_world(world, cpu(), unavailable("flaky"))  # both hold every page
    broken = w.faulty("flaky")
    broken.fail(times=None, error=BackendUnavailableError("medium gone"))

    w.cache.write_tokens([3, 7, 5, 8], 24, 8)
    more = w.attn_page(3, [3, 7, 5, 8])
    w.worker.copy_out([StoreJob(more, ("cpu", "flaky"))])
    w.worker.flush(10)
    counters = w.counters()
    assert counters["backends"]["flaky"]["store_failures"] == 1
    assert counters["backends"]["cpu"]["stored_pages"] == len(pages) + 1
    assert counters["backend_errors"] >= 1
    meta = w.worker.worker_meta()
    assert meta is not None and meta.stored == {  # each batch deepest first
        "cpu": [w.piece_key(p.key) for p in (*reversed(pages), more)],
        "flaky": [w.piece_key(p.key) for p in reversed(pages)],
    }

    dst = [11, 6, 13]
    pages_dst = (*(w.attn_page(c, dst) for c in range(3)), w.mamba_page(2, (12,)))
    w.worker.start_loads([load_job(pages_dst, "flaky", "from-flaky")])
    assert w.finish("from-flaky") == ({"from-flaky"}, {"from-flaky"})
    w.worker.start_loads([load_job(pages_dst, "cpu", "from-cpu")])
    assert w.finish("from-cpu") == ({"from-cpu"}, set())

    # anything else a backend raises is survived too: the store thread and the loads go on
    broken.fail(times=None, error=RuntimeError("bug in a backend"))
    w.worker.copy_out([StoreJob(more, ("flaky",))])
    w.worker.flush(10)
    w.worker.start_loads([load_job(pages_dst, "flaky", "crash")])
    assert w.finish("crash") == ({"crash"}, {"crash"})
    w.worker.copy_out([StoreJob(w.attn_page(0, [3]), ("cpu",))])
    w.worker.flush(10)
    assert w.counters()["backends"]["cpu"]["stored_pages"] == len(pages) + 2


def test_staging_memory_a_failed_read_was_given_is_never_reused(world) -> None:
    """A backend that raised may still write into the rows it was given: that load's staging
    memory stays out of the pool (the fallback read it into buffers of its own); a clean
    load's goes back and the next load reads into it."""
    clock = [0.0]
    w, _, _ = stored_world(world, unavailable("flaky"), cpu(), clock=lambda: clock[0])
    w.faulty("flaky").fail(times=None, error=BackendUnavailableError("medium gone"))
    dst = [11, 6, 13]
    pages_dst = (*(w.attn_page(c, dst) for c in range(3)), w.mamba_page(2, (12,)))
    job = load_job(pages_dst, "flaky", "fell-back")
    w.worker.start_loads([LoadJob(job.req_id, job.segments, ("cpu",))])
    assert w.finish("fell-back") == ({"fell-back"}, set())
    assert w.worker.loads.staging.free_bytes == 0
    w.faulty("flaky").heal()  # the next loads read it into staging rows again
    clock[0] = 60.0  # past its backoff
    w.worker.start_loads([load_job(pages_dst, "flaky", "clean")])
    assert w.finish("clean") == ({"clean"}, set())
    kept = w.worker.loads.staging.free_bytes
    assert kept > 0
    w.worker.start_loads([load_job(pages_dst, "flaky", "again")])
    assert w.finish("again") == ({"again"}, set())
    assert w.worker.loads.staging.free_bytes == kept


def test_unavailable_backend_while_deleting_a_corrupt_page(world) -> None:
    w, pages, _ = stored_world(world, unavailable("flaky"))
    backend = w.backend("flaky")
    data = bytearray(backend.get_batch([pages[0].key])[0])
    data[-1] ^= 1
    backend.put_batch([(pages[0].key, bytes(data))])
    w.faulty("flaky").fail("delete_batch", times=None)
    w.worker.start_loads([load_job((pages[0],), "flaky", "req")])
    assert w.finish("req") == ({"req"}, {"req"})
    assert w.counters()["bad_pages"] == 1
    assert w.counters()["backend_errors"] == 1


# ---- shutdown ---------------------------------------------------------------------------------------
def test_shutdown_flushes_pending_stores_and_closes_backends(world, tmp_path: Path) -> None:
    disk = BackendConfig("disk", "disk", 1 << 30, options={"path": str(tmp_path / "disk")})
    w = world(cpu(), disk)
    w.cache.write_tokens([3, 7, 5], 0, 24)
    pages = [w.attn_page(c, [3, 7, 5]) for c in range(3)]
    opened = gate(w.backend("disk"), "put_batch")  # disk writes wait until shutdown flushes
    flush = w.worker.flush
    w.worker.flush = lambda timeout=None: (opened.set(), flush(timeout))[1]  # type: ignore[method-assign]
    for p in pages:
        w.worker.copy_out([StoreJob(p, ("cpu", "disk"))])
    assert not opened.returned.is_set()
    w.worker.shutdown(timeout=60)

    assert w.counters()["backends"]["disk"]["stored_pages"] == 3
    assert w.counters()["backends"]["cpu"]["stored_pages"] == 3
    for name in ("cpu", "disk"):
        with pytest.raises(BackendClosedError):
            w.backend(name).contains_batch([pages[0].key])
    reopened = create_backend(disk)
    try:
        assert reopened.contains_batch([w.piece_key(p.key) for p in pages]) == [True] * 3
    finally:
        reopened.close()


def test_shutdown_is_idempotent_and_flush_after_it_returns(world) -> None:
    w = world()
    w.worker.shutdown(timeout=10)

    def again() -> None:
        w.worker.shutdown(timeout=3600)  # vLLM may shut a connector down twice
        w.worker.flush()  # no timeout: must not wait for a stopped store thread

    thread = threading.Thread(target=again, daemon=True)
    thread.start()
    thread.join(60)  # only a hang (waiting for the stopped store thread) gets this far
    assert not thread.is_alive(), "a second shutdown or a later flush waits forever"


def test_down_backend_is_skipped_while_backing_off_then_probed(world) -> None:
    clock = [0.0]
    w, pages, _ = stored_world(world, unavailable("flaky"), clock=lambda: clock[0])
    broken = w.faulty("flaky")
    health = w.worker.tiers["flaky"].health
    reads = broken.calls.get("get_into", 0)

    broken.fail(times=None, error=BackendUnavailableError("server down"))
    w.worker.start_loads([load_job((pages[0],), "flaky", "r1")])
    assert w.finish("r1") == ({"r1"}, {"r1"})
    assert health.is_down and health.failures == 1 and broken.calls["get_into"] == reads + 1

    broken.heal()  # back, but the worker only notices at the next probe
    w.worker.start_loads([load_job((pages[0],), "flaky", "r2")])
    assert w.finish("r2") == ({"r2"}, {"r2"})
    w.worker.copy_out([StoreJob(pages[1], ("flaky",))])
    w.worker.flush(10)
    assert broken.calls["get_into"] == reads + 1 and w.counters()["backends"]["flaky"]["unavailable"] == 2

    clock[0] = 1.0
    w.worker.start_loads([load_job((pages[0],), "flaky", "r3")])
    assert w.finish("r3") == ({"r3"}, set())
    assert not health.is_down and health.recoveries == 1 and broken.calls["get_into"] == reads + 2


def test_switch_interval_is_lowered_only_while_a_load_is_in_flight(world) -> None:
    default = sys.getswitchinterval()
    w, _, _ = stored_world(world)
    w.worker.loads.switch.interval_s = 0.0005
    opened = gate(w.backend("cpu"), "lease_batch")
    w.worker.start_loads([load_job((w.attn_page(0, [11, 6, 13]),))])
    assert sys.getswitchinterval() == 0.0005  # the load thread waits in the gate
    opened.set()
    w.finish("req")
    assert sys.getswitchinterval() == default


def test_switch_interval_changed_by_someone_else_meanwhile_is_kept() -> None:
    default = sys.getswitchinterval()
    switch = LoadSwitchInterval(0.0005)
    try:
        switch.loading(True)
        sys.setswitchinterval(0.002)
        switch.loading(False)
        assert sys.getswitchinterval() == 0.002
        LoadSwitchInterval(0.0).loading(True)  # 0 disables
        assert sys.getswitchinterval() == 0.002
    finally:
        sys.setswitchinterval(default)


def test_an_idle_step_waits_for_a_load_in_flight(world) -> None:
    """A step that schedules nothing waits for a load (up to wait_s) instead of returning to a
    spinning step loop; a load not done by then is reported by a later step."""
    w, pages, _ = stored_world(world)
    held = gate(w.backend("cpu"), "lease_batch")
    w.worker.start_loads([load_job(tuple(pages))])
    assert w.worker.write_finished_loads(wait_s=0.01) == (set(), set())  # not done: returns anyway
    held.set()
    assert w.worker.write_finished_loads(wait_s=60) == ({"req"}, set())  # returns once it is done
