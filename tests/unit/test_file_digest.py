"""Full-content file digests, cached per file version (issue 31 M1)."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from hybrid_offload.core import file_digest
from hybrid_offload.core.file_digest import file_sha256, file_sha256_many


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files actually read."""
    calls: list[Path] = []
    real = file_digest._hash

    def counting(path: Path) -> tuple[str, os.stat_result]:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(file_digest, "_hash", counting)
    return calls


def test_the_digest_is_of_every_byte_and_read_once_per_version(tmp_path: Path, counted: list[Path]) -> None:
    cache = tmp_path / "cache"
    weights = tmp_path / "w.bin"
    data = os.urandom(3 * file_digest.CHUNK_BYTES + 5)
    weights.write_bytes(data)
    assert file_sha256(weights, cache=cache) == hashlib.sha256(data).hexdigest()
    assert file_sha256(weights, cache=cache) == hashlib.sha256(data).hexdigest()
    assert counted == [weights]
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    (entry,) = cache.glob("*.sha256")
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    st = weights.stat()
    changed = bytearray(data)
    changed[12345] ^= 1
    weights.write_bytes(bytes(changed))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # a new ctime all the same
    assert file_sha256(weights, cache=cache) == hashlib.sha256(changed).hexdigest()
    assert len(counted) == 2


def test_a_cache_others_can_write_is_not_trusted(tmp_path: Path, counted: list[Path]) -> None:
    """A digest written by someone else would let two sets of weights share an identity."""
    cache = tmp_path / "cache"
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"real weights")
    real = hashlib.sha256(b"real weights").hexdigest()
    assert file_sha256(weights, cache=cache) == real
    (entry,) = cache.glob("*.sha256")
    forged = hashlib.sha256(b"other weights").hexdigest()
    entry.write_text(forged)
    assert file_sha256(weights, cache=cache) == forged  # (the entry is what the cache serves)
    os.chmod(cache, 0o777)
    assert file_sha256(weights, cache=cache) == real
    os.chmod(cache, 0o700)
    entry.unlink()
    (tmp_path / "elsewhere").write_text(forged)
    entry.symlink_to(tmp_path / "elsewhere")
    assert file_sha256(weights, cache=cache) == real
    if os.geteuid() == 0:  # only root can hand an entry to another user
        entry.unlink()
        entry.write_text(forged)
        os.chown(entry, 65534, 65534)
        assert file_sha256(weights, cache=cache) == real
    entry.unlink()
    entry.write_text("not a digest")
    assert file_sha256(weights, cache=cache) == real


def test_without_a_usable_cache_the_digest_is_still_computed(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("a file where the cache directory should be")
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"x" * 100)
    digest = file_sha256(weights, cache=tmp_path / "blocker" / "cache")
    assert digest == hashlib.sha256(b"x" * 100).hexdigest()
    with pytest.raises(OSError):
        file_sha256(tmp_path / "absent.bin", cache=tmp_path / "cache")


def test_files_are_hashed_in_parallel_and_each_version_once(tmp_path: Path, counted: list[Path]) -> None:
    files = []
    for i in range(5):
        files.append(tmp_path / f"shard-{i}.bin")
        files[-1].write_bytes(bytes([i]) * (1 << 20))
    digests = file_sha256_many([*files, files[0]], cache=tmp_path / "cache", threads=4)
    assert digests == [hashlib.sha256(bytes([i]) * (1 << 20)).hexdigest() for i in [*range(5), 0]]
    assert sorted(counted) == sorted(files)  # the repeated path waited for the first one's entry
