"""Disk-backend behaviour beyond the shared contract: crashes, other processes, the tree."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from disk_pages import make_disk, page_path

from hybrid_offload.backends import (
    BackendConfig,
    BackendConfigError,
    BackendUnavailableError,
    create_backend,
)
from hybrid_offload.backends.disk import DiskBackend
from hybrid_offload.testing.backend_pages import key, page

# A separate process using the backend on the same path: put, delete, or crash mid-put.
_CHILD = """
import os, sys
from hybrid_offload.testing.backend_pages import key, page
from hybrid_offload.backends import BackendConfig, create_backend
root, command, ids = sys.argv[1], sys.argv[2], [int(i) for i in sys.argv[3].split(",")]
backend = create_backend(BackendConfig("disk", "child", 1 << 30, options={"path": root}))
if command == "put":
    assert backend.put_batch([(key(i), page(i, 1000 + i)) for i in ids]) == [True] * len(ids)
elif command == "delete":
    assert backend.delete_batch([key(i) for i in ids]) == len(ids)
elif command == "crash":
    os.replace = lambda *args, **kwargs: os._exit(3)  # die between write and rename
    backend.put_batch([(key(i), page(i, 1000 + i)) for i in ids])
backend.close()
"""


def run_child(root: Path, command: str, ids: list[int]) -> subprocess.Popen[str]:
    args = [str(root), command, ",".join(map(str, ids))]
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, *args], stderr=subprocess.PIPE, text=True
    )
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == (3 if command == "crash" else 0), stderr
    return proc


def temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob(".*.tmp"))


def page_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.page"))


def test_layout_one_file_per_page(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with make_disk(root) as backend:
        backend.put_batch([(key(1), page(1, 123)), (key(2), b"")])
    assert page_path(root, key(1)).read_bytes() == page(1, 123)
    assert page_path(root, key(2)).read_bytes() == b""
    assert page_files(root) == sorted([page_path(root, key(1)), page_path(root, key(2))])
    assert temp_files(root) == []


def test_crash_mid_write_never_visible_and_cleaned_at_start(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with make_disk(root) as backend:
        backend.put_batch([(key(0), page(0, 1000))])
    child = run_child(root, "crash", [1, 2])
    assert len(temp_files(root)) == 2  # full pages, written but never renamed
    # a truncated temp file of the dead writer, an old one and a fresh one of a live pid
    leftovers = {}
    for i, pid, name in [(3, child.pid, "dead"), (4, os.getpid(), "old"), (5, os.getpid(), "live")]:
        directory = page_path(root, key(i)).parent
        directory.mkdir(parents=True, exist_ok=True)
        digest = key(i).split("-")[1]
        leftovers[name] = directory / f".{digest}.{pid}.{name.encode().hex():0>12}.tmp"
        leftovers[name].write_bytes(page(i, 1000)[:300])
    hour_ago = time.time() - 3600
    os.utime(leftovers["old"], (hour_ago, hour_ago))

    with make_disk(root) as backend:
        assert backend.contains_batch([key(i) for i in range(6)]) == [True] + [False] * 5
        assert backend.get_batch([key(i) for i in range(6)]) == [page(0, 1000)] + [None] * 5
        assert backend.used_bytes() == 1000
    assert temp_files(root) == [leftovers["live"]]  # a live writer may still rename it
    assert page_files(root) == [page_path(root, key(0))]


def test_pages_of_another_process_are_seen(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ids = list(range(10))
    keys = [key(i) for i in ids]
    with make_disk(root) as scheduler:  # like vLLM's scheduler process: it only looks up
        assert scheduler.contains_batch(keys) == [False] * 10
        run_child(root, "put", ids)
        assert scheduler.contains_batch(keys) == [True] * 10
        assert scheduler.get_batch(keys) == [page(i, 1000 + i) for i in ids]
        buffers = [memoryview(bytearray(2000)) for _ in ids]
        assert scheduler.get_into(keys, buffers) == [1000 + i for i in ids]
        assert bytes(buffers[3][:1003]) == page(3, 1003)
        run_child(root, "delete", ids[:5])
        assert scheduler.contains_batch(keys) == [False] * 5 + [True] * 5
        assert scheduler.get_batch(keys[:5]) == [None] * 5


def test_directory_and_file_modes(tmp_path: Path) -> None:
    root = tmp_path / "parent" / "store"
    old_umask = os.umask(0o022)
    try:
        with make_disk(root) as backend:
            backend.put_batch([(key(1), b"page")])
    finally:
        os.umask(old_umask)
    path = page_path(root, key(1))
    for directory in (root, path.parent.parent, path.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("fsync", [True, False])
def test_fsync_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool) -> None:
    """With ``fsync``: every page file, then once per put each directory a page was renamed
    into (the rename is durable); without: nothing."""
    synced: list[bool] = []  # per fsync: was it a directory
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    with make_disk(tmp_path / "store", fsync=fsync) as backend:
        batch = [(key(i), page(i, 100)) for i in range(10)]
        assert backend.put_batch(batch) == [True] * 10
        assert backend.put_batch([(key(10), page(10, 100))]) == [True]
        assert backend.get_batch([key(10)]) == [page(10, 100)]
        directories = len({backend._paths(k)[0] for k, _ in batch}) + 1
    assert (synced.count(False), synced.count(True)) == ((11, directories) if fsync else (0, 0))


def test_lru_order_survives_reopen(tmp_path: Path) -> None:
    root = tmp_path / "store"
    keys = [key(i) for i in range(4)]
    with make_disk(root, 3000) as backend:
        for i in range(3):
            backend.put_batch([(keys[i], page(i, 1000))])
        backend.get_batch([keys[0]])  # k1 is now least recently used
    with make_disk(root, 3000) as backend:
        backend.put_batch([(keys[3], page(3, 1000))])
        assert backend.contains_batch(keys) == [True, False, True, True]
        assert backend.stats.evictions == 1
    assert len(page_files(root)) == 3


def test_reopen_with_smaller_capacity_evicts_oldest(tmp_path: Path) -> None:
    root = tmp_path / "store"
    keys = [key(i) for i in range(5)]
    with make_disk(root, 10_000) as backend:
        for i, k in enumerate(keys):
            backend.put_batch([(k, page(i, 1000))])
    with make_disk(root, 2000) as backend:
        assert backend.used_bytes() == 2000
        assert backend.contains_batch(keys) == [False, False, False, True, True]
    assert page_files(root) == sorted(page_path(root, k) for k in keys[3:])


def test_page_deleted_by_someone_else_is_a_miss(tmp_path: Path) -> None:
    with make_disk(tmp_path / "store") as backend:
        backend.put_batch([(key(1), page(1, 100)), (key(2), page(2, 200))])
        page_path(tmp_path / "store", key(1)).unlink()
        assert backend.get_batch([key(1), key(2)]) == [None, page(2, 200)]
        assert backend.used_bytes() == 200
        assert backend.stats.errors == 0


def test_symlinked_page_is_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    secret = tmp_path / "secret"
    secret.write_bytes(b"not a page")
    with make_disk(root) as backend:
        path = page_path(root, key(7))
        path.parent.mkdir(parents=True)
        path.symlink_to(secret)
        assert backend.contains_batch([key(7)]) == [False]
        assert backend.get_batch([key(7)]) == [None]
    with make_disk(root) as backend:
        assert backend.used_bytes() == 0


def test_directory_in_place_of_a_page_is_a_miss_and_a_put_replaces_it(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with make_disk(root) as backend:
        backend.put_batch([(key(3), page(3, 100))])
        path = page_path(root, key(3))
        path.unlink()
        (path / "inner").mkdir(parents=True)
        assert backend.contains_batch([key(3)]) == [False]
        assert backend.get_batch([key(3)]) == [None]
        assert backend.put_batch([(key(3), page(3, 120))]) == [True]
        assert path.is_file() and backend.get_batch([key(3)]) == [page(3, 120)]


def test_unusable_path_is_a_config_error_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(BackendConfigError, match=r"option 'path'.*not a writable directory"):
        make_disk(blocker / "cache")


def test_no_space_refuses_put_and_later_puts_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_space(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    root = tmp_path / "store"
    with make_disk(root) as backend:
        with monkeypatch.context() as patch, caplog.at_level(logging.WARNING):
            patch.setattr(os, "write", no_space)
            assert backend.put_batch([(key(1), page(1, 100))]) == [False]
            assert backend.put_batch([(key(i), page(i, 100)) for i in range(2, 8)]) == [False] * 6
        assert backend.stats.errors == 7
        assert backend.stats.put_refused == 7
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
        assert temp_files(root) == []
        assert backend.put_batch([(key(1), page(1, 100))]) == [True]
        assert backend.get_batch([key(1)]) == [page(1, 100)]


def test_read_error_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def io_error(*args: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    with make_disk(tmp_path / "store") as backend:
        backend.put_batch([(key(1), page(1, 100))])
        with monkeypatch.context() as patch:
            patch.setattr(os, "read", io_error)
            patch.setattr(os, "readv", io_error)
            patch.setattr(os, "preadv", io_error)
            assert backend.get_batch([key(1)]) == [None]
            assert backend.get_into([key(1)], [memoryview(bytearray(100))]) == [None]
        assert backend.stats.errors == 2
        assert backend.get_batch([key(1)]) == [page(1, 100)]


def test_vanished_directory_is_unavailable_until_back(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with make_disk(root) as backend:
        backend.put_batch([(key(1), page(1, 100))])
        shutil.rmtree(root)
        with pytest.raises(BackendUnavailableError):
            backend.put_batch([(key(2), page(2, 100))])
        assert backend.get_batch([key(1)]) == [None]
        assert backend.used_bytes() == 0
        root.mkdir()
        assert backend.put_batch([(key(2), page(2, 100))]) == [True]
        assert backend.get_batch([key(2)]) == [page(2, 100)]


def test_single_io_thread_round_trip(tmp_path: Path) -> None:
    with make_disk(tmp_path / "store", io_threads=1) as backend:
        items = [(key(i), page(i, 5000)) for i in range(20)]
        assert backend.put_batch(items) == [True] * 20
        assert backend.get_batch([k for k, _ in items]) == [data for _, data in items]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({}, "path"),
        ({"path": ""}, "path"),
        ({"path": 3}, "path"),
        ({"path": "x", "fsync": "yes"}, "fsync"),
        ({"path": "x", "io_threads": 0}, "io_threads"),
        ({"path": "x", "io_threads": True}, "io_threads"),
        ({"path": "x", "io_threads": "4"}, "io_threads"),
        ({"path": "x", "colour": "red"}, "colour"),
    ],
)
def test_bad_options_name_the_key(options: dict[str, Any], named: str) -> None:
    with pytest.raises(BackendConfigError, match=named):
        DiskBackend.validate_options(options)
    with pytest.raises(BackendConfigError, match=named):
        create_backend(BackendConfig("disk", "d", 1000, options=options))


def test_defaults_filled_in(tmp_path: Path) -> None:
    options = DiskBackend.validate_options({"path": tmp_path})
    assert options == {
        "path": str(tmp_path), "fsync": False, "io_threads": 4, "layout": "files", "segment_mb": 64
    }


def test_get_prefix_reads_only_the_first_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``get_prefix`` (the cache CLI's header reads): one ``pread`` of at most ``nbytes`` per
    page, opened like a get (untrusted files and links are misses), no stamp, no counters."""
    root = tmp_path / "store"
    with make_disk(root) as backend:
        backend.put_batch([(key(i), page(i, 5000 if i < 6 else 10)) for i in range(7)])
        page_path(root, key(2)).chmod(0o666)
        secret = tmp_path / "secret"
        secret.write_bytes(page(3, 5000))
        page_path(root, key(3)).unlink()
        page_path(root, key(3)).symlink_to(secret)
        mtimes = [page_path(root, key(i)).stat().st_mtime_ns for i in (0, 1, 6)]
        stats = dataclasses.replace(backend.stats)
        reads: list[int] = []
        real_pread = os.pread

        def counting_pread(fd: int, n: int, offset: int) -> bytes:
            reads.append(n)
            return real_pread(fd, n, offset)

        with monkeypatch.context() as patch:
            patch.setattr(os, "pread", counting_pread)
            patch.setattr(os, "read", None)  # the whole page is never read
            patch.setattr(os, "readv", None)
            keys = [key(0), key(1), key(2), key(3), key(6), key(9)] * 2  # > a pool batch
            got = backend.get_prefix(keys, 100, [5000] * len(keys))
        want = [page(0, 5000)[:100], page(1, 5000)[:100], None, None, page(6, 10), None] * 2
        assert got == want
        assert sorted(reads) == [10, 10, 100, 100, 100, 100]
        assert [page_path(root, key(i)).stat().st_mtime_ns for i in (0, 1, 6)] == mtimes
        assert backend.stats.gets == stats.gets and backend.stats.hits == stats.hits
        with pytest.raises(ValueError):
            backend.get_prefix([key(0)], 0, [5000])
        with pytest.raises(ValueError):
            backend.get_prefix([key(0)], 10, [])


def test_reads_find_pages_in_a_page_directory_made_again(tmp_path: Path) -> None:
    """Reads keep page directories open; one removed and made again (a cleared cache, another
    engine storing again) is walked afresh, so its new pages are found, not missed."""
    root = tmp_path / "store"
    with make_disk(root) as backend, make_disk(root) as other:
        backend.put_batch([(key(1), page(1, 100))])
        assert backend.get_batch([key(1)]) == [page(1, 100)]  # its directory is now held open
        shutil.rmtree(page_path(root, key(1)).parent.parent)  # the namespace, from outside
        assert other.put_batch([(key(1), page(1, 150))]) == [True]  # made again, a new page
        assert backend.contains_batch([key(1)]) == [True]
        assert backend.get_batch([key(1)]) == [page(1, 150)]


def test_lookups_of_absent_pages_keep_no_descriptor_open(tmp_path: Path) -> None:
    """A page absent from a held directory is a miss, not a reason to open the directory
    again (which kept one descriptor per miss open until close)."""
    with make_disk(tmp_path / "store") as backend:
        backend.put_batch([(key(i), page(i, 10)) for i in range(64)])
        missing = [key(i) for i in range(64, 576)]
        backend.contains_batch(missing)
        held = len(os.listdir("/proc/self/fd"))
        for _ in range(3):
            assert backend.contains_batch(missing) == [False] * len(missing)
            assert backend.get_batch(missing[:64]) == [None] * 64
        assert len(os.listdir("/proc/self/fd")) <= held


def test_reads_stamp_pages_in_order_off_the_readers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read page's mtime (its LRU position for other processes) is stamped by the stamping
    thread, in read order; close() waits for it; prefix reads stamp nothing."""
    from hybrid_offload.backends.disk.files import PageDirs

    stamped: list[tuple[str, str]] = []
    real = PageDirs.stamp_page

    def stamp_page(self: PageDirs, k: str, ns: int) -> None:
        stamped.append((k, threading.current_thread().name))
        real(self, k, ns)

    monkeypatch.setattr(PageDirs, "stamp_page", stamp_page)
    root = tmp_path / "store"
    with make_disk(root) as backend:
        backend.put_batch([(key(i), page(i, 100)) for i in range(6)])
        before = page_path(root, key(4)).stat().st_mtime_ns
        backend.get_prefix([key(0)], 10, [100])
        bufs = [memoryview(bytearray(100)) for _ in range(3)]
        assert backend.get_into([key(4), key(9), key(2)], bufs) == [100, None, 100]
        assert backend.get_batch([key(1)]) == [page(1, 100)]
    assert [k for k, _ in stamped] == [key(4), key(2), key(1)]
    assert all(name.startswith("disk-stamp-") for _, name in stamped)
    assert page_path(root, key(4)).stat().st_mtime_ns > before


def test_a_held_page_directory_swapped_for_a_link_is_not_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "store", tmp_path / "outside"
    with make_disk(root) as backend:
        backend.put_batch([(key(1), page(1, 100))])
        assert backend.get_batch([key(1)]) == [page(1, 100)]
        directory = page_path(root, key(1)).parent
        shutil.copytree(directory, outside)
        shutil.rmtree(directory)
        directory.symlink_to(outside, target_is_directory=True)  # a link into another tree
        assert backend.get_batch([key(1)]) == [None]
        assert backend.contains_batch([key(1)]) == [False]


def test_reads_into_buffers_take_cached_pages_on_the_callers_thread_and_the_rest_in_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages in the page cache are read on the calling thread (RWF_NOWAIT) until one is not;
    from there on the pool reads, and every page lands whole in its buffer either way."""
    from hybrid_offload.backends.disk import files as disk_files
    from hybrid_offload.tools.bench.ceilings import drop_cache

    with make_disk(tmp_path / "store", io_threads=4) as backend:
        pages = {key(i): page(i, 70_000 + i) for i in range(12)}
        assert all(backend.put_batch(list(pages.items())))
        cold = sorted(pages)[5]
        drop_cache(str(page_path(tmp_path / "store", cold)))
        fd = os.open(page_path(tmp_path / "store", cold), os.O_RDONLY)
        try:
            disk_files.readinto_exact(fd, memoryview(bytearray(16)), cached_only=True)
            pytest.skip("this file system reads without waiting for the medium or cannot drop a page")
        except disk_files.NotCachedError:
            pass
        finally:
            os.close(fd)
        on_pool: list[str] = []
        read = DiskBackend._read

        def spy(self: DiskBackend, job: Any, cached_only: bool = False) -> Any:
            if not cached_only:
                on_pool.append(job[0])
            return read(self, job, cached_only)

        monkeypatch.setattr(DiskBackend, "_read", spy)
        keys = sorted(pages)
        bufs = [bytearray(80_000) for _ in keys]
        sizes = backend.get_into(keys, [memoryview(b) for b in bufs])
        assert sizes == [len(pages[k]) for k in keys]
        assert all(bytes(b[: len(pages[k])]) == pages[k] for k, b in zip(keys, bufs, strict=True))
        assert sorted(on_pool) == keys[5:]  # the first page not cached and every one after it
        on_pool.clear()
        assert backend.get_into(keys, [memoryview(b) for b in bufs]) == sizes
        assert on_pool == []  # all cached now


def test_cached_only_reads_stop_at_the_first_page_not_cached() -> None:
    from hybrid_offload.backends.disk.files import NotCachedError, read_while_cached

    def read(job: int) -> int:
        if job == 3:
            raise NotCachedError
        return job * 10

    assert read_while_cached([1, 2, 3, 4], read) == [10, 20]
    assert read_while_cached([], read) == []
