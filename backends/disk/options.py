"""Options of the disk backend, both layouts: defaults and validation (errors name the key).

Options (defaults): ``path`` (required: a directory; ``~`` and ``$XDG_CACHE_HOME`` expanded,
see :mod:`.root`), ``fsync`` (false), ``io_threads`` (4), ``layout`` (``files``: one file
per page, :mod:`.backend`; ``segments``: pages appended to segment files, :mod:`.segments`),
``segment_mb`` (64; segments only).

Pure: checks, never touches the file system.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, ClassVar

from ..base import BackendConfigError
from .root import expand_path

__all__ = ["DISK_OPTION_DEFAULTS", "DiskType", "check_disk_options"]

logger = logging.getLogger("hybrid_offload.backends.disk")

DISK_OPTION_DEFAULTS: dict[str, Any] = {
    "path": None,
    "fsync": False,
    "io_threads": 4,
    "layout": "files",
    "segment_mb": 64,
}


def check_disk_options(opts: dict[str, Any]) -> dict[str, Any]:
    """``opts`` (defaults filled in, no unknown key) checked, ``path`` expanded."""
    path = opts["path"]
    path = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(path, str) or not path:
        raise BackendConfigError(
            f"backend type 'disk': option 'path' is required (a directory), got {path!r}"
        )
    if not isinstance(opts["fsync"], bool):
        raise BackendConfigError(
            f"backend type 'disk': option 'fsync' must be true or false, got {opts['fsync']!r}"
        )
    for name in ("io_threads", "segment_mb"):
        value = opts[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BackendConfigError(
                f"backend type 'disk': option {name!r} must be an integer >= 1, got {value!r}"
            )
    if opts["layout"] not in ("files", "segments"):
        raise BackendConfigError(
            f"backend type 'disk': option 'layout' must be 'files' or 'segments', got {opts['layout']!r}"
        )
    return {**opts, "path": expand_path(path)}


class DiskType:
    """What both disk layouts' classes share as backend type ``disk`` (a mixin before
    :class:`.base.Backend`): the type's class attributes, its options and how an ``OSError``
    is counted and logged (the subclass sets ``_logged = set()``)."""

    _errors_lock: ClassVar[threading.Lock] = threading.Lock()
    _logged: set[tuple[str, int | None]]

    type_name: ClassVar[str] = "disk"
    shared_index: ClassVar[bool] = True
    hit_source: ClassVar[str] = "disk"
    touch_refreshes: ClassVar[bool] = True
    option_defaults: ClassVar[dict[str, Any]] = DISK_OPTION_DEFAULTS

    @classmethod
    def validate_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        return check_disk_options(super().validate_options(options))  # type: ignore[misc]

    def _note_error(self, op: str, where: str, exc: OSError) -> None:
        """Count an ``OSError`` in ``stats.errors``; log it at warning level once per
        (operation, errno), then at debug level."""
        with self._errors_lock:
            self.stats.errors += 1  # type: ignore[attr-defined]
            first = (op, exc.errno) not in self._logged
            self._logged.add((op, exc.errno))
        log = logger.warning if first else logger.debug
        log("disk backend %r: %s of %s failed: %s", self.name, op, where, exc)  # type: ignore[attr-defined]
