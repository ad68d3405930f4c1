"""Quick throughput check of the nixl_peer backend vs a raw NIXL READ/WRITE on loopback.

Starts one ``hybrid-offload peer`` process, then in this process measures, for pages of
``--page-kib`` KiB in calls of ``--batch`` pages:

* ``put_batch`` and ``get_into`` through :class:`NixlPeerBackend` (control round trips, one
  batched NIXL transfer per call), from and into rows of one block as the connector's are,
  with ``zero_copy`` (the block registered per call) and without (through staging);
* a raw NIXL READ / WRITE of the same bytes between a registered buffer of this process and the
  same peer's pool (same descriptors per call, no control channel, no staging copy);
* a numpy memory copy of the same bytes (the ceiling on this machine).

Usage: ``.venv/bin/python benchmarks/quick_nixl_peer.py [--pages 256] [--page-kib 256]``.
Figures are noisy on a shared 2-core machine: compare ratios from one run.
"""

from __future__ import annotations

import argparse
import socket
import time
import uuid
from typing import Any

import numpy as np

from hybrid_offload.backends import BackendConfig, create_backend
from hybrid_offload.backends.nixl_peer.auth import raw_handshake
from hybrid_offload.compat import nixl_api
from hybrid_offload.testing.services import start_peer


def best(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


def raw_nixl(address: str, total: int, page: int, batch: int, repeats: int) -> dict[str, float]:
    host, port = address.split(":")
    with socket.create_connection((host, int(port))) as sock:
        hello = raw_handshake(sock, b"", "bench-raw").hello
    api = nixl_api()
    agent = api.nixl_agent(f"bench-{uuid.uuid4().hex}", api.nixl_agent_config(False, backends=["UCX"]))
    buf = np.ones(total, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    agent.add_remote_agent(hello.metadata)
    n = total // page

    def run(op: str) -> None:
        for start in range(0, n, batch):
            idx = range(start, min(n, start + batch))
            local = np.array([(buf.ctypes.data + i * page, page, 0) for i in idx], np.uint64)
            remote = np.array([(hello.pool_base + i * page, page, 0) for i in idx], np.uint64)
            handle = agent.initialize_xfer(
                op, agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"),
                hello.agent_name,
            )  # fmt: skip
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            assert state == "DONE", state
            handle.release()

    out = {"raw NIXL WRITE": total / best(lambda: run("WRITE"), repeats),
           "raw NIXL READ": total / best(lambda: run("READ"), repeats)}  # fmt: skip
    agent.remove_remote_agent(hello.agent_name)
    agent.deregister_memory(reg)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--page-kib", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="pages per call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--progress-delay-us", type=int, default=100, help="the peer's (0: spinning)")
    args = parser.parse_args()
    page = args.page_kib << 10
    total = args.pages * page
    peer = start_peer(2 * total, extra_args=["--progress-delay-us", str(args.progress_delay_us)])
    address = peer.address
    try:
        rng = np.random.default_rng(0)
        data = [rng.integers(0, 256, page, dtype=np.uint8).tobytes() for _ in range(args.pages)]
        keys = [f"be0c0001-{i:032x}" for i in range(args.pages)]
        block = memoryview(bytearray(total))
        rows = [block[i * page : (i + 1) * page] for i in range(args.pages)]
        for row, datum in zip(rows, data, strict=True):
            row[:] = datum
        chunks = range(0, args.pages, args.batch)
        results = {}
        for zero_copy in (True, False):
            options = {"peers": [address], "zero_copy": zero_copy, "insecure": True}
            backend = create_backend(BackendConfig("nixl_peer", "bench", 2 * total, options=options))

            def put(backend: Any = backend) -> None:
                for s in chunks:
                    assert all(backend.put_batch(list(zip(keys[s : s + args.batch], rows[s : s + args.batch],
                                                          strict=True))))  # fmt: skip

            def get(backend: Any = backend) -> None:
                for s in chunks:
                    sizes = backend.get_into(keys[s : s + args.batch], rows[s : s + args.batch])
                    assert sizes == [page] * len(sizes)

            put()  # warm-up: agent, registration, metadata exchange
            kind = "zero copy" if zero_copy else "staged"
            results[f"put_batch ({kind})"] = total / best(put, args.repeats)
            block[:] = bytes(total)
            results[f"get_into ({kind})"] = total / best(get, args.repeats)
            assert all(bytes(row) == datum for row, datum in zip(rows, data, strict=True))
            assert backend.transfers["direct" if zero_copy else "staged"] > 0, backend.transfers
            backend.close()
        results.update(raw_nixl(address, total, page, args.batch, args.repeats))
        src, dst = np.ones(total, np.uint8), np.zeros(total, np.uint8)
        results["numpy copy (ceiling)"] = total / best(lambda: np.copyto(dst, src), args.repeats)
    finally:
        peer.terminate()
    print(f"{args.pages} pages x {args.page_kib} KiB = {total >> 20} MiB, {args.batch} pages per call, "
          f"best of {args.repeats}")  # fmt: skip
    read = results["raw NIXL READ"]
    for name, rate in results.items():
        print(f"  {name:24s} {rate / 1e9:6.2f} GB/s  ({rate / read:4.2f} x raw READ)")


if __name__ == "__main__":
    main()
