"""Fuzzing the page decoder for a fixed time budget (``HYBRID_OFFLOAD_FUZZ_SECONDS``, default 8).

Inputs are valid pages of three geometries, mutated the ways that reach past the checksums:
bit flips and byte edits, truncation and extension, header fields forged with a recomputed
header checksum (hostile sizes, counts, dtype codes, dims), tensor tables rewritten and resealed,
and plain random bytes. For every input the decoder must either return a payload whose length
is what the returned header says, or raise :class:`PageFormatError`: no other exception, and
never an allocation beyond a small bound (traced peak). The seed is printed on failure.
"""

from __future__ import annotations

import os
import random
import re
import struct
import time
import tracemalloc
from collections.abc import Callable

import xxhash
from page_builders import ATTN, MAMBA, SWA, make_header, make_page

from hybrid_offload.core import page_format as pf
from hybrid_offload.core.page_format import PageFormatError, decode_page

BUDGET_S = float(os.environ.get("HYBRID_OFFLOAD_FUZZ_SECONDS", "8"))
SEEDS = [make_page(make_header(g), seed=i) for i, g in enumerate((ATTN, SWA, MAMBA))]
_FIELD_FORMATS = re.findall(r"\d*[a-zA-Z]", pf._FIXED.format.lstrip("<"))
_INTERESTING = [
    0,
    1,
    2,
    7,
    8,
    9,
    63,
    64,
    255,
    256,
    0xFFFF,
    0x10000,
    0x7FFFFFFF,
    0xFFFFFFFF,
    1 << 34,
    (1 << 64) - 1,
]


def _reseal_header(buf: bytearray) -> bytearray:
    """Recompute the header checksum for whatever header length the buffer claims."""
    if len(buf) < pf._FIXED.size:
        return buf
    hlen = struct.unpack_from("<I", buf, 6)[0]
    if pf._FIXED.size + pf._CHECKSUM.size <= hlen <= len(buf):
        pf._CHECKSUM.pack_into(buf, hlen - 8, xxhash.xxh3_64_intdigest(bytes(buf[: hlen - 8])))
    return buf


def forge_field(rng: random.Random, page: bytes) -> bytes:
    if len(page) < pf._FIXED.size:
        return page
    values = list(pf._FIXED.unpack_from(page, 0))
    i = rng.randrange(1, len(_FIELD_FORMATS))
    if isinstance(values[i], bytes):
        values[i] = rng.randbytes(len(values[i]))
    else:
        limit = (1 << (8 * struct.calcsize("<" + _FIELD_FORMATS[i]))) - 1
        values[i] = min(rng.choice([*_INTERESTING, rng.randrange(limit + 1)]), limit)
    buf = bytearray(page)
    try:
        pf._FIXED.pack_into(buf, 0, *values)
    except struct.error:
        return page
    return bytes(_reseal_header(buf))


def rewrite_table(rng: random.Random, page: bytes) -> bytes:
    """Random tensor-table bytes (dtype codes, ndims, dims), header checksum recomputed."""
    if len(page) < pf._FIXED.size + 8:
        return page
    buf = bytearray(page)
    hlen = struct.unpack_from("<I", buf, 6)[0]
    for _ in range(rng.randrange(1, 8)):
        pos = rng.randrange(pf._FIXED.size, max(pf._FIXED.size + 1, hlen - 8))
        width = rng.choice((1, 4))
        value = rng.choice(_INTERESTING) & ((1 << (8 * width)) - 1)
        buf[pos : pos + width] = value.to_bytes(width, "little")[: len(buf[pos : pos + width])]
    return bytes(_reseal_header(buf))


def flip_bits(rng: random.Random, page: bytes) -> bytes:
    if not page:
        return page
    buf = bytearray(page)
    for _ in range(rng.randrange(1, 4)):
        buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    return bytes(buf)


def cut_or_extend(rng: random.Random, page: bytes) -> bytes:
    if page and rng.random() < 0.5:
        return page[: rng.randrange(len(page))]
    return page + rng.randbytes(rng.randrange(1, 64))


def random_bytes(rng: random.Random, page: bytes) -> bytes:
    return pf.MAGIC + rng.randbytes(rng.randrange(0, 512)) if rng.random() < 0.5 else rng.randbytes(64)


MUTATIONS: list[Callable[[random.Random, bytes], bytes]] = [
    forge_field, rewrite_table, flip_bits, cut_or_extend, random_bytes,
]  # fmt: skip


def check_one(data: bytes) -> bool:
    """True if decoded (consistently), False if refused; anything else propagates."""
    try:
        header, payload = decode_page(data)
    except PageFormatError:
        return False
    assert len(payload) == header.payload_len and len(payload) <= len(data)
    return True


def test_decoder_fuzz_for_a_fixed_budget() -> None:
    seed = int(os.environ.get("HYBRID_OFFLOAD_FUZZ_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    runs = decoded = 0
    deadline = time.monotonic() + BUDGET_S
    tracemalloc.start()
    try:
        while time.monotonic() < deadline:
            data = rng.choice(SEEDS)
            for _ in range(rng.randrange(1, 3)):
                data = rng.choice(MUTATIONS)(rng, data)
            try:
                decoded += check_one(data)
            except Exception as exc:
                raise AssertionError(f"seed {seed}, run {runs}: {type(exc).__name__}: {exc}") from exc
            runs += 1
            _, peak = tracemalloc.get_traced_memory()
            assert peak < 4 << 20, f"seed {seed}, run {runs}: decoder allocated {peak} bytes"
            tracemalloc.reset_peak()
    finally:
        tracemalloc.stop()
    assert runs > 1000, f"only {runs} inputs in {BUDGET_S}s"
    print(f"fuzzed {runs} inputs in {BUDGET_S}s (seed {seed}); {decoded} decoded")
