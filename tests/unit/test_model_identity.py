"""Weights identity (issue 14 H3, issue 31 M1): what names the weights in the fingerprint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hybrid_offload.core.file_digest import CACHE_ENV
from hybrid_offload.engine.model_identity import adapter_identity, hub_commit, weights_identity

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def safetensors(path: Path, values: bytes, shape: int | None = None) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [shape or len(values)],
                               "data_offsets": [0, len(values)]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + values)


@pytest.fixture(autouse=True)
def digest_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path_factory.mktemp("cache-home")
    monkeypatch.setenv(CACHE_ENV, str(root))
    return root


def normalized(path: Path, mtime_ns: int = 1_700_000_000 * 10**9) -> None:
    """What an image build does to file times."""
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_local_weights_identity_is_their_content(tmp_path: Path) -> None:
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
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a copy without -p: same bytes
    assert weights_identity(str(tmp_path)) == base
    safetensors(shard, b"\x01" * 32)  # same size, header and mtime (a normalized image): new values
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_identity(str(tmp_path)) != base
    safetensors(shard, bytes(32), shape=16)  # another header, same size and mtime
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_identity(str(tmp_path)) != base
    safetensors(shard, bytes(32))  # the original bytes again
    assert weights_identity(str(tmp_path)) == base


def partial_fine_tune(root: Path, *, retrained: set[int] | None = None, layers: int = 32,
                      tensor_bytes: int = 16384) -> None:
    """A 32-layer checkpoint (q/k/v/o per layer); the ``v_proj`` of the ``retrained`` layers
    holds other values. File times normalized, as image builds do."""
    root.mkdir()
    header: dict[str, object] = {}
    values = bytearray()
    for layer in range(layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            seed = layer * 4 + ("q_proj", "k_proj", "v_proj", "o_proj").index(name)
            if name == "v_proj" and retrained and layer in retrained:
                seed += 1000
            block = bytes((seed * 31 + i * 7) % 251 for i in range(256)) * (tensor_bytes // 256)
            header[f"model.layers.{layer}.self_attn.{name}.weight"] = {
                "dtype": "BF16", "shape": [tensor_bytes // 2],
                "data_offsets": [len(values), len(values) + len(block)]}
            values += block
    raw = json.dumps(header).encode()
    (root / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + values)
    normalized(root / "model.safetensors")


def test_a_partial_fine_tune_has_its_own_identity(tmp_path: Path) -> None:
    """Issue 31 M1: two images of one model path, file times normalized, one retrained the
    ``v_proj`` of 28 of 32 layers (22 % of the bytes). The former identity (name, size, mtime,
    header and 16 evenly spread 4 KiB samples) gave both the same identity: the retrained
    layers here are those no sample touched."""
    partial_fine_tune(tmp_path / "probe")
    size = (tmp_path / "probe" / "model.safetensors").stat().st_size
    header_end = 8 + int.from_bytes((tmp_path / "probe" / "model.safetensors").read_bytes()[:8], "little")
    sampled = {((size - 4096) * i // 15 + d - header_end) // 16384 for i in range(16) for d in (0, 4095)}
    untouched = [layer for layer in range(32) if layer * 4 + 2 not in sampled]
    assert len(untouched) >= 28
    partial_fine_tune(tmp_path / "base")
    partial_fine_tune(tmp_path / "tuned", retrained=set(untouched[:28]))
    base, tuned = (tmp_path / "base" / "model.safetensors"), (tmp_path / "tuned" / "model.safetensors")
    assert base.stat().st_size == tuned.stat().st_size and base.read_bytes() != tuned.read_bytes()
    assert weights_identity(str(tmp_path / "base")) != weights_identity(str(tmp_path / "tuned"))
    # ... and a byte anywhere (a quantization scale, one row) too
    data = bytearray(base.read_bytes())
    data[len(data) // 2 + 4096 * 3] ^= 1
    tuned.write_bytes(bytes(data))
    normalized(tuned)
    assert weights_identity(str(tmp_path / "base")) != weights_identity(str(tmp_path / "tuned"))


def test_model_code_is_part_of_the_identity(tmp_path: Path) -> None:
    """``trust_remote_code`` runs the directory's Python files: other code, other KV."""
    safetensors(tmp_path / "model.safetensors", bytes(64))
    (tmp_path / "modeling_x.py").write_text("SCALE = 1.0\n")
    base = weights_identity(str(tmp_path))
    assert [f["name"] for f in base["code"]] == ["modeling_x.py"]
    (tmp_path / "modeling_x.py").write_text("SCALE = 2.0\n")
    normalized(tmp_path / "modeling_x.py")
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


def test_a_single_gguf_file_is_identified(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    identity = weights_identity(str(model))
    assert [f["name"] for f in identity["files"]] == ["model.gguf"]
