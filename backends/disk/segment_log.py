"""The segment disk layout's logs and the page index every process rebuilds from them.

Each writing process appends page bytes to segment files of its own and one record per change
to its own log (``<writer>.log``); every process sharing the directory reads every log and
keeps the same :class:`SegmentView`. This module holds the record format, the tail reader and
the view; :mod:`.segments` holds the backend that writes them.

* **Record**: ``kind`` (put, touch, delete), ``ts`` (ns: the wall clock, but later than every
  record its writer has read, so a change made after reading a record wins over it whatever
  the clocks say), the segment (``writer`` id, number), ``offset``, ``length`` and the
  key, then a CRC-32 of all of it. A log is read up to its first incomplete or damaged record
  (a crash mid-append leaves at most one; a writer whose append fails stops using the log).
* **Resolution** (last writer wins, whatever order the logs are read in): a key's page is its
  put with the largest ``ts`` not older than the key's newest delete; a put with the same
  ``ts`` as the held one moves it (compaction, adoption) without changing its recency. A touch
  makes a held key most recent. The LRU order is the order this process learned of puts and
  touches (after a fresh read: timestamp order): exact for one writer, close across writers.
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from ..lru_index import LruIndex

__all__ = ["DELETE", "PUT", "TOUCH", "Location", "LogTail", "Record", "SegmentView", "Tombstone", "encode"]

PUT, TOUCH, DELETE = 1, 2, 3
_HEAD = struct.Struct("<BBxxIQQQQ")  # kind, key length, segment number, writer, ts, offset, length
_CRC = struct.Struct("<I")
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class Record(NamedTuple):
    kind: int
    key: str
    ts: int
    writer: int = 0
    segment: int = 0
    offset: int = 0
    length: int = 0


def encode(records: Iterable[Record]) -> bytes:
    out = bytearray()
    for r in records:
        key = r.key.encode("ascii")
        body = _HEAD.pack(r.kind, len(key), r.segment, r.writer, r.ts, r.offset, r.length) + key
        out += body
        out += _CRC.pack(zlib.crc32(body))
    return bytes(out)


def decode(buf: bytes | memoryview) -> tuple[list[Record], int, bool]:
    """The whole records at the start of ``buf``, the bytes they take, and whether reading
    stopped at a damaged record (not merely an incomplete tail)."""
    records: list[Record] = []
    pos, end = 0, len(buf)
    while pos + _HEAD.size <= end:
        kind, klen, segment, writer, ts, offset, length = _HEAD.unpack_from(buf, pos)
        stop = pos + _HEAD.size + klen + _CRC.size
        if stop > end:
            break
        body = bytes(buf[pos : stop - _CRC.size])
        if kind not in (PUT, TOUCH, DELETE) or _CRC.unpack_from(buf, stop - _CRC.size)[0] != zlib.crc32(body):
            return records, pos, True
        records.append(Record(kind, body[_HEAD.size :].decode("ascii"), ts, writer, segment, offset, length))
        pos = stop
    return records, pos, False


def segment_name(writer: int, number: int) -> str:
    return f"{writer:016x}-{number:08d}.seg"


def log_name(writer: int) -> str:
    return f"{writer:016x}.log"


class LogTail:
    """Reads one log incrementally: :meth:`read_new` returns the records appended since the last
    call. Opened with ``O_NOFOLLOW``; a log that is not a regular file of this uid, not writable by
    others, reads as empty (``problem`` says why)."""

    def __init__(self, dir_fd: int, name: str) -> None:
        self.name = name
        self.position = 0
        self.damaged = False
        self.problem: str | None = None
        self._fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            self.problem = "not a regular file of this user"
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            self.problem = "writable by group or others"

    def read_new(self) -> list[Record]:
        if self.problem is not None or self.damaged:
            return []
        size = os.fstat(self._fd).st_size
        if size <= self.position:
            return []
        buf = os.pread(self._fd, size - self.position, self.position)
        records, used, self.damaged = decode(buf)
        self.position += used
        return records

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


class Location(NamedTuple):
    ts: int  # the put's ts: its version
    segment_file: str  # the segment file's name
    offset: int
    log: str  # the log the put was read from (its writer adopts it)
    writer: int  # the segment's writer id and number, as recorded
    segment: int
    older: frozenset[str] = frozenset()  # other logs holding older puts of the key


@dataclass
class Tombstone:
    """A key's newest delete: ``ts``, the log holding it (``source``), and the logs holding puts
    it hides (while one of them exists, a process reading them afresh needs the delete)."""

    ts: int
    source: str
    hides: set[str] = field(default_factory=set)
    seen_in_pass: int = 0


class SegmentView:
    """The pages every log together describes: key -> :class:`Location`, in LRU order, with the
    live bytes per segment file (what compaction reclaims) and the deletes still needed."""

    def __init__(self, capacity: int) -> None:
        self.index: LruIndex[Location] = LruIndex(capacity)
        self.tombstones: dict[str, Tombstone] = {}
        self.live: dict[str, int] = {}  # segment file -> bytes of the pages held there
        self.keys_in: dict[str, set[str]] = {}  # segment file -> keys held there
        self.max_ts = 0  # the newest record applied: a writer's next ts is later (a Lamport clock)
        self.passes = 0  # complete reads of every log (see :meth:`prune`)
        self.logs: set[str] = set()  # the logs being read

    def _hold(self, key: str, size: int, loc: Location, *, keep_recency: bool) -> None:
        old = self.index.get(key)
        if old is not None:
            self._forget(key, old.size, old.value)
        if keep_recency and old is not None:
            self.index.relocate(key, size, loc)
        else:
            self.index.insert(key, size, loc)
        name = loc.segment_file
        self.live[name] = self.live.get(name, 0) + size
        self.keys_in.setdefault(name, set()).add(key)

    def _forget(self, key: str, size: int, loc: Location) -> None:
        name = loc.segment_file
        self.live[name] -= size
        keys = self.keys_in[name]
        keys.discard(key)
        if not keys:
            del self.keys_in[name], self.live[name]

    def apply(self, record: Record, log: str) -> bool:
        """Apply one record read from ``log``; whether it changed which page a key has."""
        key = record.key
        self.max_ts = max(self.max_ts, record.ts)
        if record.kind == TOUCH:
            self.index.touch(key)
            return False
        held = self.index.get(key)
        tomb = self.tombstones.get(key)
        if record.kind == DELETE:
            if held is not None and held.value.ts < record.ts:
                self._bury(key, record.ts, log, held.value)
                self.remove(key)
                return True
            self._bury(key, record.ts, log, None)
            return False
        if tomb is not None and record.ts <= tomb.ts:
            tomb.hides.add(log)
            return False
        if held is not None and held.value.ts > record.ts:
            if log != held.value.log and log not in held.value.older:  # an older put elsewhere
                self.index.relocate(key, held.size, held.value._replace(older=held.value.older | {log}))
            return False
        older: frozenset[str] = frozenset()
        if held is not None:
            older = held.value.older if held.value.log == log else held.value.older | {held.value.log}
        name = segment_name(record.writer, record.segment)
        loc = Location(record.ts, name, record.offset, log, record.writer, record.segment, older - {log})
        self._hold(key, record.length, loc, keep_recency=held is not None and held.value.ts == record.ts)
        return True

    def _bury(self, key: str, ts: int, source: str, hidden: Location | None) -> None:
        """Note a delete of ``key`` at ``ts`` recorded in ``source``, hiding the put ``hidden``."""
        tomb = self.tombstones.get(key)
        if tomb is None or ts >= tomb.ts:  # the same ts: the delete recorded again (adoption)
            hides = set() if tomb is None else tomb.hides  # what the older delete hid, this hides
            tomb = self.tombstones[key] = Tombstone(ts, source, hides, self.passes)
        if hidden is not None:
            tomb.hides |= (hidden.older | {hidden.log}) & self.logs

    def remove(self, key: str) -> Location | None:
        entry = self.index.remove(key)
        if entry is None:
            return None
        self._forget(key, entry.size, entry.value)
        return entry.value

    def evict_for(
        self, nbytes: int, keep: set[str], delete: Callable[[str], Record], log: str
    ) -> list[tuple[Record, int]]:
        """Remove least recently used pages (none in ``keep``) until ``nbytes`` more fit, each with
        the delete record ``delete(key)`` makes, to be appended to ``log`` (its tombstone noted
        here); (record, size) of each."""
        out = []
        for entry in self.index.make_room(nbytes, lambda e: e.key not in keep):
            self._forget(entry.key, entry.size, entry.value)
            record = delete(entry.key)
            self.max_ts = max(self.max_ts, record.ts)
            self._bury(entry.key, record.ts, log, entry.value)
            out.append((record, entry.size))
        return out

    def owned_by(self, log: str) -> list[tuple[str, int, Location]]:
        """(key, size, location) of the pages whose put was read from ``log``, least recent first."""
        out = []
        for key in self.index.ordered():
            entry = self.index.get(key)
            if entry is not None and entry.value.log == log:
                out.append((key, entry.size, entry.value))
        return out

    def deletes_to_keep(self, log: str) -> list[tuple[str, int]]:
        """(key, ts) of the deletes recorded in ``log`` that hide puts of other logs: what an
        adopter of ``log`` records again."""
        return [
            (key, tomb.ts)
            for key, tomb in self.tombstones.items()
            if tomb.source == log and tomb.hides - {log}
        ]

    def log_gone(self, log: str) -> None:
        """``log`` was removed (read to its end first): the puts it held need no delete now."""
        self.logs.discard(log)
        for tomb in self.tombstones.values():
            tomb.hides.discard(log)

    def prune(self) -> None:
        """Forget deletes that hide nothing, once every log was read twice after them (a put
        older than a delete can be read one pass after it, from a log read earlier in a pass)."""
        self.tombstones = {
            key: tomb
            for key, tomb in self.tombstones.items()
            if tomb.hides or tomb.seen_in_pass + 2 > self.passes
        }
