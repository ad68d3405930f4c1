"""Page builders shared by the page format unit tests: three group geometries (``ATTN``, ``SWA``,
``MAMBA``), a page header for each (``make_header``) and valid pages (``make_page``)."""

from __future__ import annotations

import dataclasses
import random

from hybrid_offload.core.page_format import PageHeader, encode_page
from hybrid_offload.core.spec import GroupKind, GroupSpec

CHUNK = 16

ATTN = GroupSpec(
    index=0, kind=GroupKind.FULL_ATTENTION, block_size=16,
    layer_names=("model.layers.0.attn", "model.layers.2.attn"),
    page_bytes=16 * 2 * (8 + 4) * 2, num_kv_heads=2, head_size=8, head_size_v=4,
)
SWA = dataclasses.replace(ATTN, index=2, kind=GroupKind.SLIDING_WINDOW, sliding_window=64)
MAMBA = GroupSpec(
    index=1, kind=GroupKind.MAMBA, block_size=16,
    layer_names=("model.layers.1.mixer",),
    page_bytes=4096, state_shapes=((3, 12), (2, 4, 4)), state_dtypes=("bfloat16", "float32"),
    mamba_cache_mode="align", mamba_type="MAMBA2",
)


def make_header(group: GroupSpec = ATTN, **changes: object) -> PageHeader:
    header = PageHeader(
        fingerprint=bytes.fromhex("00112233445566778899aabbccddeeff"),
        chunk_hash=bytes(range(100, 132)),
        group_index=group.index,
        kind=group.kind,
        chunk_index=7,
        num_tokens=CHUNK,
        tensors=group.page_tensors(CHUNK),
        shard=1,
        shards=2,
    )
    return dataclasses.replace(header, **changes)


def payload_for(header: PageHeader, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(header.payload_len)


def make_page(header: PageHeader, seed: int = 0) -> bytes:
    return encode_page(header, payload_for(header, seed))

