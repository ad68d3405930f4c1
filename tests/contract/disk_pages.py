"""Helpers shared by the disk backend tests: open a disk backend, find a page's file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybrid_offload.backends import BackendConfig, create_backend
from hybrid_offload.backends.disk import DiskBackend


def make_disk(root: Path | str, capacity: int = 1 << 30, **options: Any) -> DiskBackend:
    config = BackendConfig("disk", "disk-test", capacity, options={"path": str(root), **options})
    backend = create_backend(config)
    assert isinstance(backend, DiskBackend)
    return backend


def page_path(root: Path, k: str) -> Path:
    """The file of page ``k`` under ``root`` (the layout in ``backends/disk/backend.py``)."""
    namespace, digest = k.split("-")
    return root / namespace / digest[:2] / f"{digest}.page"
