"""What keys and signatures cost (issue 14): per chunk and per page, old hashing against new.

Per chunk (the token ids of one chunk, int64): the old xxh3-128 chain step, the sha256 chain step
(the default now) and the HMAC-SHA256 step (with a cache secret), each through the same code
path (``chain_chunk_hashes`` for the new ones, the old one with the same token conversion), and
the hash alone (xxh3-128, sha256, HMAC-SHA256, keyed BLAKE2b) over one chunk plus the previous
hash. Per page: sealing and decoding a page without and
with a signature (HMAC-SHA256 over header and payload) for page sizes of the tiny test models
and of real ones. Prints a table and writes JSON to ``--out``.

Usage: ``.venv/bin/python benchmarks/key_cost.py [--out benchmarks/results/key_cost.json]``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from hybrid_offload.core.page_format import PageHeader, decode_page, encode_page, header_len, seal_page
from hybrid_offload.core.planner import chain_chunk_hashes
from hybrid_offload.core.spec import GroupKind, TensorSpec

#: page sizes: a tiny falcon_h1 attention chunk (128 tokens) and state, a Qwen3-Next-80B-like
#: attention chunk (12 layers x 2 KV heads x 256 dims x 128 tokens x K,V x bf16), 8 MiB
PAGES = {"tiny-attn-128": 64 << 10, "tiny-state": 288 << 10, "80b-attn-128": 3 << 20, "8MiB": 8 << 20}


def per_call_us(fn: Callable[[], object], min_seconds: float = 0.5) -> float:
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        fn()
        n += 1
    return elapsed / n * 1e6


def old_chain(seed: bytes, token_ids: list[int], chunk: int) -> list[bytes]:
    """The chain before issue 14: xxh3-128, the same token conversion as the new one."""
    n_full = len(token_ids) // chunk
    tokens = np.asarray(token_ids[: n_full * chunk], dtype="<i8").tobytes()
    out, prev, step = [], seed, chunk * 8
    for i in range(n_full):
        h = xxhash.xxh3_128()
        h.update(prev)
        h.update(tokens[i * step : (i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/key_cost.json"))
    args = parser.parse_args()
    key = os.urandom(32)
    result: dict[str, object] = {"machine": platform.processor() or platform.machine(),
                                 "load_average": os.getloadavg(), "chunks": {}, "pages": {}}
    for chunk in (128, 256):
        n_chunks = 256
        ids = np.random.default_rng(0).integers(0, 150_000, chunk * n_chunks).tolist()  # as vLLM has them
        row = {
            "xxh3_128 (old)": per_call_us(lambda ids=ids, chunk=chunk: old_chain(b"s" * 16, ids, chunk)),
            "sha256": per_call_us(lambda ids=ids, chunk=chunk: chain_chunk_hashes(b"s" * 32, ids, chunk)),
            "hmac_sha256": per_call_us(
                lambda ids=ids, chunk=chunk: chain_chunk_hashes(b"s" * 32, ids, chunk, key)
            ),
        }
        result["chunks"][chunk] = {name: us / n_chunks for name, us in row.items()}
    block = os.urandom(32 + 128 * 8)  # previous hash + one 128-token chunk: the hash alone
    result["hash_only_us"] = {
        "xxh3_128": per_call_us(lambda: xxhash.xxh3_128_digest(block)),
        "sha256": per_call_us(lambda: hashlib.sha256(block).digest()),
        "hmac_sha256": per_call_us(lambda: hmac.digest(key, block, "sha256")),
        "blake2b_keyed_256": per_call_us(lambda: hashlib.blake2b(block, key=key, digest_size=32).digest()),
    }
    for name, size in PAGES.items():
        tensors = (TensorSpec("t", (size // 2,), "bfloat16"),)
        header = PageHeader(bytes(16), bytes(32), 0, GroupKind.FULL_ATTENTION, 0, 128, tensors)
        buf = bytearray(header_len(tensors) + size)
        buf[header_len(tensors):] = os.urandom(size)
        plain = encode_page(header, bytes(buf[header_len(tensors):]))
        signed = encode_page(header, bytes(buf[header_len(tensors):]), key)
        result["pages"][name] = {
            "bytes": size,
            "seal_us": per_call_us(lambda buf=buf, header=header: seal_page(buf, header)),
            "seal_signed_us": per_call_us(lambda buf=buf, header=header: seal_page(buf, header, key)),
            "decode_us": per_call_us(lambda plain=plain, header=header: decode_page(plain, header)),
            "decode_signed_us": per_call_us(
                lambda signed=signed, header=header: decode_page(signed, header, key)
            ),
        }
    print(f"load average {result['load_average']}")
    alone = result["hash_only_us"]
    print("hash alone, 1056 bytes: " + ", ".join(f"{k} {v:.2f} us" for k, v in alone.items()))
    for chunk, row in result["chunks"].items():
        print(f"chunk {chunk} tokens: " + ", ".join(f"{k} {v:.2f} us" for k, v in row.items()))
    for name, row in result["pages"].items():
        print(f"page {name}: seal {row['seal_us']:.0f} -> {row['seal_signed_us']:.0f} us signed, "
              f"decode {row['decode_us']:.0f} -> {row['decode_signed_us']:.0f} us signed")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
