"""Time in tests, made safe for a busy 2-core machine: the one ``wait_until``, and loose bounds.

A wall-clock bound appears only where it is the contract ("a call returns within its configured
timeout", "a refused connection fails at once, not after the timeout"), always loose: ``within``
for the first, ``FAILS_FAST_S`` under a configured ``LONG_TIMEOUT_S`` for the second. Events are
ordered by waiting for an observable condition (:func:`wait_until`), never by sleeping.

No pytest: usable from test helpers, harness code and child processes alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["FAILS_FAST_S", "LONG_TIMEOUT_S", "takes_less_than", "wait_until", "within"]

T = TypeVar("T")

#: a timeout configured for "fails fast" checks: a call that waited for it would take this long
LONG_TIMEOUT_S = 60.0
#: what a call that fails at once may take on a loaded machine; far below ``LONG_TIMEOUT_S``
FAILS_FAST_S = LONG_TIMEOUT_S / 4


def within(timeout_s: float) -> float:
    """The wall-clock bound for a call that a configured ``timeout_s`` limits: 3x + 2 s."""
    return 3 * timeout_s + 2.0


@contextmanager
def takes_less_than(limit_s: float, what: str = "the call") -> Iterator[None]:
    """Assert that the ``with`` body (if it completes) takes less than ``limit_s`` wall-clock
    seconds; use ``within`` or ``FAILS_FAST_S`` for the limit."""
    start = time.monotonic()
    yield
    elapsed = time.monotonic() - start
    assert elapsed < limit_s, f"{what} took {elapsed:.2f} s (limit {limit_s:g} s)"


def wait_until(
    condition: Callable[[], T],
    what: str | Callable[[], str],
    *,
    ignore: tuple[type[BaseException], ...] = (),
    timeout_s: float = 60.0,
    poll_s: float = 0.02,
    between: Callable[[], object] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Poll ``condition`` until it returns something truthy, and return that.

    An exception in ``ignore`` counts as "not yet"; any other propagates (a condition raises to
    give up early, e.g. when the process it waits for died). Between polls ``between()`` runs
    (e.g. pump a socket for a moment) or, without it, the caller sleeps ``poll_s``. After
    ``timeout_s`` on ``clock`` (only a hang gets there) raises ``AssertionError`` naming
    ``what`` (a callable: evaluated then, to tell what was seen last).
    """
    deadline = clock() + timeout_s
    while True:
        try:
            result = condition()
        except ignore:
            result = None
        if result:
            return result
        if clock() >= deadline:
            raise AssertionError(f"{what if isinstance(what, str) else what()}: not within {timeout_s:g} s")
        if between is not None:
            between()
        else:
            time.sleep(poll_s)
