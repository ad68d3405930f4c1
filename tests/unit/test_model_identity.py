"""Weights identity (issue 14 H3): what names the weights in the fingerprint."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybrid_offload.engine.model_identity import adapter_identity, hub_commit, weights_identity

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def safetensors(path: Path, values: bytes, shape: int | None = None) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [shape or len(values)],
                               "data_offsets": [0, len(values)]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + values)


def test_local_weights_identity_changes_with_any_rewrite(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    safetensors(tmp_path / "model-00001.safetensors", bytes(32))
    safetensors(tmp_path / "model-00002.safetensors", bytes(32))
    (tmp_path / "tokenizer.json").write_text("{}")  # not weights
    base = weights_identity(str(tmp_path))
    assert [f["name"] for f in base["files"]] == ["model-00001.safetensors", "model-00002.safetensors"]
    assert weights_identity(str(tmp_path)) == base
    (tmp_path / "tokenizer.json").write_text('{"x": 1}')
    assert weights_identity(str(tmp_path)) == base
    shard = tmp_path / "model-00002.safetensors"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # rewritten in place: a new mtime
    assert weights_identity(str(tmp_path)) != base
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_identity(str(tmp_path)) == base
    safetensors(shard, b"\x01" * 32)  # same size, header and mtime (a normalized image): new values
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_identity(str(tmp_path)) != base  # the sample of its bytes
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    safetensors(shard, bytes(32), shape=16)  # another header, same size and mtime
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_identity(str(tmp_path)) != base


def test_hub_snapshots_are_named_by_their_commit(tmp_path: Path) -> None:
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    safetensors(snapshot / "model.safetensors", bytes(8))
    assert hub_commit(str(snapshot)) == COMMIT
    assert weights_identity(str(snapshot)) == {"hub_commit": COMMIT}
    assert hub_commit(str(tmp_path)) is None


def test_nothing_to_identify_says_so(tmp_path: Path) -> None:
    assert "unidentified" in weights_identity(str(tmp_path / "absent"))
    (tmp_path / "config.json").write_text("{}")
    assert "unidentified" in weights_identity(str(tmp_path))
    assert "unidentified" in adapter_identity("bad\x00path")


def test_adapter_identity_covers_its_config_content(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    safetensors(tmp_path / "adapter_model.safetensors", bytes(16))
    base = adapter_identity(str(tmp_path))
    st = (tmp_path / "adapter_config.json").stat()
    (tmp_path / "adapter_config.json").write_text('{"r": 9}')
    os.utime(tmp_path / "adapter_config.json", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert adapter_identity(str(tmp_path)) != base  # content, not only metadata


def test_large_weight_files_are_sampled_not_read_whole(tmp_path: Path) -> None:
    """A fine-tune of the same shapes changes every sampled block; the file is read only in
    ``SAMPLES`` blocks (a byte between them is the documented limit, with the mtime kept)."""
    from hybrid_offload.engine.model_identity import SAMPLE_BYTES, SAMPLES

    size = SAMPLES * SAMPLE_BYTES * 64
    weights = tmp_path / "model.safetensors"
    safetensors(weights, bytes(size))
    st = weights.stat()
    base = weights_identity(str(tmp_path))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 + SAMPLE_BYTES * 3] ^= 1  # between two sampled blocks
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_identity(str(tmp_path)) == base
    safetensors(weights, bytes(range(256)) * (size // 256))  # other values throughout
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_identity(str(tmp_path)) != base


def test_a_single_gguf_file_is_identified(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    identity = weights_identity(str(model))
    assert [f["name"] for f in identity["files"]] == ["model.gguf"]
