"""Local-disk page store, segment layout (``layout: segments``): pages appended to large files.

The ``files`` layout (:mod:`.backend`) makes each page a file: right for shared file systems,
but every put is a create, a write and a rename. This layout turns a put batch into one
``pwritev`` and a load into one ``preadv`` per run of pages stored side by side (a load of
4 MiB or more, or what of a smaller one is not in the page cache: cut into pieces, also
inside pages, read at the same time, :mod:`.segment_reads`; ``O_DIRECT`` where the pieces are
aligned and not cached, :mod:`.direct`). Same options as ``disk`` plus ``segment_mb``;
contract beyond :mod:`hybrid_offload.backends.base`:

* **Files.** Under ``<path>/segments/``: each writing process appends page bytes to segment
  files ``<writer>-<n>.seg`` (a new one when ``segment_mb`` is reached) and one record per put,
  touch or delete to its log ``<writer>.log`` (:mod:`.segment_log`, :mod:`.segment_writer`),
  holding an ``flock`` of its log while it lives. A process becomes a writer at its first put or
  delete (or after 4096 touches); one that only asks ``contains_batch`` (vLLM's scheduler) or
  reads never writes. Reads make pages most recent at once in this process; their touch records
  go out with its next change. Files are ``0o600``, the directory ``0o700``; links and other
  users' files are not read. The root is checked as for ``disk``.
* **Index.** Every process reads every log (only what was appended since its last call, after
  one ``fstat`` per log) into the same view (:mod:`.segment_index`), so pages put or deleted
  by other processes show at once (``shared_index = True``). Last writer wins; see
  :mod:`.segment_log`.
* **Atomic pages.** Page bytes are written (and with ``fsync``, synced) before the record that
  makes them visible; a crash leaves bytes no record points at, or one incomplete record at a
  log's end, which readers skip.
* **Capacity and LRU.** Changes to the index (puts, deletes, evictions) are made under an
  ``flock`` of the directory after reading every log, so the pages of all processes together
  stay within ``capacity_bytes`` (each process bounds the total it sees) and least recently
  used pages go first, whichever process put them. ``used_bytes`` is that total.
* **Space.** Replaced, deleted and evicted pages leave garbage in segments. A writer removes its
  segments that hold no page and, when its garbage passes ``max(segment_mb, capacity/4)``,
  copies the pages of its emptiest segment forward (one segment per call) and removes it; so
  segment files stay within about ``1.25 x capacity + 2 segments`` per writer. A new segment's
  blocks are reserved when it is opened (``fallocate``, its size unchanged): appends into them
  are faster. A writer whose process died leaves its log unlocked: the next process to become a
  writer adopts its pages and segments and removes its log.
* **Listing.** ``scan`` lists the view; ``mtime`` is the page's last put.
* **Errors.** An ``OSError`` on a segment or log write refuses that call's pages (counted in
  ``stats.errors``, logged once per errno); after a failed log write the process stops using
  that log (it may end torn, or hold records other processes applied: they stand) and its next
  change starts a new writer, which adopts it. A page whose segment is gone or short is a miss.
  Only an unusable ``<path>/segments`` raises :class:`BackendUnavailableError`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence

from ..base import Backend, BackendConfig, BackendUnavailableError, Buffer, PageInfo
from .direct import DirectReads, read_parts
from .files import NotCachedError, read_while_cached, readinto_exact
from .io_pool import IoPool
from .options import DiskType
from .root import check_writable_root, open_dir_below, page_problem
from .segment_index import SegmentIndex
from .segment_log import DELETE, PUT, TOUCH, Record, SegmentView
from .segment_reads import Job, Read, runs_of, tasks_of, whole_pages
from .segment_writer import SegmentWriter

logger = logging.getLogger(__name__)

__all__ = ["SegmentDiskBackend"]

SEGMENTS_DIR = "segments"
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_ANY_SIZE = 1 << 62
_LOG_ROTATE_BYTES = 8 << 20  # a log is rewritten once past this and 4x what its pages need
_RECORD_BYTES = 100  # about one record
_TOUCH_BATCH = 4096  # pending touches written without waiting for a change

_PARALLEL_BYTES = 4 << 20  # loads of this many bytes are read in parallel pieces from the start
# (measured warm on 2 cores: the calling thread alone was faster below 2-4 MiB, parallel pieces
# 1.15-1.45x faster at 8-16 MiB)


class SegmentDiskBackend(DiskType, Backend):
    """Segment-layout disk store (see the module docstring).

    Locks, always taken in this order: ``_append_lock`` (the writer's segment appends and
    whatever replaces the writer), ``_lock`` (the view and the logs), the directory's ``flock``.
    """

    def __init__(self, config: BackendConfig, *, touch_on_read: bool = True) -> None:
        """Open ``<path>/segments`` (created if missing) and read every log; blocks for it.
        ``touch_on_read=False`` (maintenance tools): gets make nothing recent."""
        super().__init__(config)
        opts = self.validate_options(dict(config.options))
        self._root = os.path.abspath(opts["path"])
        self._fsync: bool = opts["fsync"]
        self._segment_bytes = max(4096, min(opts["segment_mb"] << 20, self.capacity_bytes // 4))
        self._touch_on_read = touch_on_read
        self._lock = threading.RLock()
        self._append_lock = threading.Lock()
        self._writer: SegmentWriter | None = None
        self._pool = IoPool(opts["io_threads"], f"disk-seg-{self.name}", self._check_open)  # reads
        self._logged: set[tuple[str, int | None]] = set()
        self._touched: list[str] = []  # keys made recent whose TOUCH records are not written yet
        self._reads = DirectReads(self.name)  # O_DIRECT where it applies
        check_writable_root(self._root, self.name)
        try:
            dir_fd = open_dir_below(self._root, (SEGMENTS_DIR,), create=True)
        except OSError as exc:
            raise BackendUnavailableError(
                f"disk backend {self.name!r}: cannot open {self._root!r}: {exc}"
            ) from exc
        self._index = SegmentIndex(
            dir_fd, self.capacity_bytes, self.name, lambda op, exc: self._note_error(op, self._root, exc)
        )
        with self._lock:
            self._index.refresh()
            if self._view.index.used > self.capacity_bytes:  # a smaller capacity than last run's
                with contextlib.suppress(OSError):
                    self._change(lambda w: self._evict_records(w, 0, set()))
        logger.info(
            "disk backend %r (segments): %d pages in %s", self.name, len(self._view.index), self._root
        )

    @property
    def _view(self) -> SegmentView:
        return self._index.view

    def _refresh(self) -> None:
        """Read what every log gained (under ``_lock``); BackendClosedError once closed."""
        self._check_open()
        self._index.refresh()

    # -- the writer and its records (under ``_lock``) -----------------------------------------

    def _claim(self) -> SegmentWriter:
        """This process's writer, made (and dead writers adopted) on first use."""
        self._check_open()
        if self._writer is None:
            writer = SegmentWriter(self._index.dir_fd)
            try:
                self._index.add_own(writer)
                with self._index.locked():
                    self._index.adopt_dead(writer, lambda records: self._write_records(writer, records))
            except BaseException:
                writer.close()
                raise
            self._writer = writer
        return self._writer

    def _write_records(self, writer: SegmentWriter, records: list[Record]) -> None:
        """Apply ``records`` to the view, then append them to ``writer``'s log."""
        for record in records:
            self._view.apply(record, writer.log)
        self._commit(writer, records)

    def _commit(self, writer: SegmentWriter, records: list[Record]) -> None:
        """Append ``records``, already applied to the view, to ``writer``'s log. If that fails
        the writer is given up and the view read again from every log, then the error raised."""
        if not records:
            return
        try:
            writer.append_records(records, self._fsync)
        except OSError:
            writer.close()
            if self._writer is writer:
                self._writer = None
            self._index.reload()
            raise
        self._index.wrote(writer)

    def _change(self, build: Callable[[SegmentWriter], list[Record]]) -> None:
        """Under the directory lock, after reading every log: append the pending touches and
        ``build(writer)``'s records (``build`` applies them to the view itself)."""
        with self._lock:
            writer = self._claim()
            with self._index.locked():
                self._commit(writer, self._touch_records(writer) + build(writer))

    def _evict_records(self, writer: SegmentWriter, nbytes: int, keep: set[str]) -> list[Record]:
        victims = self._view.evict_for(
            nbytes, keep, lambda key: Record(DELETE, key, writer.ts(self._view.max_ts)), writer.log
        )
        self.stats.evictions += len(victims)
        self.stats.evicted_bytes += sum(size for _, size in victims)
        return [record for record, _ in victims]

    def _touch_records(self, writer: SegmentWriter) -> list[Record]:
        """The pending touches as records (already applied to the view)."""
        keys, self._touched = self._touched, []
        return [Record(TOUCH, key, writer.ts(self._view.max_ts)) for key in keys if key in self._view.index]

    # -- errors ---------------------------------------------------------------------------

    def _log_once(self, what: str, why: str) -> None:
        if (what, None) not in self._logged:
            self._logged.add((what, None))
            logger.warning("disk backend %r: %s: %s", self.name, what, why)

    # -- puts ---------------------------------------------------------------------------------

    def _put_batch(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        out = [False] * len(items)
        todo: list[tuple[int, str, memoryview]] = []
        for i, (key, buf) in enumerate(items):
            view = memoryview(buf).cast("B")
            if view.nbytes > self.capacity_bytes:
                self.stats.put_refused += 1
            else:
                todo.append((i, key, view))
        if not todo:
            return out
        with self._append_lock:
            try:
                with self._lock:
                    writer = self._claim()
                places = writer.append_pages([v for _, _, v in todo], self._segment_bytes)
                if self._fsync:
                    os.fdatasync(writer.segment_fd)
                with self._lock:
                    self._check_open()
                    with self._index.locked():
                        self._commit(writer, self._put_records(writer, todo, places))
            except OSError as exc:
                self._note_error("put", self._root, exc)
                self.stats.put_refused += len(todo)
                return out
            for i, _, view in todo:
                out[i] = True
                self.stats.puts += 1
                self.stats.put_bytes += view.nbytes
            self._tidy()
        return out

    def _put_records(
        self, writer: SegmentWriter, todo: list[tuple[int, str, memoryview]], places: list[tuple[int, int]]
    ) -> list[Record]:
        records = self._touch_records(writer)
        index = self._view.index
        for (_, key, view), (number, offset) in zip(todo, places, strict=True):
            if index.used + view.nbytes > index.capacity:
                held = index.get(key)
                records += self._evict_records(writer, view.nbytes - (held.size if held else 0), {key})
            record = Record(PUT, key, writer.ts(self._view.max_ts), writer.id, number, offset, view.nbytes)
            self._view.apply(record, writer.log)
            records.append(record)
        return records

    # -- space (under ``_append_lock``) ----------------------------------------------------------

    def _tidy(self) -> None:
        """Remove this writer's segments that hold no page, compact one if garbage passed the
        bound, rewrite the log if it grew far past its pages. Failures are counted, not raised."""
        try:
            writer = self._writer
            if writer is None:
                return
            self._drop_empty_segments(writer)
            self._compact_some(writer)
            self._rotate_if_long()
        except OSError as exc:
            self._note_error("compaction", self._root, exc)

    def _rotate_if_long(self) -> None:
        """Go on in a new log if this one is long, adopting the old one as a dead writer's: only
        its live pages and needed deletes are recorded again, its segments taken over."""
        with self._lock:
            old = self._writer
            if old is None or old.log_end <= max(
                _LOG_ROTATE_BYTES, 4 * _RECORD_BYTES * len(self._view.index)
            ):
                return
            self._check_open()
            old.close()  # its flock released: adopted below, like a dead writer's
            self._writer = None
            self._claim()

    def _compact_some(self, writer: SegmentWriter) -> None:
        with self._lock:
            live = {name: self._view.live.get(name, 0) for name in writer.sizes}
        garbage = sum(writer.sizes.values()) - sum(live.values())
        sealed = [name for name in writer.sizes if name != writer.active]
        if garbage <= max(self._segment_bytes, self.capacity_bytes // 4) or not sealed:
            return
        victim = min(sealed, key=lambda name: live[name] / max(1, writer.sizes[name]))
        self._compact(writer, victim)
        self._drop_empty_segments(writer)

    def _compact(self, writer: SegmentWriter, victim: str) -> None:
        with self._lock:
            held = [(key, self._view.index.get(key)) for key in self._view.keys_in.get(victim, ())]
        pages = [(key, entry) for key, entry in held if entry is not None]
        if not pages:
            return
        fd = os.open(victim, _READ, dir_fd=self._index.dir_fd)
        try:
            views = [memoryview(bytearray(entry.size)) for _, entry in pages]
            for view, (_, entry) in zip(views, pages, strict=True):
                if not readinto_exact(fd, view, offset=entry.value.offset):
                    raise OSError(errno.EIO, f"segment {victim} is shorter than its log says")
        finally:
            os.close(fd)
        places = writer.append_pages(views, self._segment_bytes)
        if self._fsync:
            os.fdatasync(writer.segment_fd)

        def moves(w: SegmentWriter) -> list[Record]:
            if w is not writer:  # replaced since the copies were appended: they stay garbage
                return []
            records = []
            for (key, entry), (number, offset) in zip(pages, places, strict=True):
                now = self._view.index.get(key)
                if now is not None and now.value[:3] == entry.value[:3]:  # not replaced meanwhile
                    record = Record(PUT, key, entry.value.ts, w.id, number, offset, entry.size)
                    self._view.apply(record, w.log)
                    records.append(record)
            return records

        self._change(moves)
        logger.debug("disk backend %r: compacted %s (%d pages moved)", self.name, victim, len(pages))

    def _drop_empty_segments(self, writer: SegmentWriter) -> None:
        with self._lock:
            empty = [n for n in writer.sizes if n != writer.active and n not in self._view.live]
        for name in empty:
            try:
                os.unlink(name, dir_fd=self._index.dir_fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._note_error("remove segment", self._root, exc)
                continue
            del writer.sizes[name]

    # -- gets -----------------------------------------------------------------------------

    def _get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        """Read pages into ``buffers``: while a small load's runs are in the page cache, on this
        thread; the rest (all of a load of ``_PARALLEL_BYTES`` or more) cut into pieces read in
        parallel, one on this thread and the others in the pool (:func:`.segment_reads.tasks_of`)."""
        out: list[int | None] = [None] * len(keys)
        jobs: list[Job] = []
        with self._lock:
            self._refresh()
            index = self._view.index
            for i, (key, buf) in enumerate(zip(keys, buffers, strict=True)):
                entry = index.get(key)
                view = memoryview(buf).cast("B")
                if entry is not None and entry.size <= view.nbytes:
                    jobs.append((i, entry.value, view[: entry.size]))
            runs = runs_of(jobs)
            fds = self._open_segments({run[0][1].segment_file for run in runs})
        try:
            runs = [run for run in runs if fds.get(run[0][1].segment_file) is not None]
            done: list[list[tuple[int, int]]] = []
            if sum(view.nbytes for run in runs for _, _, view in run) < _PARALLEL_BYTES:
                done = read_while_cached(runs, lambda run: self._read_run(fds, run, cached_only=True))
            rest = runs[len(done) :]
            if rest:
                done.append(self._read_tasks(fds, tasks_of(rest, read_parts(self._pool.threads))))
        finally:
            for fd in fds.values():
                if fd is not None:
                    os.close(fd)
        for hits in done:
            for i, size in hits:
                out[i] = size
        hit_keys = [keys[i] for i in range(len(keys)) if out[i] is not None]
        self.stats.gets += len(keys)
        self.stats.hits += len(hit_keys)
        self.stats.get_bytes += sum(n for n in out if n is not None)
        if hit_keys and self._touch_on_read:
            self._touch(hit_keys)
        return out

    def _read_tasks(self, fds: dict[str, int | None], tasks: list[list[Read]]) -> list[tuple[int, int]]:
        """Read ``tasks``: the first on this thread, the others in the pool at the same time
        (every one finished before this returns: the caller closes ``fds`` and owns the
        buffers); (index, size) of each page read whole."""
        results = self._pool.run_parts(lambda task: self._read_task(fds, task), tasks)
        return whole_pages([outcome for result in results for outcome in result])

    def _read_task(self, fds: dict[str, int | None], task: list[Read]) -> list[tuple[Read, int]]:
        """Read each (segment, offset, parts) of ``task``; with the bytes read of each (-1: failed)."""
        out = []
        for read in task:
            name, offset, parts = read
            fd = fds[name]
            assert fd is not None
            try:
                got = self._reads.read(fd, [view for _, view in parts], offset)
            except OSError as exc:
                self._note_error("read", self._root, exc)
                got = -1
            out.append((read, got))
        return out

    def _open_segments(self, names: set[str]) -> dict[str, int | None]:
        """A read descriptor per segment file (under ``_lock``); None for one gone since the lookup
        (compacted or removed: its pages are misses) or not to be trusted."""
        fds: dict[str, int | None] = {}
        for name in names:
            fds[name] = None
            try:
                fd = os.open(name, _READ, dir_fd=self._index.dir_fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                self._note_error("open segment", self._root, exc)
                continue
            problem = page_problem(os.fstat(fd), _ANY_SIZE)
            if problem is not None:
                os.close(fd)
                self._log_once(f"segment {name}", problem)
                continue
            fds[name] = fd
        return fds

    def _read_run(
        self, fds: dict[str, int | None], run: list[Job], cached_only: bool = False
    ) -> list[tuple[int, int]]:
        """Read one run of pages stored side by side; (index, size) of each page read whole.
        ``cached_only``: raise NotCachedError rather than wait for the medium."""
        fd = fds[run[0][1].segment_file]
        assert fd is not None
        try:
            got = self._reads.read(
                fd, [view for _, _, view in run], run[0][1].offset, cached_only=cached_only
            )
        except NotCachedError:
            raise
        except OSError as exc:
            self._note_error("read", self._root, exc)
            return []
        out, end = [], 0
        for i, _, view in run:
            end += view.nbytes
            if end > got:
                break
            out.append((i, view.nbytes))
        return out

    def _get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            self._refresh()
            sizes = [self._view.index.get(key) for key in keys]
        buffers = [memoryview(bytearray(0 if e is None else e.size)) for e in sizes]
        got = self._get_into(keys, buffers)
        return [None if n is None else bytes(buf[:n]) for n, buf in zip(got, buffers, strict=True)]

    # -- the rest of the contract ---------------------------------------------------------------

    def _touch(self, keys: Sequence[str]) -> None:
        """Make held ``keys`` most recent here at once; their records wait for this process's
        next change (loads never write the log) or until ``_TOUCH_BATCH`` are pending."""
        with self._lock:
            self._check_open()
            index = self._view.index
            self._touched += [key for key in keys if index.touch(key) is not None]
            if len(self._touched) < _TOUCH_BATCH:
                return
            try:
                writer = self._claim()
                self._commit(writer, self._touch_records(writer))
            except OSError as exc:
                self._note_error("touch", self._root, exc)
                return
        if self._append_lock.acquire(blocking=False):  # else a put holds it and rotates
            try:
                self._rotate_if_long()
            except OSError as exc:
                self._note_error("touch", self._root, exc)
            finally:
                self._append_lock.release()

    def _touch_batch(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._refresh()
            self._touch(keys)

    def _contains_batch(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            self._refresh()
            return [key in self._view.index for key in keys]

    def _delete_batch(self, keys: Sequence[str]) -> int:
        count = 0

        def deletes(writer: SegmentWriter) -> list[Record]:
            nonlocal count
            records = []
            for key in dict.fromkeys(keys):
                if key in self._view.index:
                    record = Record(DELETE, key, writer.ts(self._view.max_ts))
                    self._view.apply(record, writer.log)
                    records.append(record)
            count = len(records)
            return records

        try:
            self._change(deletes)
        except OSError as exc:
            self._note_error("delete", self._root, exc)
            raise BackendUnavailableError(f"disk backend {self.name!r}: delete failed: {exc}") from exc
        with self._append_lock:
            if self._writer is not None:
                self._drop_empty_segments(self._writer)
        return count

    def _used_bytes(self) -> int:
        with self._lock:
            self._refresh()
            return self._view.index.used

    def _scan(self, prefix: str) -> Iterator[PageInfo]:
        with self._lock:
            self._refresh()
            items = [(key, self._view.index.get(key)) for key in self._view.index if key.startswith(prefix)]
        for key, entry in items:
            if entry is not None:
                yield PageInfo(key, entry.size, entry.value.ts / 1e9)

    def _close(self) -> None:
        with self._append_lock, self._lock:
            self._pool.close()  # reads in flight hold no lock
            writer = self._writer
            if writer is not None and self._touched:
                with contextlib.suppress(OSError):
                    self._commit(writer, self._touch_records(writer))
            if writer is not None:
                writer.close()
            for name in list(self._index.tails):
                self._index.tails.pop(name).close()
            with contextlib.suppress(OSError):
                os.close(self._index.dir_fd)
