"""Weights identity (issue 14 H3): what names the weights in the fingerprint."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybrid_offload.model_identity import adapter_identity, hub_commit, weights_identity

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
    safetensors(shard, b"\x01" * 32)  # same size and header, new values
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_identity(str(tmp_path)) == base  # the documented limit: same bytes' metadata
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert weights_identity(str(tmp_path)) != base
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
