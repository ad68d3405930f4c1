"""Model cards: round trip, every corruption rejected with a clear error, key shape, size bound;
and the worker writing its card at start-up (TP rank 0, shared writable backends only)."""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import xxhash

from hybrid_offload import FORMAT_VERSION
from hybrid_offload.backends import BackendConfig, create_backend
from hybrid_offload.backends.base import KEY_PATTERN
from hybrid_offload.connector.config import Tier, TierPolicy
from hybrid_offload.core.model_card import (
    CARD_MAGIC,
    CARD_VERSION,
    MAX_CARD_BYTES,
    CardGroup,
    ModelCard,
    ModelCardError,
    card_from_spec,
    card_key,
    card_problem,
    decode_card,
    describe_card,
    encode_card,
    is_card_key,
)
from hybrid_offload.core.planner import HybridOffloadPlanner
from hybrid_offload.core.secrets import Secret
from hybrid_offload.core.spec import GroupKind, GroupSpec, ModelSpec, make_model_spec
from hybrid_offload.testing.faulty import faulty_config

FP = "3f" * 16
CARD = ModelCard(
    fingerprint=FP,
    name="/models/falcon-h1-tiny",
    revision="main",
    architectures=("FalconH1ForCausalLM",),
    dtype="bfloat16",
    kv_cache_dtype="auto",
    chunk_tokens=384,
    groups=(CardGroup(0, "full_attention", 4, 1), CardGroup(1, "mamba", 4, 8)),
    format_version=FORMAT_VERSION,
    written_at=1_700_000_000.25,
)


def seal(blob: bytes, *, version: int = CARD_VERSION, length: int | None = None) -> bytes:
    """A card frame around arbitrary JSON bytes, with a correct checksum."""
    body = struct.pack("<4sHI", CARD_MAGIC, version, len(blob) if length is None else length) + blob
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def card_json(**changes: Any) -> bytes:
    data = {**CARD.to_json(), **changes}
    return json.dumps({k: v for k, v in data.items() if v is not ...}).encode()


# ---- round trip -------------------------------------------------------------------------------


def test_round_trip_is_exact_and_canonical() -> None:
    data = encode_card(CARD)
    assert decode_card(data) == CARD
    assert decode_card(bytearray(data)) == CARD and decode_card(memoryview(data)) == CARD
    assert encode_card(CARD) == data  # deterministic
    magic, version, length = struct.unpack_from("<4sHI", data)
    assert (magic, version, length) == (b"HOMC", 1, len(data) - 18)
    blob = data[10:-8]
    assert blob == json.dumps(CARD.to_json(), sort_keys=True, separators=(",", ":")).encode()
    assert struct.unpack("<Q", data[-8:])[0] == xxhash.xxh3_64_intdigest(data[:-8])


def test_round_trip_of_odd_but_valid_values() -> None:
    odd = dataclasses.replace(CARD, name="modèle/日本語 \"q\"", revision=None, architectures=(), groups=(),
                              written_at=0.0)  # fmt: skip
    assert decode_card(encode_card(odd)) == odd


def test_unknown_fields_are_ignored() -> None:
    assert decode_card(seal(card_json(added_later={"x": [1, 2]}))) == CARD


def test_card_from_spec_takes_the_fingerprint_fields_and_groups() -> None:
    spec = model_spec({"name": "/m/qwen", "revision": "abc", "architectures": ["Qwen3NextForCausalLM"],
                       "hf_config": "00ff", "dtype": "float32", "kv_cache_dtype": "auto"})  # fmt: skip
    card = card_from_spec(spec, 32, written_at=5.0)
    assert card == ModelCard(spec.fingerprint, "/m/qwen", "abc", ("Qwen3NextForCausalLM",), "float32", "auto",
                             32, (CardGroup(0, "full_attention", 2, 1), CardGroup(1, "mamba", 2, 1)),
                             FORMAT_VERSION, 5.0)  # fmt: skip
    sparse = card_from_spec(model_spec({"name": "x"}), 16)  # hand-built specs lack most fields
    assert (sparse.name, sparse.revision, sparse.architectures, sparse.dtype) == ("x", None, (), "")
    assert decode_card(encode_card(sparse)) == sparse


# ---- corruption -------------------------------------------------------------------------------

GOOD = encode_card(CARD)


def flip(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0x10
    return bytes(out)


CORRUPT: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "model card too short (0 bytes)"),
    "short": (GOOD[:17], "model card too short (17 bytes)"),
    "page, not card": (b"HOPG" + GOOD[4:], "bad magic: not a hybrid-offload model card"),
    "magic bit": (flip(GOOD, 0), "bad magic"),
    "version": (seal(card_json(), version=2), "model card format version 2, expected 1"),
    "length too large": (seal(card_json(), length=10**6), "length mismatch: header says 1000000 JSON bytes"),
    "length too small": (seal(card_json(), length=3), "length mismatch: header says 3 JSON bytes"),
    "truncated": (GOOD[:-1], "length mismatch"),
    "extra byte": (GOOD + b"\0", "length mismatch"),
    "json bit": (flip(GOOD, 30), "model card checksum mismatch"),
    "checksum bit": (flip(GOOD, len(GOOD) - 1), "model card checksum mismatch"),
    "not json": (seal(b"{not json"), "model card JSON is invalid"),
    "not utf-8": (seal(b'{"name": "\xff"}'), "model card JSON is invalid"),
    "NaN": (seal(card_json(written_at=float("nan"))), "model card JSON is invalid: NaN is not allowed"),
    "deep nesting": (seal(b"[" * 30_000 + b"]" * 30_000), "model card JSON is invalid"),
    "not an object": (seal(b"[1, 2]"), "model card JSON must be an object, got list"),
    "missing field": (seal(card_json(chunk_tokens=...)), "field 'chunk_tokens' is missing"),
    "fingerprint": (seal(card_json(fingerprint="XYZ")), "field 'fingerprint' must be 8-64 lowercase hex"),
    "name type": (seal(card_json(name=7)), "field 'name' must be a string, got 7"),
    "revision type": (seal(card_json(revision=["main"])), "field 'revision' must be a string or null"),
    "architectures": (seal(card_json(architectures=["A", 1])), "'architectures' must be a list of strings"),
    "dtype": (seal(card_json(dtype=None)), "field 'dtype' must be a string"),
    "kv_cache_dtype": (seal(card_json(kv_cache_dtype=1)), "field 'kv_cache_dtype' must be a string"),
    "chunk_tokens zero": (seal(card_json(chunk_tokens=0)), "field 'chunk_tokens' must be an integer > 0"),
    "chunk_tokens bool": (seal(card_json(chunk_tokens=True)), "'chunk_tokens' must be an integer > 0"),
    "chunk_tokens float": (seal(card_json(chunk_tokens=384.0)), "'chunk_tokens' must be an integer > 0"),
    "groups type": (seal(card_json(groups={"0": 1})), "field 'groups' must be a list"),
    "group type": (seal(card_json(groups=[[0, "mamba", 1, 1]])), "field 'groups[0]' must be an object"),
    "group field": (seal(card_json(groups=[{"index": 0, "kind": "mamba", "layers": 1}])),
                    "field 'groups[0].shards' is missing"),
    "group shards": (seal(card_json(groups=[{"index": 0, "kind": "mamba", "layers": 1, "shards": 0}])),
                     "field 'groups[0].shards' must be an integer >= 1"),
    "format_version": (seal(card_json(format_version=-1)), "'format_version' must be an integer >= 0"),
    "written_at": (seal(card_json(written_at="yesterday")), "'written_at' must be seconds since 1970"),
    "too large": (GOOD + bytes(MAX_CARD_BYTES), f"more than {MAX_CARD_BYTES}"),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_every_corruption_is_rejected_with_a_clear_error(kind: str) -> None:
    data, message = CORRUPT[kind]
    with pytest.raises(ModelCardError) as caught:
        decode_card(data)
    assert message in str(caught.value), str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_any_single_bit_flip_is_caught() -> None:
    for offset in range(len(GOOD)):
        for bit in (0x01, 0x80):
            data = bytearray(GOOD)
            data[offset] ^= bit
            with pytest.raises(ModelCardError):
                decode_card(bytes(data))


def test_card_under_another_fingerprint_is_a_problem() -> None:
    assert card_problem(card_key(FP), GOOD) is None
    other = "4e" * 16
    mismatch = f"model card fingerprint {FP} is not the key's namespace {other}"
    assert card_problem(card_key(other), GOOD) == mismatch
    assert card_problem(card_key(FP), GOOD[:-1]).startswith("model card length mismatch")
    info = describe_card(card_key(other), GOOD)
    assert info["name"] == CARD.name and not info["fingerprint_matches_key"] and not info["valid"]
    assert describe_card(card_key(FP), GOOD)["written_utc"] == "2023-11-14T22:13:20Z"


# ---- keys and sizes ---------------------------------------------------------------------------


def test_card_key_is_a_valid_key_no_page_key_takes() -> None:
    key = card_key(FP)
    assert key == f"{FP}-{'0' * 32}" and KEY_PATTERN.fullmatch(key)
    assert is_card_key(key) and is_card_key(card_key("0a1b2c3d"))
    spec = model_spec({"name": "x"})
    planner = HybridOffloadPlanner(spec, 16)
    page_keys = [k for group in planner.group_keys(planner.chunk_hashes(list(range(64)))) for k in group]
    assert page_keys and not any(map(is_card_key, page_keys))
    for not_card in (f"{FP}-{'0' * 31}1", f"{FP}-{'0' * 33}", f"{FP}{'0' * 32}", f"-{'0' * 32}",
                     f"{FP.upper()}-{'0' * 32}", f"{FP}-{'0' * 32}\n", ""):  # fmt: skip
        assert not is_card_key(not_card), not_card
    for bad in ("", "xyz", "abc", FP.upper(), f"{FP}-1"):
        with pytest.raises(ModelCardError, match="8-64 lowercase hex"):
            card_key(bad)


def test_size_bound_on_encode_and_decode() -> None:
    fits = dataclasses.replace(CARD, name="m" * (MAX_CARD_BYTES - len(GOOD) + len(CARD.name)))
    assert len(encode_card(fits)) == MAX_CARD_BYTES
    with pytest.raises(ModelCardError, match=f"would be {MAX_CARD_BYTES + 1} bytes"):
        encode_card(dataclasses.replace(fits, name=fits.name + "m"))
    huge = seal(card_json(name="m" * MAX_CARD_BYTES))
    with pytest.raises(ModelCardError, match="more than"):
        decode_card(huge)


def test_encode_refuses_what_decode_would_refuse() -> None:
    with pytest.raises(ModelCardError, match="'chunk_tokens' must be an integer > 0"):
        encode_card(dataclasses.replace(CARD, chunk_tokens=0))
    with pytest.raises(ModelCardError, match="'written_at' must be seconds since 1970"):
        encode_card(dataclasses.replace(CARD, written_at=float("inf")))
    with pytest.raises(ModelCardError, match="before the year 10000"):  # time.gmtime cannot show it
        encode_card(dataclasses.replace(CARD, written_at=1e300))


# ---- the worker writes its card ---------------------------------------------------------------


def model_spec(model_fields: dict[str, Any]) -> ModelSpec:
    attn = GroupSpec(0, GroupKind.FULL_ATTENTION, 8, ("l.0.attn", "l.2.attn"), page_bytes=2048,
                     num_kv_heads=2, head_size=32, head_size_v=32)  # fmt: skip
    mamba = GroupSpec(1, GroupKind.MAMBA, 8, ("l.1.mixer", "l.3.mixer"), page_bytes=128,
                      state_shapes=((3, 8), (4, 4)), state_dtypes=("bfloat16", "float32"),
                      mamba_cache_mode="align", mamba_type="mamba2")  # fmt: skip
    return make_model_spec((attn, mamba), model_fields, max_model_len=1024, num_blocks=16)


def start_worker(
    spec: ModelSpec, backends: tuple[BackendConfig | Tier, ...], page_key: bytes | None = None
) -> Any:
    """An OffloadWorker, once its start-up thread (data paths, model card) is done."""
    from hybrid_offload.connector.worker.offload_worker import OffloadWorker

    tiers = tuple(b if isinstance(b, Tier) else Tier(b) for b in backends)
    worker = OffloadWorker(spec, HybridOffloadPlanner(spec, 16), tiers, 1 << 30, page_key=page_key)
    for thread in threading.enumerate():
        if thread.name == "hybrid-offload-prepare":
            thread.join(30)
    return worker


def disk(tmp_path: Path, name: str, **policy: Any) -> Tier:
    config = BackendConfig("disk", name, 1 << 30, options={"path": str(tmp_path / name)})
    return Tier(config, TierPolicy(**policy))


def held_card(tier: Tier, fingerprint: str) -> bytes | None:
    with create_backend(tier.backend) as backend:
        return backend.get_batch([card_key(fingerprint)])[0]


def test_worker_writes_its_card_to_shared_writable_backends_only(tmp_path: Path) -> None:
    spec = model_spec({"name": "/models/tiny", "architectures": ["TinyHybrid"], "dtype": "float32"})
    cpu = BackendConfig("cpu", "cpu", 1 << 20)
    writable, read_only = disk(tmp_path, "rw"), disk(tmp_path, "ro", read_only=True)
    worker = start_worker(spec, (cpu, writable, read_only))
    try:
        assert worker.backends["cpu"].contains_batch([card_key(spec.fingerprint)]) == [False]
        assert worker.worker_meta() is None, "the card is not a page: never reported to the scheduler"
    finally:
        worker.shutdown(10)
    data = held_card(writable, spec.fingerprint)
    assert data is not None and card_problem(card_key(spec.fingerprint), data) is None
    card = decode_card(data)
    assert (card.name, card.architectures, card.dtype, card.chunk_tokens) == ("/models/tiny", ("TinyHybrid",),
                                                                            "float32", 16)  # fmt: skip
    assert card.groups == (CardGroup(0, "full_attention", 2, 1), CardGroup(1, "mamba", 2, 1))
    assert held_card(read_only, spec.fingerprint) is None


def test_cards_are_signed_under_the_cache_secret(tmp_path: Path) -> None:
    """Issue 31 L5: every engine of a tier writes cards, so an unsigned card says what its
    writer chose. An engine with a cache secret signs its card with the page subkey; a reader
    with the secret trusts only cards signed under it; one without it still reads them."""
    ours, theirs = Secret(b"engines").subkey("page"), Secret(b"forger").subkey("page")
    signed = encode_card(CARD, ours)
    assert len(signed) == len(encode_card(CARD)) + 32
    assert decode_card(signed, ours) == CARD and decode_card(signed) == CARD
    for data, why in ((encode_card(CARD), "not signed"), (encode_card(CARD, theirs), "signature")):
        with pytest.raises(ModelCardError, match=why):
            decode_card(data, ours)
        assert card_problem(card_key(CARD.fingerprint), data, ours) is not None
    assert describe_card(card_key(CARD.fingerprint), signed, ours)["signed"] is True
    assert describe_card(card_key(CARD.fingerprint), encode_card(CARD))["signed"] is False
    spec = model_spec({"name": "/models/tiny", "architectures": ["TinyHybrid"], "dtype": "float32"})
    writable = disk(tmp_path, "rw")
    start_worker(spec, (writable,), page_key=ours).shutdown(10)
    data = held_card(writable, spec.fingerprint)
    assert data is not None and decode_card(data, ours).name == "/models/tiny"


def test_only_tp_rank_0_writes_the_card(tmp_path: Path) -> None:
    attn = GroupSpec(0, GroupKind.FULL_ATTENTION, 8, ("l.0.attn",), page_bytes=1024, num_kv_heads=1,
                     head_size=32, head_size_v=32, total_kv_heads=2)  # fmt: skip
    spec = make_model_spec((attn,), {"name": "m"}, max_model_len=1024, num_blocks=16, tp_rank=1, tp_size=2,
                           max_shards=2)  # fmt: skip
    worker = start_worker(spec, (disk(tmp_path, "d"),))
    worker.shutdown(10)
    assert held_card(disk(tmp_path, "d"), spec.fingerprint) is None


def test_a_failed_card_put_is_logged_at_debug_and_never_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = model_spec({"name": "m"})
    down = faulty_config(disk(tmp_path, "down").backend, fail=["put_batch"])  # as if the medium were gone
    with caplog.at_level(logging.DEBUG, logger="hybrid_offload.connector.tiers"):
        worker = start_worker(spec, (down, disk(tmp_path, "ok")))
        worker.shutdown(10)
    failed = [r for r in caplog.records if "writing the model card failed" in r.getMessage()]
    assert [(r.levelno, "injected put_batch" in r.getMessage()) for r in failed] == [(logging.DEBUG, True)]
    assert held_card(disk(tmp_path, "ok"), spec.fingerprint) is not None
