"""Helpers for the fault matrix's disk and concurrency cells (importable as ``disk_faults``).

Prompts: ``DOCS`` documents of 3 connector chunks + 4 tokens, each followed by its own
29-token question, so every prompt stores exactly one page per chunk of each attention group
and one state page per Mamba group, and shares nothing with the other prompts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from engine_runs import CHUNK_TOKENS, VOCAB

from hybrid_offload.core.model_card import CARD_DIGEST
from hybrid_offload.core.page_format import PageFormatError, decode_page, encode_page
from hybrid_offload.testing.session import ENGINE_ENV

ARCH = "falcon_h1"  # one attention group + one Mamba group
CHUNK = CHUNK_TOKENS[ARCH]
DOCS = 6
#: 3 attention chunks in 2 shards (its 2 KV heads) + the Mamba state in 8 shards (8 heads;
#: the connector's default tp_shards is 8)
PAGES_PER_PROMPT = 3 * 2 + 8


def documents(n: int = DOCS, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(3 * CHUNK + 4 + 29)] for _ in range(n)]


def disk_backend(path: Path, name: str = "disk", **extra: Any) -> dict[str, Any]:
    return {"type": "disk", "name": name, "path": str(path), "capacity_bytes": "1GiB", **extra}


def page_files(root: Path) -> list[Path]:
    """Page files under a disk backend's root, oldest write first (the order they were stored);
    the engine's model card (``hybrid_offload.core.model_card``) is not a page."""
    pages = [p for p in root.rglob("*.page") if p.name != f"{CARD_DIGEST}.page"]
    return sorted(pages, key=lambda p: p.lstat().st_mtime_ns)


def temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob(".*.tmp"))


def undecodable(blobs: dict[str, bytes]) -> dict[str, str]:
    """Name -> why, for every blob that is not a whole, valid page."""
    bad = {}
    for name, blob in blobs.items():
        try:
            decode_page(blob)
        except PageFormatError as exc:
            bad[name] = str(exc)
    return bad


def disk_blobs(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in page_files(root) if p.is_file()}


def foreign_model_page(data: bytes) -> bytes:
    """The same page, validly sealed, as if written by another model (other fingerprint)."""
    header, payload = decode_page(data)
    other = bytes(b ^ 0xFF for b in header.fingerprint)
    return encode_page(dataclasses.replace(header, fingerprint=other), bytes(payload))


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x08
    path.write_bytes(bytes(data))


class SessionProcess:
    """``python -m hybrid_offload.testing.session`` as a child process the test can kill."""

    def __init__(self, spec: dict[str, Any], workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.out = workdir / "out.json"
        self.log_path = workdir / "session.log"
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hybrid_offload.testing.session", str(spec_path), str(self.out)],
                env={**os.environ, **ENGINE_ENV},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def running(self, before: str) -> bool:
        """True while the session runs; once it exited, ``AssertionError`` naming ``before``
        (a :func:`~hybrid_offload.testing.deadlines.wait_until` condition gives up with it)."""
        if self.proc.poll() is not None:
            raise AssertionError(f"session exited ({self.proc.returncode}) before {before}")
        return True

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)

    def result(self, timeout: float = 600.0) -> dict[str, Any]:
        code = self.proc.wait(timeout=timeout)
        log = self.log_path.read_text(errors="replace")
        if code != 0 or not self.out.exists():
            raise RuntimeError(f"session failed (exit {code}):\n{log[-6000:]}")
        result = json.loads(self.out.read_text())
        result["log"] = log
        return result
