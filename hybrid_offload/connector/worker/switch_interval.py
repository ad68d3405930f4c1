"""The GIL switch interval while loads are in flight (see :class:`LoadSwitchInterval`)."""

from __future__ import annotations

import sys

__all__ = ["LoadSwitchInterval"]


class LoadSwitchInterval:
    """Lowers the process's GIL switch interval while loads are in flight, restores it after.

    While a request waits for its pages, vLLM's step loop runs Python without pause, and every
    blocking call of the load thread (a read, an open) gives the GIL up and waits up to the
    switch interval (5 ms by default) to get it back: a page load costs several of those. Only
    the model-runner thread calls :meth:`loading`; the interval is process-wide, so another
    change made meanwhile is kept (not restored over).
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._saved: float | None = None

    def loading(self, active: bool) -> None:
        if not self.interval_s:
            return
        if active and self._saved is None:
            current = sys.getswitchinterval()
            if current > self.interval_s:
                self._saved = current
                sys.setswitchinterval(self.interval_s)
        elif not active and self._saved is not None:
            if sys.getswitchinterval() == self.interval_s:
                sys.setswitchinterval(self._saved)
            self._saved = None
