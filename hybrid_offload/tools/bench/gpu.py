"""`hybrid-offload bench gpu`: the data path against the hardware, without vLLM.

On a Qwen3-Next-80B-A3B-shaped cache (12 attention layers of 2 KV heads x 256, 36 GDN layers;
bf16) in vLLM 0.32's GPU layouts, per request length:

* the ceilings: one large pinned host-to-device and device-to-host copy;
* stores (GPU blocks -> cpu tier) and loads (cpu tier -> GPU blocks) through the worker as the
  connector drives it, with the load's phases (read and verify on the load thread; the device
  part: one copy to the device and the scatters, from enqueue to completion);
* the model-runner thread's CPU time per load (the enqueue);
* the slowdown of a matmul loop on the default stream (one step: matmuls, then the connector's
  step work, then a sync, as vLLM's steps end) while loads and stores run.

Runs on ``cpu`` too (``--device cpu``: no ceilings, no streams), for a smoke run. Torch alone:
``scripts/gpu_check.sh`` runs it on the GPU machine, which has no vLLM.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybrid_offload.backends import BackendConfig
from hybrid_offload.testing.datapath import QWEN3_NEXT_80B, HybridShape, KVWorld, fill_random, kv_bytes_at
from hybrid_offload.tools.bench.common import bar_plot, format_table, write_results

GB = 1e9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    p.add_argument("--tokens", default="4096,16384,65536", help="request lengths, comma-separated")
    p.add_argument("--layouts", default="LBNHC,BLHNC",
                   help="vLLM KV cache layouts (the first is vLLM's default)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="timed loads per case (the median is reported)")


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


def _one_load(world: KVWorld, pages: list, req: str) -> tuple[float, float]:  # type: ignore[type-arg]
    """Load ``pages`` as the model-runner thread does; (wall seconds, its CPU seconds)."""
    cpu = 0.0
    start = time.perf_counter()
    world.worker.start_loads([_load_job(pages, req)])
    while time.perf_counter() - start < 120:
        c0 = time.thread_time()
        recving, failed = world.worker.write_finished_loads(wait_s=0.005)  # an idle engine's step
        cpu += time.thread_time() - c0
        if req in recving:
            if req in failed:
                raise RuntimeError(f"load {req} failed")
            return time.perf_counter() - start, cpu
    raise TimeoutError(f"load {req} did not finish in 120 s")


def _load_job(pages: list, req: str):  # type: ignore[no-untyped-def,type-arg]
    from hybrid_offload.connector.metadata import LoadJob, LoadSegment

    return LoadJob(req, (LoadSegment("cpu", tuple(pages)),))


def transfer_case(shape: HybridShape, layout: str, tokens: int, device: str, repeats: int) -> dict[str, Any]:
    """Store then load one request of ``tokens`` tokens; GB/s and phases."""
    blocks = 2 * -(-tokens // shape.block_size()) + 3
    world = KVWorld(shape, blocks, layout, device, [BackendConfig("cpu", "cpu", 1 << 36)],
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

        runs = []
        for r in range(repeats + 1):  # the first warms the pools
            before = _counters(world)
            wall, cpu = _one_load(world, load_pages, f"load-{r}")
            after = _counters(world)
            names = ("queued", "prepare", "read", "verify", "ready", "write", "total")
            phases = {p: _delta(after, before, f"load_{p}_seconds") for p in names}
            device_part = phases["total"] - sum(phases[p] for p in names[:5])
            runs.append({"wall_s": wall, "runner_cpu_s": cpu, "device_s": device_part, **phases,
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
            "load_bytes": loaded, "load_s": med("wall_s"), "load_gbps": loaded / med("wall_s") / GB,
            "load_read_s": med("read"), "load_verify_s": med("verify"),
            "load_read_gbps": loaded / med("read") / GB, "load_verify_gbps": loaded / med("verify") / GB,
            "load_device_s": med("device_s"), "load_device_gbps": loaded / med("device_s") / GB,
            "load_runner_cpu_ms": med("runner_cpu_s") * 1e3, "load_enqueue_ms": med("write") * 1e3,
        }  # fmt: skip
    finally:
        world.close()


def _store_job(page):  # type: ignore[no-untyped-def]
    from hybrid_offload.connector.metadata import StoreJob

    return StoreJob(page, ("cpu",))


def interference(
    shape: HybridShape, layout: str, tokens: int, device: str, steps: int = 60
) -> dict[str, Any]:
    """A matmul loop (one step: ~10 ms of bf16 matmuls, the connector's step work, a sync) alone
    and while a ``tokens``-token load runs back to back and every step stores a chunk's pages."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {}
    blocks = 2 * -(-tokens // shape.block_size()) + 3
    world = KVWorld(shape, blocks, layout, device, [BackendConfig("cpu", "cpu", 1 << 36)],
                    staging_pool_bytes=8 << 30)  # fmt: skip
    try:
        fill_random(world.raw, 9)
        need = -(-tokens // world.block_size)
        toks = torch.randint(0, 50_000, (tokens,), generator=torch.Generator().manual_seed(2)).tolist()
        src, dst = list(range(1, need + 1)), list(range(need + 1, 2 * need + 1))
        world.store(world.pages(toks, src, blocks - 2), ["cpu"])
        load_pages = world.pages(toks, dst, blocks - 1)
        step_pages = [p for p in world.pages(toks, src, blocks - 2) if p.group == 0]
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

        loop(False, False)  # warm-up
        loop(True, True)
        alone = min(loop(False, False)[0] for _ in range(2))
        loads_s, _ = loop(True, False)
        stores_s, _ = loop(False, True)
        both_s, both = loop(True, True)
        return {"layout": layout, "tokens": tokens, "steps": steps, "alone_s": alone,
                "loads_s": loads_s, "stores_s": stores_s, "both_s": both_s,
                "slowdown_loads": loads_s / alone - 1, "slowdown_stores": stores_s / alone - 1,
                "slowdown": both_s / alone - 1, "loads_during": both}  # fmt: skip
    finally:
        world.close()


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench gpu: no CUDA device here (use --device cpu for a smoke run)")
        return 2
    tokens = [int(t) for t in str(args.tokens).split(",")]
    layouts = str(args.layouts).split(",")
    shape = QWEN3_NEXT_80B
    if args.quick:
        tokens, shape = [1024], HybridShape(**{**QWEN3_NEXT_80B.__dict__, "attn_layers": 1, "gdn_layers": 3,
                                               "group_layers": 1})  # fmt: skip
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"bench gpu on {name}")
    ceil = ceilings(device)
    print("ceilings:", {k: round(v, 1) for k, v in ceil.items()})
    probe = enqueue_probe(device)
    print("enqueue probe:", {k: round(v, 3) for k, v in probe.items()})
    rows = []
    for layout in layouts:
        for n in tokens:
            row = transfer_case(shape, layout, n, args.device, 1 if args.quick else args.repeats)
            if ceil:
                row["load_device_vs_h2d"] = row["load_device_gbps"] / ceil["h2d_gbps"]
                row["store_device_vs_d2h"] = row["store_device_gbps"] / ceil["d2h_gbps"]
            rows.append(row)
            print(format_table([row], ["layout", "tokens", "load_gbps", "load_device_gbps", "load_s",
                                       "load_device_s", "load_runner_cpu_ms", "store_gbps",
                                       "store_device_gbps", "identical"]))  # fmt: skip
    slow = [] if args.quick else [interference(shape, layouts[0], min(max(tokens), 16384), args.device)]
    slow = [s for s in slow if s]
    for s in slow:
        print("interference:", {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()})
    out = Path(args.out)
    payload = {"device": name, "shape": shape.__dict__, "ceilings": ceil, "enqueue": probe, "rows": rows,
               "interference": slow, "args": {"tokens": tokens, "layouts": layouts}}  # fmt: skip
    path = write_results("gpu", payload, out, args.quick)
    labels = [f"{r['layout']} {r['tokens'] // 1024}k" for r in rows]
    series = {"load (tier->GPU)": [r["load_gbps"] for r in rows],
              "load device part": [r["load_device_gbps"] for r in rows],
              "store (GPU->tier)": [r["store_gbps"] for r in rows],
              "store device part": [r["store_device_gbps"] for r in rows]}  # fmt: skip
    if ceil:
        series["H2D ceiling"] = [ceil["h2d_gbps"]] * len(rows)
        series["D2H ceiling"] = [ceil["d2h_gbps"]] * len(rows)
    bar_plot(path.with_suffix(".png"), f"data path on {name}", labels, series, "GB/s")
    print(f"wrote {path}")
    return 0 if all(r["identical"] for r in rows) else 1


def main() -> int:
    """``python -m hybrid_offload.tools.bench.gpu`` (no CLI, so no vLLM import)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
