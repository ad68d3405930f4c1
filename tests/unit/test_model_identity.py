"""Weights identity (issue 14 H3, issue 31 M1, issue 45 N3): what names the weights in the
fingerprint, bound to what the engine loaded."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid_offload.core.file_digest import CACHE_ENV
from hybrid_offload.engine import model_identity
from hybrid_offload.engine.model_identity import adapter_identity, hub_commit, weights_identity

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def safetensors(path: Path, values: bytes, shape: int | None = None) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [shape or len(values)],
                               "data_offsets": [0, len(values)]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + values)


@pytest.fixture(autouse=True)
def digest_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path_factory.mktemp("cache-home")
    monkeypatch.setenv(CACHE_ENV, str(root))
    return root


def engine_started(monkeypatch: pytest.MonkeyPatch, ns: int) -> None:
    """The engine process started at ``ns`` (ns since the epoch). ``raising=False``: on code
    without the check the test fails on what it asserts, not on the patch."""
    monkeypatch.setattr(model_identity, "process_start_ns", lambda: ns, raising=False)


@pytest.fixture(autouse=True)
def started_after_the_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the engine started after the test wrote its files (2100-01-01)."""
    engine_started(monkeypatch, 4_102_444_800 * 10**9)


def next_tick(probe_dir: Path, *paths: Path) -> int:
    """A time (ns) later than every time of ``paths`` (and what lies in them) and not later
    than any change made after this returns: a probe file (in ``probe_dir``, away from the
    model) is touched until its ctime passes them, at most one clock tick. No sleep."""
    probe_dir.mkdir(exist_ok=True)
    latest = 0
    for path in paths:
        for p in [path, *(path.rglob("*") if path.is_dir() else ())]:
            st = os.lstat(p)
            latest = max(latest, st.st_mtime_ns, st.st_ctime_ns)
    probe = probe_dir / "probe"
    while True:
        probe.write_bytes(b"")
        if (now := probe.stat().st_ctime_ns) > latest:
            return now


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


def hub_file(snapshot: Path, name: str, data: bytes, *, lfs: bool = True) -> Path:
    """``name`` in a hub cache snapshot as huggingface_hub lays it out: a relative link to the
    repo's blob named by its etag (an LFS file's sha256, else its git blob sha1)."""
    etag = (hashlib.sha256(data) if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data)).hexdigest()
    blobs = snapshot.parent.parent / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    (blobs / etag).write_bytes(data)
    link = snapshot / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blobs / etag, link.parent))
    return blobs / etag


def hub_snapshot(repo: Path, commit: str = COMMIT, weights: bytes = bytes(8)) -> Path:
    snapshot = repo / "snapshots" / commit
    hub_file(snapshot, "config.json", b"{}", lfs=False)
    hub_file(snapshot, "model.safetensors", weights)
    return snapshot


def test_hub_snapshots_are_named_by_their_commit(tmp_path: Path) -> None:
    snapshot = hub_snapshot(tmp_path / "models--org--tiny")
    assert hub_commit(str(snapshot)) == COMMIT
    assert weights_identity(str(snapshot)) == {"hub_commit": COMMIT}
    assert hub_commit(str(tmp_path)) is None


def test_hub_snapshot_commit_is_trusted_only_for_links_into_its_blobs(tmp_path: Path) -> None:
    """Issue 45 N3: a snapshot directory is named by its commit only where its files are the
    commit's: links into the repo's blobs. A copy of other weights placed there (or a link
    into another repo's blobs) is identified by its bytes, like a local directory."""
    snapshot = hub_snapshot(tmp_path / "models--org--tiny")
    weights = snapshot / "model.safetensors"
    weights.unlink()
    safetensors(weights, b"\x01" * 8)  # a regular file, not the commit's blob
    identity = weights_identity(str(snapshot))
    assert "hub_commit" not in identity
    assert [f["name"] for f in identity["files"]] == ["model.safetensors"]

    other = hub_snapshot(tmp_path / "models--org--other", weights=b"\x02" * 8)
    weights.unlink()
    weights.symlink_to(os.path.relpath(other / "model.safetensors", snapshot))  # another repo's blob
    assert "hub_commit" not in weights_identity(str(snapshot))
    adapter = hub_snapshot(tmp_path / "models--org--lora", weights=b"\x03" * 8)
    assert adapter_identity(str(adapter)) == {"hub_commit": COMMIT}
    blob = (adapter / "model.safetensors").resolve()
    blob.write_bytes(b"\x04" * 8)  # the blob no longer holds what its name says
    assert "hub_commit" not in adapter_identity(str(adapter))


def test_hub_blobs_written_after_the_engine_started_must_hold_their_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 45 N3: a blob written since the engine started (vLLM downloading it at start-up)
    keeps the commit name where its bytes are those its name (sha256) says; rewritten with
    other bytes (same size), the engine may run either: unbound."""
    repo = tmp_path / "models--org--tiny"
    snapshot = hub_snapshot(repo)
    engine_started(monkeypatch, next_tick(tmp_path / "probe", repo))
    blob = (snapshot / "model.safetensors").resolve()
    blob.write_bytes(bytes(8))  # downloaded again, the same bytes
    assert weights_identity(str(snapshot)) == {"hub_commit": COMMIT}
    blob.write_bytes(b"\x05" * 8)  # rewritten in place after the engine started
    identity = weights_identity(str(snapshot))
    assert "hub_commit" not in identity and "unbound" in identity


def test_a_repo_id_whose_ref_moved_after_the_engine_started_is_unbound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 45 N3: a repo id resolves through ``refs/main`` when the connector is created. If
    a new revision was downloaded after the engine started, the engine may have loaded the
    other snapshot. A first download (one snapshot) still names its commit."""
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    repo = hub / "models--org--tiny"
    hub_snapshot(repo, COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    assert weights_identity("org/tiny") == {"hub_commit": COMMIT}  # started after all of it
    engine_started(monkeypatch, next_tick(tmp_path / "probe", hub))
    hub_snapshot(repo, OTHER_COMMIT, weights=b"\x06" * 8)
    (repo / "refs" / "main").write_text(OTHER_COMMIT)
    identity = weights_identity("org/tiny")
    assert "hub_commit" not in identity and "unbound" in identity
    # a fresh download during start-up: the only snapshot is the one the engine can have loaded
    fresh = hub / "models--org--fresh"
    hub_snapshot(fresh, OTHER_COMMIT)
    (fresh / "refs").mkdir()
    (fresh / "refs" / "main").write_text(OTHER_COMMIT)
    assert weights_identity("org/fresh") == {"hub_commit": OTHER_COMMIT}


def local_model(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    safetensors(directory / "model.safetensors", bytes(32))
    (directory / "modeling_x.py").write_text("SCALE = 1.0\n")
    return directory


def test_files_changed_after_the_engine_started_leave_the_weights_unbound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 45 N3: the identity is taken after vLLM loaded the weights and profiled (minutes).
    A weight, code or config file written in between (even with the same size and mtime), a
    file renamed into place, or a link swapped on the path may hold other bytes than the
    engine runs: the weights are unbound, an identity no other engine or call shares."""
    prepared = local_model(tmp_path / "prepared")  # written before the engine started
    other = local_model(tmp_path / "other")  # a new version, also ready before it started
    models = {kind: local_model(tmp_path / kind) for kind in
              ("weights", "code", "config", "renamed", "linked", "untouched")}  # fmt: skip
    (tmp_path / "current").symlink_to(models["linked"])
    engine_started(monkeypatch, next_tick(tmp_path / "probe", tmp_path))

    def rewrite(path: Path, data: bytes) -> None:  # in place: same inode, size and mtime
        st = path.stat()
        with open(path, "r+b") as f:
            f.write(data)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    rewrite(models["weights"] / "model.safetensors", (models["weights"] / "model.safetensors").read_bytes())
    rewrite(models["code"] / "modeling_x.py", b"SCALE = 2.0\n")
    rewrite(models["config"] / "config.json", b"[]")
    os.replace(prepared / "model.safetensors", models["renamed"] / "model.safetensors")
    (tmp_path / "current").unlink()
    (tmp_path / "current").symlink_to(other)
    for kind in ("weights", "code", "config", "renamed"):
        identity = weights_identity(str(models[kind]))
        assert "unbound" in identity and "files" not in identity, kind
        assert weights_identity(str(models[kind]))["nonce"] != identity["nonce"]  # no one shares it
    assert "unbound" in weights_identity(str(tmp_path / "current"))
    bound = weights_identity(str(models["untouched"]))
    assert [f["name"] for f in bound["files"]] == ["model.safetensors"]
    engine_started(monkeypatch, next_tick(tmp_path / "probe", tmp_path))  # a restart: all settled
    assert weights_identity(str(models["weights"])) == bound


def test_process_start_is_read_from_proc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The start of a process, at the end of its clock tick, on the clock of file times: a
    file written just before a process is spawned is before its start (a model built, then an
    engine started: never taken for weights changed after the start)."""
    monkeypatch.undo()  # the real one
    tick = 10**9 // os.sysconf("SC_CLK_TCK")
    for _ in range(20):  # a spawn soon after the write, often in the same tick
        written = tmp_path / "model.safetensors"
        written.write_bytes(b"x")
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                 stdin=subprocess.PIPE)  # fmt: skip
        after = time.time_ns()
        try:
            started = model_identity.process_start_ns(child.pid)
            assert written.stat().st_mtime_ns < started <= after + 2 * tick
        finally:
            child.communicate(b"")


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
