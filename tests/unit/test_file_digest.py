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


# ---- file systems made from images (issue 45 N2) ----------------------------------------------
MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
31 27 253:1 / /models rw,relatime shared:1 - ext4 /dev/vda1 rw
40 27 7:3 / /mnt/a\\040b ro,relatime - ext4 /dev/loop3 ro
41 27 0:55 / /sif ro,nodev - squashfs /opt/images/model\\040v2.sif ro
42 27 0:56 / /hub rw - fuse.sshfs host:/hub rw
"""


@pytest.mark.parametrize(
    ("dev", "why"),
    [
        ((253, 1), None),
        ((7, 3), "a loop device (7:3)"),
        ((0, 55), "squashfs on /opt/images/model v2.sif"),
        ((0, 56), "fuse.sshfs on host:/hub"),
        ((9, 9), "device 9:9 not in"),
    ],
)
def test_image_file_systems_are_told_from_mountinfo(
    tmp_path: Path, dev: tuple[int, int], why: str | None
) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    got = file_digest.image_file_system(os.makedev(*dev), info)
    assert got == why if why is None or not why.endswith("not in") else got.startswith(why)


def test_on_an_image_file_system_equal_stamps_never_share_a_digest(
    tmp_path: Path, counted: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two fine-tunes of equal size in two images with normalized times: the same (dev, inode,
    size, mtime, ctime) for other bytes, as an image file system reports them (a stand-in
    reproduces its stat values). Each is hashed in full: neither gets the other's digest."""
    cache = tmp_path / "cache"
    first, second = tmp_path / "a.bin", tmp_path / "b.bin"
    first.write_bytes(b"\x01" * 4096)
    second.write_bytes(b"\x02" * 4096)
    forged = os.stat_result((0o100644, 1234, os.makedev(0, 55), 1, 0, 0, 4096, 0, 0, 0))
    real_stat = os.stat

    def image_stat(path: Path, *args: object, **kwargs: object) -> os.stat_result:
        return forged if Path(path).suffix == ".bin" else real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(file_digest.os, "stat", image_stat)
    monkeypatch.setattr(file_digest, "_same_version", lambda a, b: True)  # reads see the forged stamp
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    monkeypatch.setattr(file_digest, "MOUNTINFO", info)
    assert file_sha256(first, cache=cache) == hashlib.sha256(first.read_bytes()).hexdigest()
    assert file_sha256(second, cache=cache) == hashlib.sha256(second.read_bytes()).hexdigest()
    assert file_sha256(first, cache=cache) == hashlib.sha256(first.read_bytes()).hexdigest()
    assert counted == [first, second, first] and not list(cache.glob("*.sha256"))
