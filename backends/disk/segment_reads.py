"""How the segment layout reads a load: pages stored back to back grouped into runs, runs cut
into pieces of about equal size, pieces grouped into tasks for the I/O threads.

Pure: plans and outcomes only; :mod:`.segments` opens the segments, reads each task (the first
on the calling thread, the others in :class:`~.io_pool.IoPool`) and counts the pages read whole.
"""

from __future__ import annotations

from .direct import ALIGN
from .segment_log import Location

__all__ = ["MIN_PIECE", "Job", "Read", "runs_of", "tasks_of", "whole_pages"]

MIN_PIECE = 512 << 10  # smaller reads are not cut further

Job = tuple[int, Location, memoryview]  # (index in the call, where the page is, its buffer)
#: (segment file, file offset, (index in the call, the part of its buffer) back to back)
Read = tuple[str, int, list[tuple[int, memoryview]]]


def runs_of(jobs: list[Job]) -> list[list[Job]]:
    """Jobs grouped into runs of pages stored back to back in one segment, in file order."""
    runs: list[list[Job]] = []
    for job in sorted(jobs, key=lambda j: (j[1].segment_file, j[1].offset)):
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and last[1].segment_file == job[1].segment_file
            and last[1].offset + last[2].nbytes == job[1].offset
        ):
            runs[-1].append(job)
        else:
            runs.append([job])
    return runs


def tasks_of(runs: list[list[Job]], parts: int) -> list[list[Read]]:
    """``runs`` as reads of about ``total / parts`` bytes (at least :data:`MIN_PIECE`) grouped into
    tasks of about that size, in file order: a device serves several large reads in flight
    faster than one long one, and two cores copy cached pages faster than one. Reads are cut
    where the file offset is a multiple of the piece size, also inside a page (so a run that
    starts aligned is read in aligned pieces); runs shorter than a piece share a task."""
    total = sum(view.nbytes for run in runs for _, _, view in run)
    size = max(MIN_PIECE, -(-total // max(1, parts)))
    size = -(-size // ALIGN) * ALIGN
    reads: list[Read] = []
    for run in runs:
        name, start = run[0][1].segment_file, run[0][1].offset
        at, end = start, (start // size + 1) * size
        pieces: list[tuple[int, memoryview]] = []
        for i, _, view in run:
            pos = 0
            while pos < view.nbytes:
                take = min(view.nbytes - pos, end - at)
                pieces.append((i, view[pos : pos + take]))
                pos += take
                at += take
                if at == end:
                    reads.append((name, start, pieces))
                    pieces, start, end = [], at, at + size
        if pieces:
            reads.append((name, start, pieces))
    tasks: list[list[Read]] = []
    held = size
    for read in reads:
        if held >= size:
            tasks.append([])
            held = 0
        tasks[-1].append(read)
        held += sum(view.nbytes for _, view in read[2])
    return tasks


def whole_pages(outcomes: list[tuple[Read, int]]) -> list[tuple[int, int]]:
    """(index, size) of each page all of whose parts were read, from each read's outcome (the
    bytes read, -1 if it failed)."""
    sizes: dict[int, int] = {}
    failed: set[int] = set()
    for (_, _, parts), got in outcomes:
        end = 0
        for i, view in parts:
            end += view.nbytes
            sizes[i] = sizes.get(i, 0) + view.nbytes
            if got < end:
                failed.add(i)
    return [(i, size) for i, size in sizes.items() if i not in failed]
