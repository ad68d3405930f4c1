"""The redis backends' bounded page reads: GETRANGE in pipelines, values into the caller's buffers.

A get reads each page with ``GETRANGE key 0 end`` up to its limit, so the server never sends
more than ``end + 1`` bytes of a longer value (garbage, or another writer's). GETRANGE answers
an absent key and an empty value alike (an empty string): empty replies are asked again, in one
more round trip, with a script that tells them apart (None for an absent key). Values arrive
through redis-py (a fresh ``bytes`` each, :func:`getrange`) or, from a ``redis://`` server,
straight into the caller's views on connections of their own (:func:`getrange_into`, with the
:class:`~.raw.RawReader`).

The backend passes ``run`` (its commands in one pipeline of its client: in a cluster, one per
node) and ``chunks`` (index ranges of about ``max_batch_bytes`` of the given weights); page
``names`` are the Redis keys, prefix included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..base import Buffer
from .raw import RawReader

__all__ = ["GETRANGE_IF_EXISTS", "Chunks", "Run", "getrange", "getrange_into"]

#: sends ``(method, *args)`` commands in one pipeline; their replies, in order
Run = Callable[[Sequence[tuple[Any, ...]]], list[Any]]
#: index ranges of a batch whose weights sum to about ``max_batch_bytes``
Chunks = Callable[[Sequence[int]], Iterator[range]]

#: GETRANGE that answers nil for an absent key (EVAL, not EVALSHA: cluster pipelines refuse it)
GETRANGE_IF_EXISTS = """#!lua flags=no-writes,allow-oom
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
return redis.call('GETRANGE', KEYS[1], 0, ARGV[1])
"""


def getrange(run: Run, chunks: Chunks, names: Sequence[str], ends: Sequence[int],
             weights: Sequence[int]) -> list[bytes | None]:  # fmt: skip
    """``GETRANGE name 0 end`` per name, in pipelines of about ``max_batch_bytes`` (by
    ``weights``); None for an absent key."""
    found: list[bytes | None] = []
    for chunk in chunks(weights):
        found += run([("getrange", names[j], 0, ends[j]) for j in chunk])
    return _ask_empty_again(run, chunks, names, ends, weights, found)


def getrange_into(run: Run, chunks: Chunks, raw: RawReader, names: Sequence[str],
                  views: Sequence[memoryview], weights: Sequence[int]) -> list[Buffer | None]:  # fmt: skip
    """:func:`getrange` up to each view's end, values received into the views: per name the
    filled part of its view, None, or for a longer value ``bytes`` of its length."""
    found: list[Buffer | None] = []
    for chunk in chunks(weights):
        ends = [views[j].nbytes for j in chunk]
        got = raw.read_into([names[j] for j in chunk], ends, [views[j] for j in chunk])
        for j, n in zip(chunk, got, strict=True):
            found.append(views[j][:n] if n <= views[j].nbytes else bytes(n))
    return _ask_empty_again(run, chunks, names, [v.nbytes for v in views], weights, found)


def _ask_empty_again(run: Run, chunks: Chunks, names: Sequence[str], ends: Sequence[int],
                     weights: Sequence[int], found: list[Any]) -> list[Any]:  # fmt: skip
    """Empty replies (absent key or empty value) asked again with a script telling them apart."""
    empty = [j for j, data in enumerate(found) if data is not None and len(data) == 0]
    for chunk in chunks([weights[j] for j in empty]):
        again = [empty[i] for i in chunk]
        commands = [("execute_command", "EVAL", GETRANGE_IF_EXISTS, 1, names[j], ends[j]) for j in again]
        for j, data in zip(again, run(commands), strict=True):
            found[j] = data
    return found
