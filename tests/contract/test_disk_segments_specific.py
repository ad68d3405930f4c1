"""The disk backend's segment layout beyond the shared contract: other processes, crashes,
adoption of dead writers, damaged logs, space reclaimed by compaction."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from hybrid_offload.backends import (
    BackendClosedError,
    BackendConfig,
    BackendConfigError,
    create_backend,
)
from hybrid_offload.backends.disk import segment_reads, segment_writer
from hybrid_offload.backends.disk import segments as disk_segments
from hybrid_offload.backends.disk.segment_log import PUT, Record, decode, encode
from hybrid_offload.backends.disk.segment_writer import SegmentWriter
from hybrid_offload.backends.disk.segments import SegmentDiskBackend
from hybrid_offload.testing.backend_pages import key, page

_CHILD = """
import os, sys
from hybrid_offload.testing.backend_pages import key, page
from hybrid_offload.backends import BackendConfig, create_backend
from hybrid_offload.backends.disk import segment_writer
root, command, capacity = sys.argv[1], sys.argv[2], int(sys.argv[4])
ids = [int(i) for i in sys.argv[3].split(",")]
options = {"path": root, "layout": "segments"}
backend = create_backend(BackendConfig("disk", "child", capacity, options=options))
if command == "put":
    for i in ids:  # one call per page: interleaves with the other writer
        assert backend.put_batch([(key(i), page(i, 1000))]) == [True]
elif command == "crash":  # die after the page bytes are written, before their records
    segment_writer.SegmentWriter.append_records = lambda *args, **kwargs: os._exit(3)
    backend.put_batch([(key(i), page(i, 1000)) for i in ids])
backend.close()
"""


def run_child(root: Path, command: str, ids: list[int], capacity: int = 1 << 30) -> subprocess.Popen[str]:
    args = [str(root), command, ",".join(map(str, ids)), str(capacity)]
    return subprocess.Popen([sys.executable, "-c", _CHILD, *args], stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], code: int = 0) -> None:
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr


def make(root: Path, capacity: int = 1 << 30, **options: Any) -> SegmentDiskBackend:
    config = BackendConfig(
        "disk", "seg-test", capacity, options={"path": str(root), "layout": "segments", **options}
    )
    backend = create_backend(config)
    assert isinstance(backend, SegmentDiskBackend)
    return backend


def files(root: Path, suffix: str) -> list[Path]:
    return sorted((root / "segments").glob(f"*{suffix}"))


def test_a_batch_is_one_segment_append_and_a_reader_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with make(root) as writer, make(root) as reader:
        assert reader.contains_batch([key(1)]) == [False]
        assert files(root, ".log") == []  # asking does not make a writer
        pages = [(key(i), page(i, 1000 + i)) for i in range(5)]
        assert writer.put_batch(pages) == [True] * 5
        [segment] = files(root, ".seg")
        assert segment.read_bytes() == b"".join(data for _, data in pages)
        assert segment.stat().st_mode & 0o777 == 0o600
        assert (root / "segments").stat().st_mode & 0o777 == 0o700
        assert reader.contains_batch([k for k, _ in pages]) == [True] * 5
        assert len(files(root, ".log")) == 1


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(BackendConfigError, match="'layout'"):
        make(tmp_path, layout="log")
    with pytest.raises(BackendConfigError, match="'segment_mb'"):
        make(tmp_path, segment_mb=0)


def test_two_processes_write_at_once_within_one_capacity(tmp_path: Path) -> None:
    root = tmp_path / "store"
    capacity = 40_000  # 40 pages of 1000 bytes; 2 x 60 are put
    with make(root, capacity) as local:
        a = run_child(root, "put", list(range(0, 60)), capacity)
        b = run_child(root, "put", list(range(100, 160)), capacity)
        finish(a)
        finish(b)
        assert local.used_bytes() <= capacity
        ids = [*range(60), *range(100, 160)]
        got = local.get_batch([key(i) for i in ids])
        held = [data for data in got if data is not None]
        assert sum(map(len, held)) == local.used_bytes() >= capacity - 1000
        assert all(data in (None, page(i, 1000)) for i, data in zip(ids, got, strict=True))
        # whichever child put last: its last page is the most recent one
        assert True in local.contains_batch([key(59), key(159)])


def test_a_crash_before_the_records_leaves_nothing_visible_and_is_adopted(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with make(root) as backend:
        backend.put_batch([(key(1), page(1, 1000))])
        finish(run_child(root, "crash", [2, 3]), code=3)
        assert backend.contains_batch([key(1), key(2), key(3)]) == [True, False, False]
        assert len(files(root, ".log")) == 2  # the dead writer's log, empty
        assert len(files(root, ".seg")) == 2  # its bytes, no record points at them
    with make(root) as restarted:  # a new writer adopts the dead ones and drops unused segments
        restarted.put_batch([(key(4), page(4, 100))])
        assert restarted.get_batch([key(1), key(4)]) == [page(1, 1000), page(4, 100)]
        assert len(files(root, ".log")) == 1
        restarted.delete_batch([key(1)])
        assert len(files(root, ".seg")) == 1  # only the active segment is left


def test_torn_and_damaged_records_are_skipped(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with make(root) as backend:
        backend.put_batch([(key(1), page(1, 100))])
        [log] = files(root, ".log")
        good = log.read_bytes()
    records, used, damaged = decode(good)
    assert [r.key for r in records] == [key(1)] and used == len(good) and not damaged
    extra = encode([Record(PUT, key(2), records[0].ts + 1, records[0].writer, records[0].segment, 0, 100)])
    log.write_bytes(good + extra[:-3])  # torn: the reader waits for the rest
    with make(root) as reader:
        assert reader.contains_batch([key(1), key(2)]) == [True, False]
    log.write_bytes(good + extra[:-1] + bytes([extra[-1] ^ 1]))  # damaged checksum
    with make(root) as reader:
        assert reader.contains_batch([key(1), key(2)]) == [True, False]
    log.write_bytes(good + extra)
    with make(root) as reader:
        assert reader.contains_batch([key(1), key(2)]) == [True, True]  # page 2 aliases page 1's bytes


def test_foreign_and_unsafe_logs_are_not_read(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with make(root) as backend:
        backend.put_batch([(key(1), page(1, 100))])
        [log] = files(root, ".log")
    planted = root / "segments" / "00000000000000ff.log"
    planted.write_bytes(log.read_bytes().replace(key(1).encode(), key(1).encode()))
    planted.chmod(0o666)
    log.unlink()
    os.symlink(planted, root / "segments" / "00000000000000fe.log")
    with make(root) as reader:
        assert reader.contains_batch([key(1)]) == [False]


def test_compaction_keeps_segment_files_bounded(tmp_path: Path) -> None:
    root = tmp_path / "store"
    capacity = 64_000
    with make(root, capacity) as backend:
        latest: dict[int, bytes] = {}
        for step in range(400):
            i = step % 20
            latest[i] = page(step, 2000)
            assert backend.put_batch([(key(i), latest[i])]) == [True]
            on_disk = sum(p.stat().st_size for p in files(root, ".seg"))
            assert on_disk <= 1.25 * capacity + 2 * 16_000 + 2000, step
        assert backend.get_batch([key(i) for i in range(20)]) == [latest[i] for i in range(20)]
    with make(root, capacity) as reopened:
        assert reopened.get_batch([key(i) for i in range(20)]) == [latest[i] for i in range(20)]


def test_a_failed_log_write_refuses_the_batch_and_keeps_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    with make(root) as backend:
        backend.put_batch([(key(1), page(1, 100))])

        def full(self: SegmentWriter, records: list[Record], sync: bool) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(SegmentWriter, "append_records", full)
        assert backend.put_batch([(key(1), page(9, 100)), (key(2), page(2, 100))]) == [False, False]
        assert backend.stats.errors == 1
        assert backend.get_batch([key(1), key(2)]) == [page(1, 100), None]
        monkeypatch.undo()
        assert backend.put_batch([(key(2), page(2, 100))]) == [True]
    with make(root) as reopened:
        assert reopened.get_batch([key(1), key(2)]) == [page(1, 100), page(2, 100)]


def test_cold_reads_go_through_the_pool(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with make(root, segment_mb=1) as backend:
        pages = [(key(i), page(i, 300_000)) for i in range(8)]
        backend.put_batch(pages[:4])
        backend.put_batch(pages[4:])
        for seg in files(root, ".seg"):
            fd = os.open(seg, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        bufs = [memoryview(bytearray(300_000)) for _ in range(8)]
        assert backend.get_into([k for k, _ in reversed(pages)], bufs) == [300_000] * 8
        assert [bytes(b) for b in bufs] == [d for _, d in reversed(pages)]


def test_a_long_log_is_rewritten_and_readers_follow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_segments, "_LOG_ROTATE_BYTES", 4000)
    monkeypatch.setattr(disk_segments, "_TOUCH_BATCH", 8)  # the reader writes its touches too
    root = tmp_path / "store"
    with make(root) as backend, make(root) as reader:
        for step in range(300):  # 10 pages, each put and read many times: records pile up
            i = step % 10
            backend.put_batch([(key(i), page(step, 100))])
            assert backend.get_batch([key(i)]) == [page(step, 100)]
            assert reader.get_batch([key(i)]) == [page(step, 100)]
        logs = files(root, ".log")
        assert len(logs) == 2  # the reader's touches made it a writer
        assert all(log.stat().st_size < 8000 for log in logs)
        want = [page(290 + i, 100) for i in range(10)]
        assert reader.get_batch([key(i) for i in range(10)]) == want
        backend.delete_batch([key(0)])
        assert reader.contains_batch([key(0)]) == [False]
    with make(root) as reopened:
        assert reopened.get_batch([key(i) for i in range(10)]) == [None, *want[1:]]


def test_a_change_made_after_reading_a_record_wins_whatever_the_clocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    with make(root) as ahead, make(root) as behind:
        ahead.put_batch([(key(1), page(1, 100))])
        monkeypatch.setattr(segment_writer.time, "time_ns", lambda: 1)  # a clock far behind
        assert behind.delete_batch([key(1)]) == 1
        assert ahead.contains_batch([key(1)]) == [False]
        behind.put_batch([(key(1), page(2, 100))])
        assert ahead.get_batch([key(1)]) == [page(2, 100)]


def test_reads_in_one_process_keep_pages_from_another_processes_eviction(tmp_path: Path) -> None:
    root = tmp_path / "store"
    k = [key(i) for i in range(6)]
    with make(root, 4000) as a, make(root, 4000) as b:
        a.put_batch([(k[i], page(i, 1000)) for i in range(4)])
        assert b.get_batch([k[0]]) == [page(0, 1000)]  # b's touch, written with b's next change
        b.put_batch([(k[4], page(4, 1000))])  # evicts k1, the least recently used
        a.put_batch([(k[5], page(5, 1000))])  # a has read b's touch of k0: evicts k2
        assert a.contains_batch(k) == [True, False, False, True, True, True]


def rotate(backend: SegmentDiskBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``backend`` go on in a new log now (adopting its old one)."""
    with monkeypatch.context() as patch:
        patch.setattr(disk_segments, "_LOG_ROTATE_BYTES", 0)
        patch.setattr(disk_segments, "_RECORD_BYTES", 0)
        with backend._append_lock:
            backend._rotate_if_long()


def test_deletes_survive_rotations_for_readers_that_missed_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    with make(root, 1000) as other, make(root, 1000) as w, make(root, 1000) as reader:
        other.put_batch([(key(1), page(1, 1000))])
        assert reader.get_batch([key(1)]) == [page(1, 1000)]
        w.put_batch([(key(2), page(2, 1000))])  # evicts other's page: a delete in w's log
        for _ in range(3):  # the logs holding the delete come and go before the reader looks
            rotate(w, monkeypatch)
        assert reader.get_batch([key(1), key(2)]) == [None, page(2, 1000)]
        with make(root, 1000) as fresh:
            assert fresh.contains_batch([key(1), key(2)]) == [False, True]
            assert fresh.used_bytes() == 1000


def test_a_log_that_vanished_is_read_to_its_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    with make(root) as w, make(root) as reader:
        w.put_batch([(key(1), page(1, 100)), (key(2), page(2, 100))])
        assert reader.contains_batch([key(1)]) == [True]
        w.delete_batch([key(1)])  # the reader has not read this record when the log goes
        rotate(w, monkeypatch)
        assert reader.get_batch([key(1), key(2)]) == [None, page(2, 100)]


def test_records_a_reader_applied_stand_when_their_sync_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    with make(root, fsync=True) as w, make(root) as reader:
        w.put_batch([(key(1), page(1, 100))])
        real = os.fdatasync
        armed = [True]

        def flaky(fd: int) -> None:
            if armed[0] and w._writer is not None and fd == w._writer.log_fd:
                armed[0] = False
                reader.contains_batch([key(1)])  # another process reads the appended records now
                raise OSError(errno.EIO, "Input/output error")
            real(fd)

        monkeypatch.setattr(segment_writer.os, "fdatasync", flaky)
        assert w.put_batch([(key(1), page(2, 100))]) == [False]
        assert w.get_batch([key(1)]) == reader.get_batch([key(1)])  # the same view, whichever it is
        w.put_batch([(key(1), page(3, 100))])
        assert reader.get_batch([key(1)]) == [page(3, 100)]
        w.delete_batch([key(1)])
        assert reader.get_batch([key(1)]) == [None]
        assert len(files(root, ".log")) == 1  # the given-up log was adopted


def test_segments_taken_over_twice_are_still_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    with make(root) as backend:
        backend.put_batch([(key(1), page(1, 1000))])
        rotate(backend, monkeypatch)
        backend.put_batch([(key(2), page(2, 1000))])
        rotate(backend, monkeypatch)  # the first log's segment, taken over once, is taken over again
        backend.delete_batch([key(1), key(2)])
        backend.put_batch([(key(3), page(3, 10))])
        assert len(files(root, ".seg")) == 1  # only the active segment


def test_calls_racing_close_raise_closed_and_write_nowhere(tmp_path: Path) -> None:
    root = tmp_path / "store"
    backend = make(root)
    backend.put_batch([(key(1), page(1, 100))])
    entered, release = threading.Event(), threading.Event()
    outcome: list[object] = []
    real_append = SegmentWriter.append_pages

    def slow_append(self: SegmentWriter, views: list[memoryview], limit: int) -> list[tuple[int, int]]:
        entered.set()
        release.wait(10)
        return real_append(self, views, limit)

    def put() -> None:
        try:
            outcome.append(backend.put_batch([(key(2), page(2, 100))]))
        except BackendClosedError as exc:
            outcome.append(exc)

    SegmentWriter.append_pages = slow_append  # type: ignore[method-assign]
    try:
        thread = threading.Thread(target=put)
        thread.start()
        assert entered.wait(10)
        closer = threading.Thread(target=backend.close)
        closer.start()  # waits for the put's append lock
        release.set()
        thread.join(10)
        closer.join(10)
    finally:
        SegmentWriter.append_pages = real_append  # type: ignore[method-assign]
    assert outcome and (outcome[0] == [True] or isinstance(outcome[0], BackendClosedError))
    with pytest.raises(BackendClosedError):
        backend.get_batch([key(1)])
    with make(root) as reopened:
        assert reopened.get_batch([key(1)]) == [page(1, 100)]


def test_reads_from_the_medium_are_cut_into_pieces_for_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs are cut by bytes, also inside a page, where the file offset is a multiple of the
    piece size; short runs share a task; a page is a hit only if all its parts were read."""
    from hybrid_offload.backends.disk.segment_log import Location
    from hybrid_offload.backends.disk.segment_reads import tasks_of as _tasks
    from hybrid_offload.backends.disk.segment_reads import whole_pages as _whole_pages

    monkeypatch.setattr(segment_reads, "MIN_PIECE", 4096)

    def run(offset: int, sizes: list[int], first: int = 0) -> list[Any]:
        jobs, at = [], offset
        for n, size in enumerate(sizes):
            jobs.append((first + n, Location(1, "s.seg", at, "l.log", 1, 1), memoryview(bytearray(size))))
            at += size
        return jobs

    # one run of 5 pages of 3 KiB (15 KiB): 4 pieces of 4 KiB, cut inside pages
    tasks = _tasks([run(0, [3072] * 5)], 4)
    reads = [read for task in tasks for read in task]
    assert [offset for _, offset, _ in reads] == [0, 4096, 8192, 12288]
    assert [sum(v.nbytes for _, v in parts) for _, _, parts in reads] == [4096, 4096, 4096, 3072]
    assert [i for _, _, parts in reads for i, _ in parts] == [0, 1, 1, 2, 2, 3, 4]  # file order
    assert len(tasks) == 4
    # a run starting off a piece boundary is cut at the next one
    reads = [read for task in _tasks([run(1000, [8192])], 2) for read in task]
    assert [(offset, parts[0][1].nbytes) for _, offset, parts in reads] == [
        (1000, 3096),
        (4096, 4096),
        (8192, 1000),
    ]
    # short runs share a task; one thread: one piece per run
    short = [run(i * 65536, [2048], first=i) for i in range(6)]  # pieces of 8 KiB
    assert [len(task) for task in _tasks(short, 2)] == [4, 2]
    assert len(_tasks([run(0, [3072] * 5)], 1)) == 1
    # a page is whole only if every read holding a part of it read that part
    reads = [read for task in _tasks([run(0, [3072] * 5)], 4) for read in task]
    outcomes = [(reads[0], 4096), (reads[1], 2000), (reads[2], 4096), (reads[3], -1)]
    assert sorted(_whole_pages(outcomes)) == [(0, 3072), (3, 3072)]  # 1, 2: short; 4: failed
    outcomes = [(reads[0], 4096), (reads[1], 4096), (reads[2], 4096), (reads[3], 3072)]
    assert sorted(_whole_pages(outcomes)) == [(i, 3072) for i in range(5)]


SEEDS = [int(s) for s in os.environ.get("SEGMENT_FUZZ_SEEDS", "1,2,3,4").split(",")]


def versioned(i: int, version: int, size: int) -> bytes:
    head = f"{i:06d}:{version:06d}:".encode()
    return head + bytes([version % 251]) * (size - len(head))


@pytest.mark.parametrize("seed", SEEDS)
def test_writers_readers_and_a_fresh_process_agree_through_churn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Two writers and a reader in one process (separate instances, as separate processes would
    be) put, delete, rotate, restart and read at random; every instance and a process opened
    afresh must agree on every key, return only its latest bytes, and stay within capacity."""
    rnd, root, capacity, nkeys = random.Random(seed), tmp_path / "store", 64_000, 120
    opened = {"w1": make(root, capacity), "w2": make(root, capacity), "r": make(root, capacity)}
    latest: dict[int, bytes] = {}
    version = 0

    def check() -> None:
        keys = [key(i) for i in range(nkeys)]
        with make(root, capacity) as fresh:
            want = fresh.contains_batch(keys)
            views = {**opened, "fresh": fresh}
            for name, backend in views.items():
                got = backend.get_batch(keys)
                assert backend.contains_batch(keys) == want, name
                for i, data in enumerate(got):
                    assert data is None or data == latest.get(i), (name, i)
                    assert (data is not None) == want[i], (name, i)
                assert backend.used_bytes() == fresh.used_bytes() <= capacity, name

    try:
        for step in range(900):
            op, name = rnd.random(), rnd.choice(["w1", "w2"])
            backend = opened[name]
            if op < 0.6:
                items = []
                for _ in range(rnd.choice([1, 1, 3])):
                    i, version = rnd.randrange(nkeys), version + 1
                    items.append((i, versioned(i, version, rnd.choice([1000, 1000, 3000]))))
                stored = backend.put_batch([(key(i), data) for i, data in items])
                latest.update((i, data) for (i, data), ok in zip(items, stored, strict=True) if ok)
            elif op < 0.7:
                gone = rnd.sample(range(nkeys), 3)
                backend.delete_batch([key(i) for i in gone])
                for i in gone:
                    latest.pop(i, None)
            elif op < 0.75:
                rotate(backend, monkeypatch)
            elif op < 0.78:
                backend.close()
                opened[name] = make(root, capacity)  # a restart: adopted at its first put
            elif op < 0.9:
                opened["r"].contains_batch([key(rnd.randrange(nkeys))])
            else:
                opened[rnd.choice(["w1", "w2", "r"])].get_batch([key(rnd.randrange(nkeys))])
            if step % 300 == 299:
                check()
    finally:
        for backend in opened.values():
            backend.close()
