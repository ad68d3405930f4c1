"""What the ``hybrid-offload cache`` actions share for output: exit codes, sizes and ages for
people, JSON, a progress line, and the model a fingerprint's card names."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from hybrid_offload.core.model_card import ModelCard

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if seconds < limit:
            return f"{max(0, int(seconds // div))}{unit}"
    return f"{int(seconds // 86400)}d"


def emit_json(data: Any, out: TextIO) -> None:
    json.dump(data, out, indent=2, sort_keys=False)
    out.write("\n")


class Progress:
    """``\\rverified n/N pages`` on stderr, at most ten updates a second."""

    def __init__(self, total: int, verb: str, enabled: bool) -> None:
        self.total, self.verb, self.enabled = total, verb, enabled
        self._shown = 0.0

    def update(self, done: int) -> None:
        now = time.monotonic()
        if self.enabled and (done == self.total or now - self._shown >= 0.1):
            self._shown = now
            sys.stderr.write(f"\r{self.verb} {done}/{self.total} pages")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.total:
            sys.stderr.write("\n")
            sys.stderr.flush()


def printable(text: str) -> str:
    """``text`` with each non-printable character (a terminal escape, a newline) written as its
    Python escape: what a card or page says is someone else's text, never the terminal's."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def model_name(card: ModelCard | None) -> str | None:
    """The model a card names, printable (cards are unsigned: any writer of the tier wrote it)."""
    return (printable(card.name) or None) if card is not None else None
