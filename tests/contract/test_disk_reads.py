"""The disk backend's read path (both layouts): O_DIRECT where it applies and its fallbacks,
large loads cut into pieces read in parallel (also inside pages), what a reader sees after a
writer crashed, on the test's file system (``tmp_path``) and on a tmpfs."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybrid_offload.backends import (
    Backend,
    BackendClosedError,
    BackendConfig,
    create_backend,
)
from hybrid_offload.backends.disk import backend as disk
from hybrid_offload.backends.disk import direct as disk_direct
from hybrid_offload.backends.disk import segment_reads
from hybrid_offload.backends.disk import segments as disk_segments
from hybrid_offload.testing.backend_pages import key, page
from hybrid_offload.tools.bench.ceilings import drop_tree_cache

LAYOUTS = ["files", "segments"]
BLOCK = disk_direct.ALIGN


def make(root: Path, layout: str, **options: Any) -> Backend:
    config = BackendConfig(
        "disk", "reads-test", 1 << 30, options={"path": str(root), "layout": layout, **options}
    )
    return create_backend(config)


def rows(count: int, size: int, offset: int = 0) -> list[memoryview]:
    """``count`` buffers of ``size`` back to back in one page-aligned block, from ``offset``."""
    block = memoryview(mmap.mmap(-1, count * size + offset + BLOCK))
    return [block[offset + i * size : offset + (i + 1) * size] for i in range(count)]


def drop(root: Path) -> None:
    """Write back and drop every file under ``root`` from the page cache (best effort)."""
    drop_tree_cache(str(root))


def data_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.suffix in (".page", ".seg")]


def reads_of(backend: Backend) -> disk_direct.DirectReads:
    reads = backend._reads  # type: ignore[attr-defined]
    assert isinstance(reads, disk_direct.DirectReads)
    return reads


def can_go_direct(root: Path) -> bool:
    """Whether this file system takes O_DIRECT reads and the kernel has cachestat."""
    if not disk_direct.DirectReads("probe").enabled:
        return False
    probe = root / "probe"
    probe.write_bytes(b"\0" * BLOCK)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    finally:
        probe.unlink()
    os.close(fd)
    return True


@pytest.fixture
def tmpfs_path() -> Iterator[Path]:
    mounts = Path("/proc/mounts").read_text() if Path("/proc/mounts").exists() else ""
    if " /dev/shm tmpfs " not in mounts or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no tmpfs at /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        yield Path(tmp)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cold_aligned_pages_are_read_around_the_page_cache(tmp_path: Path, layout: str) -> None:
    """Pages of whole blocks into block-aligned buffers, not in the page cache: O_DIRECT (where
    the file system takes it); the same bytes either way, and a second read goes on working."""
    root = tmp_path / "store"
    pages = {key(i): page(i, 4 * BLOCK) for i in range(6)}
    with make(root, layout) as backend:
        assert all(backend.put_batch(list(pages.items())))
        drop(root)
        files = data_files(root)
        fd = os.open(files[0], os.O_RDONLY)
        try:
            counts = disk_direct.cached_pages(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        bufs = rows(len(pages), 4 * BLOCK)
        assert backend.get_into(list(pages), bufs) == [4 * BLOCK] * len(pages)
        assert [bytes(b) for b in bufs] == list(pages.values())
        if can_go_direct(tmp_path) and counts is not None and counts[0] == 0:
            assert reads_of(backend).direct_bytes == 4 * BLOCK * len(pages)
        assert backend.get_into(list(pages), bufs) == [4 * BLOCK] * len(pages)
        assert [bytes(b) for b in bufs] == list(pages.values())
        assert backend.stats.errors == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("offset", [64, 0])
def test_unaligned_pages_or_buffers_are_read_through_the_page_cache(
    tmp_path: Path, layout: str, offset: int
) -> None:
    """Buffers at 64 bytes past a block (the engine's staging rows), or pages that are not whole
    blocks: buffered reads, the same bytes; a page larger than its buffer is still a miss."""
    root = tmp_path / "store"
    size = 4 * BLOCK if offset else 4 * BLOCK + 256
    pages = {key(i): page(i, size) for i in range(5)}
    with make(root, layout) as backend:
        assert all(backend.put_batch(list(pages.items())))
        drop(root)
        bufs = rows(len(pages), size, offset)
        small = memoryview(bytearray(size - 1))
        assert backend.get_into([*pages, key(99)], [*bufs[:-1], small, memoryview(bytearray(8))]) == [
            size
        ] * 4 + [None, None]
        assert [bytes(b) for b in bufs[:-1]] == list(pages.values())[:-1]
        assert reads_of(backend).direct_bytes == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_tmpfs_reads_pages_whole(tmpfs_path: Path, layout: str) -> None:
    """On a tmpfs every page is in memory: read through the page cache (no O_DIRECT, whether
    this kernel's tmpfs takes it or refuses it), aligned or not."""
    root = tmpfs_path / "store"
    pages = {key(i): page(i, 4 * BLOCK) for i in range(6)}
    with make(root, layout) as backend:
        assert all(backend.put_batch(list(pages.items())))
        for offset in (0, 64):
            bufs = rows(len(pages), 4 * BLOCK, offset)
            assert backend.get_into(list(pages), bufs) == [4 * BLOCK] * len(pages)
            assert [bytes(b) for b in bufs] == list(pages.values())
        assert reads_of(backend).direct_bytes == 0
        assert backend.stats.errors == 0


def force_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every aligned read look cold (as cachestat would after the cache was dropped)."""
    monkeypatch.setattr(disk_direct, "cached_pages", lambda fd, offset, length: (0, -(-length // BLOCK)))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("where", ["statx", "open", "read"])
def test_a_file_system_refusing_o_direct_falls_back_to_buffered_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, layout: str, where: str
) -> None:
    """A file system that says it takes no O_DIRECT (statx), or answers EINVAL (at the open,
    or at the read) turns it off for the backend, logged once, not counted as an error; the
    pages are read buffered from where the direct read stopped."""
    real_open, real_preadv = os.open, os.preadv

    def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    def refusing_preadv(fd: int, views: Any, offset: int, *args: Any) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, views, offset, *args)

    root = tmp_path / "store"
    pages = {key(i): page(i, 4 * BLOCK) for i in range(4)}
    with make(root, layout) as backend:
        assert all(backend.put_batch(list(pages.items())))
        reads = reads_of(backend)
        if not reads.enabled:
            pytest.skip("no cachestat or O_DIRECT here: reads are buffered anyway")
        force_direct(monkeypatch)
        if where == "statx":
            monkeypatch.setattr(disk_direct, "dio_alignment", lambda fd: 0)
        elif where == "open":
            monkeypatch.setattr(os, "open", refusing_open)
        else:
            monkeypatch.setattr(os, "preadv", refusing_preadv)
        bufs = rows(len(pages), 4 * BLOCK)
        with caplog.at_level("INFO", logger="hybrid_offload.backends.disk"):
            assert backend.get_into(list(pages), bufs) == [4 * BLOCK] * len(pages)
            assert backend.get_into(list(pages), bufs) == [4 * BLOCK] * len(pages)
        assert [bytes(b) for b in bufs] == list(pages.values())
        assert not reads.enabled and reads.direct_bytes == 0
        assert sum("refuses O_DIRECT" in r.message for r in caplog.records) == 1
        assert backend.stats.errors == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_still_dirty_in_the_page_cache_are_read_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """An O_DIRECT read of bytes written but not yet on the medium (no fsync) sees them: the
    kernel writes the range back first."""
    if not can_go_direct(tmp_path):
        pytest.skip("this file system or kernel does not take O_DIRECT reads")
    root = tmp_path / "store"
    pages = {key(i): page(i, 2 * BLOCK) for i in range(8)}
    with make(root, layout) as backend:
        force_direct(monkeypatch)
        assert all(backend.put_batch(list(pages.items())))
        bufs = rows(len(pages), 2 * BLOCK)
        assert backend.get_into(list(pages), bufs) == [2 * BLOCK] * len(pages)
        assert [bytes(b) for b in bufs] == list(pages.values())
        assert reads_of(backend).direct_bytes == 2 * BLOCK * len(pages)


_CRASH = """
import os, sys
from hybrid_offload.testing.backend_pages import key, page
from hybrid_offload.backends import BackendConfig, create_backend
from hybrid_offload.backends.disk import segment_writer
root, layout, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
backend = create_backend(BackendConfig("disk", "child", 1 << 30, options={"path": root, "layout": layout}))
assert backend.put_batch([(key(1), page(1, size)), (key(2), page(2, size))]) == [True, True]
if layout == "segments":  # die after the page bytes are written, before their records
    segment_writer.SegmentWriter.append_records = lambda *args, **kwargs: os._exit(3)
else:  # die between the temp file's write and its rename
    os.replace = lambda *args, **kwargs: os._exit(3)
backend.put_batch([(key(3), page(3, size))])
"""


@pytest.mark.parametrize("layout", LAYOUTS)
def test_direct_reads_after_a_writer_crashed_mid_write_see_what_buffered_reads_see(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """A writer dies mid-put: the pages it finished are read whole, the one it was writing is a
    miss, the same with O_DIRECT (forced) as through the page cache."""
    root, size = tmp_path / "store", 4 * BLOCK
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH, str(root), layout, str(size)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    want = [page(1, size), page(2, size)]
    for direct in (True, False):
        with monkeypatch.context() as patch:
            if direct:
                force_direct(patch)
            with make(root, layout) as backend:
                bufs = rows(3, size)
                assert backend.get_into([key(1), key(2), key(3)], bufs) == [size, size, None]
                assert [bytes(b) for b in bufs[:2]] == want
                if direct and can_go_direct(tmp_path):
                    assert reads_of(backend).direct_bytes == 2 * size
                else:
                    assert reads_of(backend).direct_bytes == 0


def test_a_segment_shorter_than_its_log_is_a_miss_with_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page past a segment's end (the file cut short under the log) is a miss; the direct read
    stopping at the end is not taken for a refusal."""
    if not can_go_direct(tmp_path):
        pytest.skip("this file system or kernel does not take O_DIRECT reads")
    root = tmp_path / "store"
    pages = {key(i): page(i, 2 * BLOCK) for i in range(4)}
    with make(root, "segments") as backend:
        assert all(backend.put_batch(list(pages.items())))
        (segment,) = data_files(root)
        os.truncate(segment, 5 * BLOCK + 100)  # page 2 ends past it, page 3 starts past it
        force_direct(monkeypatch)
        bufs = rows(len(pages), 2 * BLOCK)
        assert backend.get_into(list(pages), bufs) == [2 * BLOCK, 2 * BLOCK, None, None]
        assert [bytes(b) for b in bufs[:2]] == list(pages.values())[:2]
        assert reads_of(backend).enabled


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cold", [False, True])
def test_large_loads_are_read_in_parallel_pieces_cut_inside_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, cold: bool
) -> None:
    """A load of ``_PARALLEL_BYTES`` or more goes to the pool at once (warm or cold), in parts;
    in the segment layout pieces are cut inside pages. Pages of odd sizes land whole, absent
    keys and pages larger than their buffer are misses, in input order."""
    monkeypatch.setattr(disk, "_PARALLEL_BYTES", 64 << 10)
    monkeypatch.setattr(disk_segments, "_PARALLEL_BYTES", 64 << 10)
    monkeypatch.setattr(segment_reads, "MIN_PIECE", 5000)
    monkeypatch.setattr(disk, "_PARALLEL_PAGE_BYTES", 0)
    monkeypatch.setattr(disk_segments, "read_parts", lambda io_threads: io_threads)
    root = tmp_path / "store"
    pages = {key(i): page(i, 9_000 + 777 * i) for i in range(24)}
    with make(root, layout, io_threads=4) as backend:
        assert all(backend.put_batch(list(pages.items())[:12]))
        assert all(backend.put_batch(list(pages.items())[12:]))
        if cold:
            drop(root)
        keys = [*reversed(pages), key(999)]
        bufs = [memoryview(bytearray(30_000)) for _ in keys]
        bufs[3] = memoryview(bytearray(len(pages[keys[3]]) - 1))  # too small: a miss
        threads: set[str] = set()
        spied = "_read_task" if layout == "segments" else "_read"
        real = getattr(type(backend), spied)

        def spy(*args: Any, **kwargs: Any) -> Any:
            threads.add(threading.current_thread().name)
            return real(*args, **kwargs)

        monkeypatch.setattr(type(backend), spied, spy)
        got = backend.get_into(keys, bufs)
        assert len(threads) > 1  # this thread and the pool's, warm or cold
        want = [len(pages[k]) for k in keys[:-1]] + [None]
        want[3] = None
        assert got == want
        for k, buf, n in zip(keys, bufs, got, strict=True):
            if n is not None:
                assert bytes(buf[:n]) == pages[k]
        assert backend.stats.errors == 0


def test_a_failed_piece_misses_only_the_pages_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error in one piece of a run: the pages with bytes in that piece are misses (counted
    as errors), the others land whole."""
    monkeypatch.setattr(disk_segments, "_PARALLEL_BYTES", 1)
    monkeypatch.setattr(segment_reads, "MIN_PIECE", 4096)
    monkeypatch.setattr(disk_segments, "read_parts", lambda io_threads: io_threads)
    root = tmp_path / "store"
    pages = {key(i): page(i, 3072) for i in range(5)}  # 15 KiB: pieces of 4 KiB
    with make(root, "segments", io_threads=4) as backend:
        assert all(backend.put_batch(list(pages.items())))
        real = os.preadv

        def failing(fd: int, views: Any, offset: int, *args: Any) -> int:
            if offset == 4096:
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, views, offset, *args)

        monkeypatch.setattr(os, "preadv", failing)
        bufs = [memoryview(bytearray(3072)) for _ in pages]
        # the second piece, [4096, 8192), holds parts of pages 1 and 2
        assert backend.get_into(list(pages), bufs) == [3072, None, None, 3072, 3072]
        assert [bytes(bufs[i]) for i in (0, 3, 4)] == [list(pages.values())[i] for i in (0, 3, 4)]
        assert backend.stats.errors == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_large_loads_from_several_threads_and_a_close_racing_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """Parallel loads share the pool: every thread gets its own pages whole; a close() racing
    them returns (bounded), and each load either finished or raised BackendClosedError."""
    monkeypatch.setattr(disk, "_PARALLEL_BYTES", 1)
    monkeypatch.setattr(disk, "_PARALLEL_PAGE_BYTES", 0)
    monkeypatch.setattr(disk_segments, "_PARALLEL_BYTES", 1)
    monkeypatch.setattr(segment_reads, "MIN_PIECE", 4096)
    root = tmp_path / "store"
    pages = {key(i): page(i, 20_000 + 37 * i) for i in range(32)}
    backend = make(root, layout, io_threads=3)
    assert all(backend.put_batch(list(pages.items())))
    errors: list[BaseException] = []
    closed = threading.Event()

    def load(seed: int) -> None:
        keys = list(pages)[seed % 4 :: 2]
        try:
            for _ in range(200):
                bufs = [memoryview(bytearray(25_000)) for _ in keys]
                got = backend.get_into(keys, bufs)
                assert got == [len(pages[k]) for k in keys]
                assert all(bytes(b[: len(pages[k])]) == pages[k] for k, b in zip(keys, bufs, strict=True))
        except BackendClosedError:
            assert closed.is_set()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    closed.set()
    began = time.monotonic()
    backend.close()
    assert time.monotonic() - began < 10
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()
    assert errors == []
