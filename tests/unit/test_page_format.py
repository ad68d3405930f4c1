"""Canonical page format: round trips, every header field checked, corruption always caught."""

from __future__ import annotations

import ast
import dataclasses
import random
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from page_builders import ATTN, CHUNK, MAMBA, SWA, make_header, make_page, payload_for

from hybrid_offload import FORMAT_VERSION
from hybrid_offload.core import page_format as pf
from hybrid_offload.core.checksum import fold64
from hybrid_offload.core.page_format import (
    HEADER_ALIGN,
    MAGIC,
    ForeignLayersError,
    PageFormatError,
    PageHeader,
    PageTemplate,
    check_headers,
    decode_header,
    decode_page,
    encode_page,
    header_len,
    page_len,
    seal_page,
    verify_page,
)
from hybrid_offload.core.spec import GroupKind, GroupSpec, TensorSpec

REPO = Path(__file__).resolve().parents[2]
Mangle = Callable[[tuple[TensorSpec, ...]], tuple[TensorSpec, ...]]


def verified(data: bytes | bytearray, expected: PageHeader, key: bytes | None = None) -> memoryview:
    """verify_page against ``expected`` (the worker's path: a template plus the chunk's identity)."""
    return verify_page(data, PageTemplate.of(expected), expected.chunk_hash, expected.chunk_index, key)


def layout(tensors: tuple[TensorSpec, ...]) -> list[tuple[tuple[int, ...], str]]:
    return [(t.shape, t.dtype) for t in tensors]


def reseal(data: bytes, **fields: int | bytes) -> bytes:
    """Rewrite fixed-header fields and recompute the header checksum, as a forger would."""
    names = ["magic", "version", "header_len", "fingerprint", "chunk_hash", "group", "kind",
             "shard", "shards", "layer_start", "layer_end", "layers", "chunk_index", "num_tokens",
             "n_tensors", "payload_len", "payload_checksum", "mac"]
    values = dict(zip(names, pf._FIXED.unpack_from(data, 0), strict=True))
    values.update(fields)
    buf = bytearray(data)
    pf._FIXED.pack_into(buf, 0, *(values[n] for n in names))
    hlen = min(values["header_len"], len(buf))
    if hlen >= pf._FIXED.size + pf._CHECKSUM.size:
        pf._CHECKSUM.pack_into(buf, hlen - 8, xxhash.xxh3_64_intdigest(bytes(buf[: hlen - 8])))
    return bytes(buf)


# ---- round trips -----------------------------------------------------------------------------
@pytest.mark.parametrize("group", [ATTN, SWA, MAMBA], ids=lambda g: g.kind.value)
def test_round_trip(group: GroupSpec) -> None:
    header = make_header(group)
    payload = payload_for(header, seed=group.index)
    data = encode_page(header, payload)
    hlen = header_len(header.tensors)
    assert len(data) == page_len(header.tensors) == hlen + len(payload)
    assert hlen % HEADER_ALIGN == 0
    assert data[:4] == MAGIC

    got, view = decode_page(data, header)
    assert bytes(view) == payload
    assert isinstance(view, memoryview)
    assert bytes(verified(data, header)) == payload and bytes(verified(bytearray(data), header)) == payload
    for name in ("fingerprint", "chunk_hash", "group_index", "kind", "chunk_index",
                 "num_tokens", "shard", "shards", "payload_len"):
        assert getattr(got, name) == getattr(header, name), name
    assert layout(got.tensors) == layout(header.tensors)
    # without an expected header too, and from every buffer type
    for buf in (bytearray(data), memoryview(data)):
        got2, view2 = decode_page(buf)
        assert got2 == got and bytes(view2) == payload
    parsed, offset, checksum = decode_header(data)
    assert parsed == got and offset == hlen
    assert checksum == fold64(payload)


def test_payload_order_follows_page_tensors() -> None:
    tensors = ATTN.page_tensors(CHUNK)
    assert [t.name for t in tensors] == ["L0.k", "L0.v", "L1.k", "L1.v"]
    assert layout(tensors) == [((16, 2, 8), "bfloat16"), ((16, 2, 4), "bfloat16")] * 2
    assert layout(MAMBA.page_tensors(CHUNK)) == [((3, 12), "bfloat16"), ((2, 4, 4), "float32")]
    assert make_header(MAMBA).payload_len == MAMBA.state_bytes == 3 * 12 * 2 + 32 * 4


def test_seal_page_in_place_matches_encode() -> None:
    header = make_header(MAMBA)
    payload = payload_for(header)
    hlen = header_len(header.tensors)
    buf = bytearray(b"\xff" * page_len(header.tensors))  # stale bytes must be overwritten
    buf[hlen:] = payload
    seal_page(buf, header)
    assert bytes(buf) == encode_page(header, payload)
    with pytest.raises(PageFormatError, match="expected"):
        seal_page(bytearray(len(buf) + 1), header)
    with pytest.raises(PageFormatError):
        seal_page(bytearray(len(buf) - 1), header)


@pytest.mark.parametrize("group", [ATTN, MAMBA], ids=lambda g: g.kind.value)
def test_identical_content_gives_identical_bytes(group: GroupSpec) -> None:
    header = make_header(group)
    a = encode_page(header, payload_for(header, 3))
    b = encode_page(make_header(group), bytearray(payload_for(header, 3)))
    assert a == b
    assert a != encode_page(header, payload_for(header, 4))


def test_header_is_64_byte_aligned_for_any_table() -> None:
    for n in range(0, 40):
        tensors = tuple(TensorSpec(f"t{i}", (2,) * (1 + i % 8), "uint8") for i in range(n))
        hlen = header_len(tensors)
        assert hlen % HEADER_ALIGN == 0
        assert hlen >= pf._FIXED.size + sum(2 + 4 * len(t.shape) for t in tensors) + 8
        assert hlen - HEADER_ALIGN < pf._FIXED.size + sum(2 + 4 * len(t.shape) for t in tensors) + 8
        header = PageHeader(b"\x01" * 16, b"\x02" * 32, 0, GroupKind.MAMBA, 0, 0, tensors)
        got, _ = decode_page(encode_page(header, bytes(header.payload_len)))
        assert layout(got.tensors) == layout(tensors)


# ---- every identifying field is checked ------------------------------------------------------
def _reshaped(tensors: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    """Same bytes, different shape of the first tensor."""
    first = tensors[0]
    shape = (first.shape[0] // 2, first.shape[1] * 2, *first.shape[2:])
    return (TensorSpec(first.name, shape, first.dtype), *tensors[1:])


def _retyped(tensors: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    """Same bytes, float16 instead of bfloat16 in the first tensor."""
    first = tensors[0]
    return (TensorSpec(first.name, first.shape, "float16"), *tensors[1:])


FIELD_CHANGES = {
    "fingerprint": {"fingerprint": bytes.fromhex("00112233445566778899aabbccddeefe")},
    "chunk_hash": {"chunk_hash": bytes(range(101, 133))},
    "group_index": {"group_index": 3},
    "kind": {"kind": GroupKind.SLIDING_WINDOW},
    "chunk_index": {"chunk_index": 8},
    "num_tokens": {"num_tokens": 2 * CHUNK},
    "shard": {"shard": 0},
    "shards": {"shards": 4},
    "layer_start": {"layer_start": 1, "layer_end": 2},  # another layer part
    "layer_end": {"layer_end": 2},
    "layers": {"layers": bytes(range(16))},  # the part holds other layers
}


@pytest.mark.parametrize("field", sorted(FIELD_CHANGES))
def test_each_identifying_field_is_checked(field: str) -> None:
    expected = make_header(ATTN)
    other = make_header(ATTN, **FIELD_CHANGES[field])
    payload = payload_for(expected)
    data = encode_page(other, payload)
    decode_page(data)  # a valid page on its own
    with pytest.raises(PageFormatError, match=field):
        decode_page(data, expected)
    with pytest.raises(PageFormatError, match=field):
        verified(data, expected)
    with pytest.raises(PageFormatError, match=field):  # and the other way round
        decode_page(encode_page(expected, payload), other)
    with pytest.raises(PageFormatError, match=field):
        verified(encode_page(expected, payload), other)
    # only other layers in the same part is another grouping's valid page (a miss, kept)
    with pytest.raises(PageFormatError) as caught:
        verified(data, expected)
    assert isinstance(caught.value, ForeignLayersError) == (field == "layers")


@pytest.mark.parametrize(
    "change",
    [_reshaped, _retyped, lambda ts: ts[:-1], lambda ts: (*ts[1:], ts[0])],
    ids=["shape", "dtype", "fewer-tensors", "reordered"],
)
def test_tensor_layout_is_checked(change: Mangle) -> None:
    expected = make_header(ATTN)
    other = make_header(ATTN, tensors=change(expected.tensors))
    assert layout(other.tensors) != layout(expected.tensors)
    data = make_page(other)
    decode_page(data)
    with pytest.raises(PageFormatError, match="shapes/dtypes"):
        decode_page(data, expected)
    with pytest.raises(PageFormatError, match="shapes/dtypes"):
        verified(data, expected)


def test_tensor_names_are_not_identity() -> None:
    expected = make_header(MAMBA)
    renamed = tuple(TensorSpec(f"x{i}", t.shape, t.dtype) for i, t in enumerate(expected.tensors))
    decode_page(make_page(make_header(MAMBA, tensors=renamed)), expected)
    verified(make_page(make_header(MAMBA, tensors=renamed)), expected)


# ---- corruption ------------------------------------------------------------------------------
def _assert_rejected(data: bytes | bytearray, expected: PageHeader) -> None:
    with pytest.raises(PageFormatError):
        decode_page(data, expected)
    with pytest.raises(PageFormatError):
        decode_page(data)
    with pytest.raises(PageFormatError):
        verified(data, expected)
    assert not _passes_split_check(data, expected)


def _passes_split_check(data: bytes | bytearray, expected: PageHeader) -> bool:
    """Whether ``data`` passes the check a GPU engine makes: the headers vectorized on the host
    (:func:`check_headers`), the payload's fold64 where it is (here on the host)."""
    template = PageTemplate.of(expected)
    if len(data) != template.hlen + template.plen:
        return False
    rows = np.frombuffer(bytes(data[: template.hlen]), dtype=np.uint8).reshape(1, -1)
    ok, sums = check_headers(rows, template, [expected.chunk_hash], [expected.chunk_index])
    return bool(ok[0]) and int(sums[0]) == fold64(bytes(data[template.hlen :]))


def test_split_check_accepts_what_verify_page_accepts() -> None:
    """The vectorized header check and a separate payload checksum accept exactly the pages
    verify_page accepts, in batches of pages of one template."""
    header = make_header(ATTN)
    pages = [make_page(dataclasses.replace(header, chunk_index=i, chunk_hash=bytes([i]) * 32), seed=i)
             for i in range(6)]  # fmt: skip
    template = PageTemplate.of(header)
    rows = np.stack([np.frombuffer(p[: template.hlen], dtype=np.uint8) for p in pages])
    hashes, indices = [bytes([i]) * 32 for i in range(6)], list(range(6))
    ok, sums = check_headers(rows, template, hashes, indices)
    assert ok.all()
    assert [int(s) for s in sums] == [fold64(p[template.hlen :]) for p in pages]
    indices[2], hashes[4] = 9, bytes(32)  # pages asked for under other identities
    rows[5, 3] ^= 1  # a flipped header byte
    ok, _ = check_headers(rows, template, hashes, indices)
    assert ok.tolist() == [True, True, False, True, False, False]
    signed = encode_page(header, payload_for(header), b"k" * 32)  # the MAC is the key holder's check
    ok, _ = check_headers(np.frombuffer(signed[: template.hlen], dtype=np.uint8).reshape(1, -1), template,
                          [header.chunk_hash], [header.chunk_index])  # fmt: skip
    assert ok.all()


def test_every_single_bit_flip_is_caught_mamba_page() -> None:
    header = make_header(MAMBA)
    data = make_page(header)
    assert len(data) < 512
    for bit in range(len(data) * 8):  # every bit of header and payload
        corrupt = bytearray(data)
        corrupt[bit // 8] ^= 1 << (bit % 8)
        _assert_rejected(corrupt, header)


def test_every_header_bit_and_spread_payload_bits_attention_page() -> None:
    header = make_header(ATTN)
    data = make_page(header)
    hlen = header_len(header.tensors)
    rng = random.Random(1)
    bits = list(range(hlen * 8))
    bits += [8 * pos + rng.randrange(8) for pos in range(hlen, len(data))]  # every payload byte
    for bit in bits:
        corrupt = bytearray(data)
        corrupt[bit // 8] ^= 1 << (bit % 8)
        _assert_rejected(corrupt, header)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_corruption_is_caught(data: st.DataObject) -> None:
    header = make_header(data.draw(st.sampled_from([ATTN, MAMBA])))
    page = bytearray(make_page(header))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(page) - 1))
        page[pos] ^= data.draw(st.integers(1, 255))
    if bytes(page) == make_page(header):  # two xors cancelled out
        return
    _assert_rejected(page, header)


@pytest.mark.parametrize(
    "mangle",
    [
        lambda d: d[:-1],
        lambda d: d[: header_len(make_header().tensors)],  # header only
        lambda d: d[: header_len(make_header().tensors) - 1],
        lambda d: d[:60],
        lambda d: d[:4],
        lambda d: b"",
        lambda d: d + b"\x00",
        lambda d: d + d,
        lambda d: b"HOPX" + d[4:],
        lambda d: b"\x00" * len(d),
        lambda d: bytes(len(d)) + d,
    ],
    ids=["truncated-1", "header-only", "short-header", "60-bytes", "magic-only", "empty",
         "extended-1", "doubled", "wrong-magic", "zeros", "prefixed"],
)
def test_malformed_pages(mangle: Callable[[bytes], bytes]) -> None:
    header = make_header()
    _assert_rejected(mangle(make_page(header)), header)


def test_wrong_magic_and_version_messages() -> None:
    data = make_page(make_header())
    with pytest.raises(PageFormatError, match="magic"):
        decode_page(reseal(data, magic=b"HOPX"))
    for version in (0, FORMAT_VERSION + 1, 0xFFFF):
        with pytest.raises(PageFormatError, match="version"):
            decode_page(reseal(data, version=version))
    assert decode_page(reseal(data))[0] == decode_page(data)[0]  # reseal itself is faithful


def test_forged_header_fields_out_of_range() -> None:
    data = make_page(make_header())
    bad = [
        {"kind": 0}, {"kind": 4}, {"kind": 255},
        {"n_tensors": pf.MAX_TENSORS + 1},
        {"payload_len": pf.MAX_PAYLOAD_BYTES + 1},
        {"header_len": 0}, {"header_len": 8}, {"header_len": len(data) + 64},
        {"n_tensors": 3}, {"n_tensors": 5},
        {"payload_len": 1}, {"payload_len": 2**40},
        {"layer_start": 3, "layer_end": 2},
    ]
    for fields in bad:
        with pytest.raises(PageFormatError):
            decode_page(reseal(data, **fields))


def _hostile_page(table: bytes, n_tensors: int, payload_len: int, tail: bytes = b"") -> bytes:
    """A page with a correct header checksum whose tensor table makes huge claims."""
    size = pf._FIXED.size + len(table) + 8
    hlen = -(-size // 64) * 64
    buf = bytearray(hlen)
    pf._FIXED.pack_into(buf, 0, MAGIC, FORMAT_VERSION, hlen, b"\0" * 16, b"\0" * 32, 0, 3, 0, 1, 0, 1,
                        b"\0" * 16, 0, 0, n_tensors, payload_len, fold64(tail), bytes(32))
    buf[pf._FIXED.size : pf._FIXED.size + len(table)] = table
    buf[hlen - 8 :] = xxhash.xxh3_64_intdigest(bytes(buf[: hlen - 8])).to_bytes(8, "little")
    return bytes(buf) + tail


U8 = bytes([pf._DTYPE_CODES["uint8"]])
HOSTILE = {
    # claims 8192 tensors with a table that ends after one
    "many-tensors": (U8 + b"\x01" + (4).to_bytes(4, "little"), pf.MAX_TENSORS, 4),
    # ndim 255 and 9 (over MAX_NDIM)
    "huge-ndim": (U8 + b"\xff" + b"\xff" * 64, 1, 0),
    "ndim-9": (U8 + b"\x09" + (1).to_bytes(4, "little") * 9, 1, 1),
    # 8 dims of 2**32 - 1: an astronomically large tensor
    "huge-dims": (U8 + b"\x08" + b"\xff\xff\xff\xff" * 8, 1, pf.MAX_PAYLOAD_BYTES),
    # a 16 GiB tensor that adds up, but the page is only the header
    "huge-payload": (U8 + b"\x02" + (1 << 17).to_bytes(4, "little") * 2, 1, 1 << 34),
    # unknown dtype code
    "bad-dtype": (b"\xee\x01" + (4).to_bytes(4, "little"), 1, 4),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_header_does_not_allocate(case: str) -> None:
    table, n_tensors, payload_len = HOSTILE[case]
    page = _hostile_page(table, n_tensors, payload_len)
    decode_header_ok = case == "huge-payload"
    tracemalloc.start()
    started = time.thread_time()  # this thread's CPU time: other processes cannot inflate it
    try:
        if decode_header_ok:  # the header is consistent; only the page length gives it away
            header, _, _ = decode_header(page)
            assert header.payload_len == 1 << 34
        with pytest.raises(PageFormatError):
            decode_page(page)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.thread_time() - started < 1.0, "the decoder worked through the declared sizes"
    assert peak < 1 << 20, f"decoder allocated {peak} bytes"


# ---- no unsafe deserialisation ---------------------------------------------------------------
_UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal",
                   "joblib"}


def unsafe_uses(source: str) -> list[str]:
    """pickle-family imports, ``torch.load``/``pickle.*`` calls and ``allow_pickle=True``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in _UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in _UNSAFE_MODULES or (
                node.module.split(".")[0] == "torch" and any(a.name == "load" for a in node.names)
            ):
                found.append(node.module)
        elif isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Name) and (
                base.id in _UNSAFE_MODULES or (base.id == "torch" and node.attr == "load")
            ):
                found.append(f"{base.id}.{node.attr}")
        elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
            if not (isinstance(node.value, ast.Constant) and node.value.value is False):
                found.append("allow_pickle")
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("__import__", "import_module") and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).split(".")[0] in _UNSAFE_MODULES
        ):
            found.append(f"{node.func.id}({node.args[0].value!r})")
    return found


def test_unsafe_use_detector_works() -> None:
    assert unsafe_uses("import pickle") == ["pickle"]
    assert unsafe_uses("from pickle import loads") == ["pickle"]
    assert unsafe_uses("import torch\nx = torch.load(f)") == ["torch.load"]
    assert unsafe_uses("import numpy as np\nnp.load(f, allow_pickle=True)") == ["allow_pickle"]
    assert unsafe_uses("m = __import__('pickle')") == ["__import__('pickle')"]
    assert unsafe_uses('"""No pickle, no torch.load."""\nimport json') == []
    assert unsafe_uses("np.load(f, allow_pickle=False)") == []


#: the one allowed use: the router reproduces vLLM's default prompt hash, SHA-256 of a pickled
#: tuple of its own (it serialises to hash; nothing is ever unpickled)
HASH_INPUT_ONLY = {"hybrid_offload/router/hashing.py": ["pickle", "pickle.dumps", "pickle.HIGHEST_PROTOCOL"]}


def test_no_pickle_or_torch_load_in_sources() -> None:
    files = [f for d in ("hybrid_offload", "backends") for f in sorted((REPO / d).rglob("*.py"))]
    assert len(files) > 10 and any(f.name == "page_format.py" for f in files)
    offenders = {}
    for path in files:
        uses = unsafe_uses(path.read_text(encoding="utf-8"))
        if uses:
            offenders[str(path.relative_to(REPO))] = uses
    assert offenders == HASH_INPUT_ONLY


# ---- signed pages (issue 14 M4) --------------------------------------------------------------
def test_signed_pages_verify_only_under_their_key() -> None:
    """Checksums stop corruption, not forgery: anyone who can write a shared tier can re-encode
    a page with other KV and valid checksums. Under a cache secret, pages carry HMAC-SHA256 and a
    reader with the secret refuses unsigned, re-signed-elsewhere or tampered pages."""
    key = b"cache secret"
    header = make_header(MAMBA)
    payload = payload_for(header, 1)
    signed = encode_page(header, payload, key)
    got, view = decode_page(signed, header, key)
    assert got.signed and bytes(view) == payload
    assert not decode_page(encode_page(header, payload), header)[0].signed
    forged = encode_page(header, payload_for(header, 2))  # a forger without the key
    assert bytes(decode_page(forged, header)[1]) != payload  # what an unkeyed reader would take
    assert bytes(verified(signed, header, key)) == payload
    for bad, why in ((forged, "not signed"), (encode_page(header, payload, b"other key"), "does not verify")):
        with pytest.raises(PageFormatError, match=why):
            decode_page(bad, header, key)
        with pytest.raises(PageFormatError, match=why):
            verified(bad, header, key)
    # tampering with any signed byte (payload or an identifying header field), checksums redone
    tampered = bytearray(signed)
    tampered[-1] ^= 1
    hlen = header_len(header.tensors)
    tampered = reseal(bytes(tampered), payload_checksum=fold64(bytes(tampered[hlen:])))
    with pytest.raises(PageFormatError, match="does not verify"):
        decode_page(tampered, None, key)
    with pytest.raises(PageFormatError, match="does not verify"):
        verified(tampered, header, key)
    with pytest.raises(PageFormatError, match="does not verify"):
        decode_page(reseal(signed, chunk_index=8), None, key)


def test_seal_refuses_short_identity_fields() -> None:
    """A 16-byte chunk hash would be zero-padded into the 32-byte field silently."""
    header = make_header(ATTN, chunk_hash=bytes(16))
    with pytest.raises(PageFormatError, match="32"):
        encode_page(header, payload_for(header))


@pytest.mark.parametrize("key", [None, b"s" * 32], ids=["plain", "signed"])
def test_headers_sealed_at_once_are_the_ones_seal_page_writes(key: bytes | None) -> None:
    header = make_header(MAMBA)
    template = PageTemplate.of(header)
    pages = [dataclasses.replace(header, chunk_index=3 * i, chunk_hash=bytes([i + 1]) * 32) for i in range(4)]
    payloads = [payload_for(p, seed=i) for i, p in enumerate(pages)]
    heads = pf.seal_headers(template, [p.chunk_hash for p in pages], [p.chunk_index for p in pages],
                            [fold64(x) for x in payloads], payloads, key)  # fmt: skip
    for page, payload, head in zip(pages, payloads, heads, strict=True):
        assert head.tobytes() + payload == encode_page(page, payload, key)
