"""Time in the contract tests against real processes, made safe for a busy 2-core machine.

A wall-clock bound appears only where it is the contract ("a call returns within its configured
timeout", "a refused connection fails at once, not after the timeout"), always loose: ``within``
for the first, ``FAILS_FAST_S`` under a configured ``LONG_TIMEOUT_S`` for the second. Events are
ordered by waiting for an observable condition (``wait_until``), never by sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

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
    what: str,
    *,
    ignore: tuple[type[BaseException], ...] = (),
    timeout_s: float = 60.0,
    poll_s: float = 0.02,
) -> T:
    """Poll ``condition`` until it returns something truthy, and return that; an exception in
    ``ignore`` counts as "not yet". Fails naming ``what`` after ``timeout_s`` (only a hang gets
    there)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = condition()
        except ignore:
            result = None  # type: ignore[assignment]
        if result:
            return result
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(poll_s)
