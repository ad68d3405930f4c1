"""The segment layout's shared index: every log of the directory read into one view, the lock
under which changes are decided, and the adoption of writers that are gone.

* **Reading.** :meth:`SegmentIndex.refresh` reads what each log gained since the last call
  (one ``fstat`` per log). The directory is listed again when its ``(mtime, inode)`` changed, or
  while the last listing was less than 2 s after the directory's mtime: two changes within one
  tick of a coarse file-system clock leave the same mtime, and a listing made 2 s later sees
  both. When the set of logs changed (a writer came, a log was rotated or adopted) the view is
  read afresh from the current logs: a log that came and went between two listings was never
  read here, and what replaced it holds only what is still live.
* **Deciding.** :meth:`SegmentIndex.locked` holds an ``flock`` of the directory, after a
  refresh: puts, deletes, evictions and adoptions are made there, so every process decides on
  the same view.
* **Adoption.** A log whose ``flock`` is free belongs to a writer that is gone; an adopter
  records again its live pages (same timestamps: recency and versions kept) and the deletes it
  holds that still hide puts of other logs, takes over its segments (its own and those its
  pages point into), then removes it; segments holding no page whose writer has no log are
  removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator

from ..base import BackendUnavailableError
from .segment_log import DELETE, PUT, LogTail, Record, SegmentView
from .segment_writer import SegmentWriter

__all__ = ["SegmentIndex"]

logger = logging.getLogger(__name__)

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_RECENT_NS = 2_000_000_000
_NEW_LOG_GRACE_S = 60
_PRUNE_EVERY = 64  # passes between prunes of deletes that hide nothing


class SegmentIndex:
    """The view of every log of one segments directory (not thread-safe: the backend calls it
    under its lock). ``OSError``s met while reading logs go to ``on_error(operation, error)``
    (they read as an empty log)."""

    def __init__(
        self, dir_fd: int, capacity: int, name: str, on_error: Callable[[str, OSError], None]
    ) -> None:
        self.dir_fd = dir_fd
        self.view = SegmentView(capacity)
        self.tails: dict[str, LogTail] = {}
        self._on_error = on_error
        self._capacity = capacity
        self._name = name
        self._stamp: tuple[int, int] | None = None
        self._listed_at = 0
        self._warned: set[str] = set()

    def refresh(self) -> None:
        """Read what every log gained since the last call."""
        try:
            st = os.fstat(self.dir_fd)
            stamp, now = (st.st_mtime_ns, st.st_ino), time.time_ns()
            if stamp != self._stamp or self._listed_at - st.st_mtime_ns < _RECENT_NS:
                self._stamp, self._listed_at = stamp, now
                names = {n for n in os.listdir(self.dir_fd) if n.endswith(".log")}
            else:
                names = None
        except OSError as exc:
            raise BackendUnavailableError(f"disk backend {self._name!r}: segments directory: {exc}") from exc
        if names is not None and names != set(self.tails):
            self._start_over(names)
        for name, tail in self.tails.items():
            self._read(name, tail)
        self.view.passes += 1
        if self.view.passes % _PRUNE_EVERY == 0:
            self.view.prune()

    def _read(self, name: str, tail: LogTail) -> None:
        for record in self._new_records(name, tail):
            self.view.apply(record, name)

    def _new_records(self, name: str, tail: LogTail) -> list[Record]:
        try:
            records = tail.read_new()
        except OSError as exc:
            self._on_error("read log", exc)
            return []
        if (tail.problem is not None or tail.damaged) and name not in self._warned:
            self._warned.add(name)
            why = tail.problem or "a damaged record: read up to it"
            logger.warning("disk backend %r: log %s: %s", self._name, name, why)
        return records

    def drop(self, name: str) -> None:
        tail = self.tails.pop(name, None)
        if tail is not None:
            tail.close()
        self.view.log_gone(name)

    def _start_over(self, names: set[str]) -> None:
        """Forget everything read and read the logs ``names`` from their start.

        Done whenever the set of logs changed: a log that came and went between two listings
        (a rotation, an adoption) was never read here, and the logs that replace it hold only
        what is still live, so only a view read afresh from the current logs is right."""
        for name in list(self.tails):
            self.tails.pop(name).close()
        self.view = SegmentView(self._capacity)
        for name in sorted(names):
            try:
                self.tails[name] = LogTail(self.dir_fd, name)
                self.view.logs.add(name)
            except OSError as exc:
                self._on_error("open log", exc)
        # every record in timestamp order (stable: a log's records with one timestamp, a put
        # and its moves, keep their order), so recency across writers is the order of events
        records = [(r, name) for name, tail in self.tails.items() for r in self._new_records(name, tail)]
        records.sort(key=lambda item: item[0].ts)
        for record, name in records:
            self.view.apply(record, name)

    def reload(self) -> None:
        """Forget everything read and read every log again from its start."""
        self._start_over(set())
        self._stamp = None
        self.refresh()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The directory's ``flock`` held, after a refresh."""
        fcntl.flock(self.dir_fd, fcntl.LOCK_EX)
        try:
            self.refresh()
            yield
        finally:
            fcntl.flock(self.dir_fd, fcntl.LOCK_UN)

    def add_own(self, writer: SegmentWriter) -> None:
        """Read ``writer``'s log like any other (its appends move the tail: see :meth:`wrote`)."""
        self.tails[writer.log] = LogTail(self.dir_fd, writer.log)
        self.view.logs.add(writer.log)

    def wrote(self, writer: SegmentWriter) -> None:
        """``writer`` appended records it already applied: skip them when reading its log."""
        self.tails[writer.log].position = writer.log_end

    # -- adoption (under :meth:`locked`) -------------------------------------------------

    def adopt_dead(self, writer: SegmentWriter, write: Callable[[list[Record]], None]) -> int:
        """Adopt every log whose writer is gone into ``writer`` (``write`` applies and appends
        records); the pages adopted."""
        adopted = 0
        for name in [n for n in self.tails if n != writer.log]:
            try:
                fd = os.open(name, _READ, dir_fd=self.dir_fd)
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its writer lives
                adopted += self._adopt(name, writer, write)
            finally:
                os.close(fd)
        self._adopt_orphans(writer)
        return adopted

    def _adopt(self, name: str, writer: SegmentWriter, write: Callable[[list[Record]], None]) -> int:
        pages = self.view.owned_by(name)
        records = [
            Record(PUT, key, loc.ts, loc.writer, loc.segment, loc.offset, size) for key, size, loc in pages
        ]
        records += [Record(DELETE, key, ts) for key, ts in self.view.deletes_to_keep(name)]
        write(records)
        for _, _, loc in pages:
            self._own(writer, loc.segment_file)
        dead_id = name.removesuffix(".log")
        for seg in self._segment_files():
            if seg.startswith(dead_id + "-"):
                self._own(writer, seg)
        os.unlink(name, dir_fd=self.dir_fd)
        self.drop(name)
        logger.info("disk backend %r: adopted %d pages of a writer gone (%s)", self._name, len(pages), name)
        return len(pages)

    def _adopt_orphans(self, writer: SegmentWriter) -> None:
        """Remove segments that hold no page and whose writer has no log (left by an adopter that
        is gone too; a segment holding pages belongs to the writer that recorded them), and
        ``.new`` logs of writers that died while being made (a minute old, unlocked)."""
        with_logs = {n.removesuffix(".log") for n in self.tails}
        for seg in self._segment_files():
            if (
                seg.split("-", 1)[0] not in with_logs
                and seg not in self.view.live
                and seg not in writer.sizes
            ):
                with contextlib.suppress(OSError):
                    os.unlink(seg, dir_fd=self.dir_fd)
        with contextlib.suppress(OSError):
            for name in os.listdir(self.dir_fd):
                if name.endswith(".new") and name.removesuffix(".new") not in with_logs:
                    self._remove_if_unlocked(name)

    def _remove_if_unlocked(self, name: str) -> None:
        try:
            fd = os.open(name, _READ, dir_fd=self.dir_fd)
        except OSError:
            return
        try:
            if time.time() - os.fstat(fd).st_mtime < _NEW_LOG_GRACE_S:
                return  # being made right now (locked, then renamed, within microseconds)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(name, dir_fd=self.dir_fd)
        except OSError:
            pass  # being made right now
        finally:
            os.close(fd)

    def _segment_files(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.dir_fd) if n.endswith(".seg")]
        except OSError as exc:
            self._on_error("list segments", exc)
            return []

    def _own(self, writer: SegmentWriter, seg: str) -> None:
        if seg in writer.sizes:
            return
        with contextlib.suppress(OSError):
            writer.sizes[seg] = os.stat(seg, dir_fd=self.dir_fd, follow_symlinks=False).st_size
