"""Mooncake-format request traces: loading, scaling, and the token ids a replay sends.

Pure (no vLLM). One request per line: ``timestamp`` (ms), ``input_length``, ``output_length``,
``hash_ids`` (one per :data:`TRACE_BLOCK_TOKENS` tokens; equal ids, equal tokens). A replay
through an engine (:func:`prompt_tokens`) gives each id one fixed random block of tokens, cut
to the request's length; :func:`scaled` shrinks a trace for a small engine (fewer tokens per
id, lengths in proportion).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

__all__ = [
    "TRACE_BLOCK_TOKENS", "TraceError", "TraceRequest", "load_trace", "prompt_tokens", "scaled",
    "session_ends",
]  # fmt: skip

#: tokens per hash id in the Mooncake traces
TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line is not a request (the message names the line and field)."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, block: int = TRACE_BLOCK_TOKENS, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a Mooncake-format JSONL trace (at most ``limit``); raises
    :class:`TraceError` naming the first bad line."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{where}: expected an object")
            fields = {}
            for name in ("timestamp", "input_length", "output_length"):
                value = row.get(name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise TraceError(f"{where}: {name} must be an integer >= 0, got {value!r}")
                fields[name] = value
            ids = row.get("hash_ids")
            if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
            if len(ids) < fields["input_length"] // block:
                raise TraceError(
                    f"{where}: {len(ids)} hash_ids cannot name {fields['input_length']} tokens "
                    f"of {block}-token blocks"
                )
            out.append(TraceRequest(fields["timestamp"], fields["input_length"], fields["output_length"],
                                    tuple(ids)))  # fmt: skip
    return out


def scaled(requests: Sequence[TraceRequest], block: int) -> list[TraceRequest]:
    """The trace at ``block`` tokens a hash id: every length times ``block / 512`` (at least 1
    token; the ids stay, so what requests share stays)."""
    return [replace(r, input_length=max(1, round(r.input_length * block / TRACE_BLOCK_TOKENS)))
            for r in requests]  # fmt: skip


def session_ends(requests: Sequence[TraceRequest], block: int) -> list[bool]:
    """Per request (lengths at ``block`` tokens a hash id), whether no later request extends
    its prompt (its full blocks, ids alike): the session hint an application keeping the
    session would send. A prompt of no full block never continues."""
    last: dict[tuple[int, int], int] = {}  # (blocks, digest of the ids) -> the last request
    prefixes = []
    for i, r in enumerate(requests):
        digest, full = 0, r.input_length // block
        for m, hash_id in enumerate(r.hash_ids[:full], start=1):
            digest = (digest * 1_000_003 + hash_id + 1) % (1 << 61)
            last[(m, digest)] = i
        prefixes.append((full, digest))
    return [full == 0 or last[(full, d)] == i for i, (full, d) in enumerate(prefixes)]


def prompt_tokens(request: TraceRequest, block: int, low: int, high: int) -> list[int]:
    """Token ids of ``request`` (lengths at ``block`` tokens a hash id): for each id a fixed
    random block of ids in ``[low, high)`` (the same in every process), cut to its length."""
    tokens: list[int] = []
    for hash_id in request.hash_ids:
        if len(tokens) >= request.input_length:
            break
        tokens.extend(np.random.default_rng(hash_id).integers(low, high, block).tolist())
    return tokens[: request.input_length]
