"""Process helpers for fault tests (importable as ``process_control``)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def stop_process(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread is stopped.

    ``kill`` returns before the target stops: a thread running at that moment can still answer
    one more request, which would make a "hung server" test pass or fail by chance.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                states.append(stat.rsplit(")", 1)[1].split()[0])
        if states and all(state in "tT" for state in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped after {timeout}s: thread states {states}")
        time.sleep(0.01)


def resume_process(pid: int) -> None:
    """SIGCONT ``pid``."""
    os.kill(pid, signal.SIGCONT)
