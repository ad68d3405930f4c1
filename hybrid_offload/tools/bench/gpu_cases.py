"""The measurements behind ``hybrid-offload bench gpu`` (:mod:`.gpu`): ceilings, the enqueue
probe, store/load cases and interference, on torch and the data-path harness
(:mod:`hybrid_offload.testing.datapath`). Imported only when the benchmark runs: the harness
imports the connector, and the CLI must start without torch or vLLM.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hybrid_offload.backends import BackendConfig
from hybrid_offload.testing.datapath import HybridShape, KVWorld, fill_random, kv_bytes_at

if TYPE_CHECKING:
    from hybrid_offload.connector.metadata import LoadJob, PageJob, StoreJob

GB = 1e9
#: the cpu tier of a case: a GPU worker page-locks all of it once (a 64k-token request of the
#: Qwen3-Next-80B shape is 1.65 GB)
TIER_BYTES = 4 << 30
#: tokens per prefill step for the per-step store figures (a long request's chunked prefill)
STEP_TOKENS = 8192


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int = 5) -> float:
    """Median seconds of ``fn`` (synchronized on CUDA), after one warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ceilings(device: torch.device, nbytes: int = 1 << 30) -> dict[str, float]:
    """Pinned H2D and D2H GB/s of one ``nbytes`` copy."""
    if device.type != "cuda":
        return {}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), device)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), device)
    d2d_dst = torch.empty_like(dev)
    d2d = _timed(lambda: d2d_dst.copy_(dev), device)
    return {"h2d_gbps": nbytes / h2d / GB, "d2h_gbps": nbytes / d2h / GB, "d2d_gbps": 2 * nbytes / d2d / GB}


def enqueue_probe(device: torch.device, nbytes: int = 1 << 30) -> dict[str, float]:
    """Milliseconds the calling thread spends enqueuing: one large pinned copy to the device,
    then a small index copy from pageable and from pinned memory behind it on the same stream."""
    if device.type != "cuda":
        return {}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    small = torch.arange(4096, dtype=torch.int64)
    out = {}
    for name, move in (("pageable", lambda: small.to(device, non_blocking=True)),
                       ("pinned", lambda: small.pin_memory().to(device, non_blocking=True))):  # fmt: skip
        move()
        torch.cuda.synchronize()
        start = time.perf_counter()
        big = host.to(device, non_blocking=True)
        enqueued = time.perf_counter()
        move()
        done = time.perf_counter()
        torch.cuda.synchronize()
        out["large_h2d_enqueue_ms"] = (enqueued - start) * 1e3
        out[f"small_{name}_after_large_ms"] = (done - enqueued) * 1e3
        del big
    return out


def _counters(world: KVWorld) -> dict[str, float]:
    return dict(world.worker.stats.snapshot())


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> float:
    return float(after.get(key, 0)) - float(before.get(key, 0))


def _one_load(world: KVWorld, pages: list[PageJob], req: str) -> tuple[float, float]:
    """Load ``pages`` as the model-runner thread does; (wall seconds, its CPU seconds)."""
    start = time.perf_counter()
    c0 = time.thread_time()
    world.worker.start_loads([_load_job(pages, req)])
    cpu = time.thread_time() - c0
    while time.perf_counter() - start < 120:
        c0 = time.thread_time()
        recving, failed = world.worker.write_finished_loads(wait_s=0.005)  # an idle engine's step
        cpu += time.thread_time() - c0
        if req in recving:
            if req in failed:
                raise RuntimeError(f"load {req} failed")
            return time.perf_counter() - start, cpu
    raise TimeoutError(f"load {req} did not finish in 120 s")


def _load_job(pages: list[PageJob], req: str) -> LoadJob:
    from hybrid_offload.connector.metadata import LoadJob, LoadSegment

    return LoadJob(req, (LoadSegment("cpu", tuple(pages)),))


def transfer_case(shape: HybridShape, layout: str, tokens: int, device: str, repeats: int) -> dict[str, Any]:
    """Store then load one request of ``tokens`` tokens; GB/s and phases."""
    blocks = 2 * -(-tokens // shape.block_size()) + 3
    world = KVWorld(shape, blocks, layout, device, [BackendConfig("cpu", "cpu", TIER_BYTES)],
                    staging_pool_bytes=8 << 30)  # fmt: skip
    try:
        fill_random(world.raw, 7)
        ids = torch.randperm(blocks - 3, generator=torch.Generator().manual_seed(tokens)) + 1
        need = -(-tokens // world.block_size)
        src, dst = ids[:need].tolist(), ids[need : 2 * need].tolist()
        toks = torch.randint(0, 50_000, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
        store_pages = world.pages(toks, src, blocks - 2)
        load_pages = world.pages(toks, dst, blocks - 1)
        sync = torch.cuda.synchronize if world.device.type == "cuda" else (lambda: None)

        stores = []
        for _ in range(repeats + 1):  # the first pins the store rows (then pooled)
            before = _counters(world)
            sync()
            start = time.perf_counter()
            c0 = time.thread_time()
            world.worker.copy_out([_store_job(p) for p in store_pages])
            copy_cpu, copy_wall = time.thread_time() - c0, time.perf_counter() - start
            world.worker.transfers.stored().wait()
            device_s = time.perf_counter() - start
            world.worker.flush(600)
            stores.append({"s": time.perf_counter() - start, "device_s": device_s, "cpu": copy_cpu,
                           "wall": copy_wall, "bytes": _delta(_counters(world), before, "bytes_copied_out")})
        stores = stores[1:]

        def smed(key: str) -> float:
            return statistics.median(r[key] for r in stores)

        stored, store_s, device_s = smed("bytes"), smed("s"), smed("device_s")
        copy_cpu, copy_wall = smed("cpu"), smed("wall")
        step_cpu = _step_store_cpu(world, store_pages)

        runs = []
        for r in range(repeats + 1):  # the first warms the pools
            before = _counters(world)
            wall, cpu = _one_load(world, load_pages, f"load-{r}")
            after = _counters(world)
            names = ("queued", "prepare", "read", "verify", "ready", "write", "total")
            phases = {p: _delta(after, before, f"load_{p}_seconds") for p in names}
            device_part = phases["write"]  # CUDA: the load thread's device work, enqueue to completion
            runs.append({"wall_s": wall, "runner_cpu_s": cpu, "device_s": device_part, **phases,
                         "copy_s": _delta(after, before, "load_copy_seconds"),
                         "bytes": _delta(after, before, "bytes_loaded")})  # fmt: skip
        runs = runs[1:]
        m = len(world.planner.chunk_hashes(toks)) * world.chunk
        name = world.spec.groups[0].layer_names[0]
        identical = torch.equal(kv_bytes_at(world.views[name], src, world.block_size, range(m)),
                                kv_bytes_at(world.views[name], dst, world.block_size, range(m)))  # fmt: skip

        def med(key: str) -> float:
            return statistics.median(r[key] for r in runs)

        loaded = med("bytes")
        return {
            "layout": layout, "tokens": tokens, "identical": identical,
            "store_bytes": stored, "store_s": store_s, "store_gbps": stored / store_s / GB,
            "store_device_s": device_s, "store_device_gbps": stored / device_s / GB,
            "store_runner_cpu_ms": copy_cpu * 1e3, "store_runner_wall_ms": copy_wall * 1e3,
            "store_step_tokens": STEP_TOKENS, "store_step_runner_cpu_ms": step_cpu * 1e3,
            "load_bytes": loaded, "load_s": med("wall_s"), "load_gbps": loaded / med("wall_s") / GB,
            "load_read_s": med("read"), "load_verify_s": med("verify"),
            "load_read_gbps": loaded / med("read") / GB, "load_verify_gbps": loaded / med("verify") / GB,
            "load_device_s": med("device_s"), "load_device_gbps": loaded / med("device_s") / GB,
            "load_copy_s": med("copy_s"),
            "load_runner_cpu_ms": med("runner_cpu_s") * 1e3, "load_enqueue_ms": med("write") * 1e3,
        }  # fmt: skip
    finally:
        world.close()


def _step_store_cpu(world: KVWorld, pages: list[PageJob]) -> float:
    """The model-runner thread's CPU seconds per ``wait_for_save`` of a prefill step of
    :data:`STEP_TOKENS` tokens (median over the request's steps; each step stores its chunks,
    the last one the states too)."""
    per_step = STEP_TOKENS // world.chunk
    steps: dict[int, list[PageJob]] = {}
    last = max(p.chunk_index for p in pages)
    for p in pages:
        steps.setdefault(min(p.chunk_index, last) // per_step, []).append(p)
    times = []
    for chunk in steps.values():
        c0 = time.thread_time()
        world.worker.copy_out([_store_job(p) for p in chunk])
        times.append(time.thread_time() - c0)
    world.worker.flush(600)
    return statistics.median(times)


def _store_job(page: PageJob) -> StoreJob:
    from hybrid_offload.connector.metadata import StoreJob

    return StoreJob(page, ("cpu",))


def _stored_request(
    shape: HybridShape, layout: str, tokens: int, device: str, seed: int, staging: int
) -> tuple[KVWorld, list[PageJob], list[PageJob]]:
    """A world whose cpu tier holds one ``tokens``-token request: (world, the request's pages to
    load into other blocks, its attention pages to store again)."""
    blocks = 2 * -(-tokens // shape.block_size()) + 3
    world = KVWorld(shape, blocks, layout, device, [BackendConfig("cpu", "cpu", TIER_BYTES)],
                    staging_pool_bytes=staging)  # fmt: skip
    try:
        fill_random(world.raw, seed)
        need = -(-tokens // world.block_size)
        toks = torch.randint(0, 50_000, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
        src, dst = list(range(1, need + 1)), list(range(need + 1, 2 * need + 1))
        world.store(world.pages(toks, src, blocks - 2), ["cpu"])
        load_pages = world.pages(toks, dst, blocks - 1)
        step_pages = [p for p in world.pages(toks, src, blocks - 2) if p.group == 0]
    except BaseException:
        world.close()
        raise
    return world, load_pages, step_pages


def interference(
    shape: HybridShape, layout: str, tokens: int, device: str, steps: int = 60
) -> dict[str, Any]:
    """A matmul loop (one step: ~10 ms of bf16 matmuls, the connector's step work, a sync) alone
    and while a ``tokens``-token load runs back to back and every step stores a chunk's pages."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {}
    world, load_pages, step_pages = _stored_request(shape, layout, tokens, device, 9, 8 << 30)
    try:
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)

        def loop(loading: bool, storing: bool) -> tuple[float, int]:
            loads = 0
            inflight: str | None = None
            torch.cuda.synchronize()
            start = time.perf_counter()
            for step in range(steps):
                for _ in range(8):
                    torch.mm(a, b)
                if loading:
                    if inflight is None:
                        inflight = f"bg-{step}"
                        world.worker.start_loads([_load_job(load_pages, inflight)])
                    recving, _ = world.worker.write_finished_loads()
                    if inflight in recving:
                        loads, inflight = loads + 1, None
                if storing:
                    chunk = step_pages[(step * 16) % len(step_pages) :][:16]
                    world.worker.copy_out([_store_job(p) for p in chunk])
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            while inflight is not None:  # drain
                recving, _ = world.worker.write_finished_loads(wait_s=0.01)
                if inflight in recving:
                    inflight = None
            world.worker.flush(600)
            return elapsed, loads

        bad_before = world.worker.stats.snapshot()["bad_pages"]
        loop(False, False)  # warm-up
        loop(True, True)
        alone = min(loop(False, False)[0] for _ in range(2))
        loads_s, _ = loop(True, False)
        stores_s, _ = loop(False, True)
        both_s, both = loop(True, True)
        return {"layout": layout, "tokens": tokens, "steps": steps, "alone_s": alone,
                "loads_s": loads_s, "stores_s": stores_s, "both_s": both_s,
                "slowdown_loads": loads_s / alone - 1, "slowdown_stores": stores_s / alone - 1,
                "slowdown": both_s / alone - 1, "loads_during": both,
                "bad_pages": world.worker.stats.snapshot()["bad_pages"] - bad_before}  # fmt: skip
    finally:
        world.close()




def churn(shape: HybridShape, layout: str, tokens: int, device: str, loads: int = 40) -> dict[str, Any]:
    """Loads of one request back to back while every step stores 16 of its attention pages again
    (new versions replacing those the loads read). A page failing its check is kept (not
    deleted, as the connector would) and checked again on the host afterwards: a page that is
    good in the tier was damaged on its way to the device; one bad in the tier was stored bad."""
    from hybrid_offload.core.page_format import PageFormatError, verify_page

    world, load_pages, step_pages = _stored_request(shape, layout, tokens, device, 11, 1 << 30)
    found: list[tuple[str, str]] = []
    pipeline = world.worker.loads
    report = pipeline._bad_page

    def keep(name: str, key: str, exc: PageFormatError, backend: Any = None) -> None:
        found.append((key, str(exc)))
        report(name, key, exc, backend)

    pipeline._bad_page = keep  # type: ignore[method-assign]
    pipeline._delete_quietly = lambda backend, key: None  # type: ignore[method-assign]
    try:
        sync = torch.cuda.synchronize if world.device.type == "cuda" else (lambda: None)
        done = failed = step = 0
        inflight: str | None = None
        while done < loads:
            if inflight is None:
                inflight = f"churn-{step}"
                world.worker.start_loads([_load_job(load_pages, inflight)])
            recving, failures = world.worker.write_finished_loads(wait_s=0.001)
            if inflight in recving:
                done, failed, inflight = done + 1, failed + (inflight in failures), None
            chunk = step_pages[(step * 16) % len(step_pages) :][:16]
            world.worker.copy_out([_store_job(p) for p in chunk])
            sync()
            step += 1
        world.worker.flush(600)
        where = {}
        for p in load_pages:
            for piece in world.worker.codecs[p.group].read:
                where[world.planner.piece_key(p.key, p.group, piece)] = (p, piece)
        verdicts = []
        backend = world.worker.backends["cpu"]
        for key, why in found:
            lease = backend.lease_batch([key])
            view, (page, piece) = lease.views[0], where[key]
            codec = world.worker.codecs[page.group]
            try:
                if view is None:
                    verdict = "replaced since"
                else:
                    verify_page(bytes(view), codec.templates[piece], page.chunk_hash, page.chunk_index)
                    verdict = "good in the tier"
            except PageFormatError as exc:
                verdict = f"bad in the tier: {exc}"
            finally:
                lease.release()
            verdicts.append({"key": key, "group": page.group, "chunk": page.chunk_index, "why": why,
                             "verdict": verdict})  # fmt: skip
        return {"layout": layout, "tokens": tokens, "loads": done, "failed": failed, "steps": step,
                "bad_pages": len(found), "pages": verdicts[:20]}  # fmt: skip
    finally:
        world.close()
