"""``disk`` backend: pages on a local (or shared) file system, one capacity and LRU for every
process using the same ``path``; two layouts, chosen by the ``layout`` option.

* :mod:`.backend` - :class:`DiskBackend`, registered as backend type ``disk``: the ``files``
  layout (one file per page), and the class that hands ``layout: segments`` to :mod:`.segments`.
* :mod:`.segments` - :class:`~.segments.SegmentDiskBackend`, the ``segments`` layout (pages
  appended to large segment files); its logs and view in :mod:`.segment_log`, one writing
  process's files in :mod:`.segment_writer`, the shared index over every log in
  :mod:`.segment_index`, how a load is cut into parallel reads in :mod:`.segment_reads`.
* :mod:`.options` - the options of both layouts and their validation (:class:`~.options.DiskType`).
* :mod:`.root` - the trusted root directory; :mod:`.tree` - where a page file lives and how the
  tree is walked; :mod:`.files` - page files opened below the root without following links,
  read, stamped; :mod:`.usage` - the shared usage record (one capacity across processes).
* :mod:`.direct` - ``O_DIRECT`` reads where they apply; :mod:`.io_pool` - the I/O threads
  that batches and large loads are spread over.
"""

from __future__ import annotations

from .backend import DiskBackend

__all__ = ["DiskBackend"]
