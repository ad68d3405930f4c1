"""What every service launcher shares: free loopback ports, waiting for readiness, stopping.

Contract: :class:`Service` is the base of every launcher here. ``start()`` returns once the
service is ready or raises RuntimeError naming the service, with the tail of its log;
``stop()`` is idempotent; ``with service:`` starts it (unless running) and stops it at the end.
``pause()``/``resume()`` SIGSTOP/SIGCONT the process (a hung service, for fault tests).
Processes are signalled by pid (or by their own process group), never by name; every service
still running when the interpreter exits is stopped (``atexit``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = [
    "Service",
    "free_port",
    "kill_process",
    "pause_process",
    "read_tail",
    "resume_process",
    "stop_process_group",
    "wait_ready",
]

CLUSTER_BUS_OFFSET = 10000  # a Redis Cluster node also listens on port + 10000

_live: set[Service] = set()
_live_lock = threading.Lock()


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, cluster_bus: bool = False) -> int:
    """A loopback TCP port free right now (with ``cluster_bus``: also port + 10000)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not cluster_bus:
            return port
        if port + CLUSTER_BUS_OFFSET < 65536 and _port_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free loopback port found")


def read_tail(path: Path | None, lines: int) -> str:
    """The last ``lines`` lines of the text file ``path`` (``"(no log)"`` if unreadable)."""
    if path is None:
        return "(no log)"
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_ready(
    service: str,
    proc: subprocess.Popen[bytes],
    ready: Callable[[], bool],
    log_tail: Callable[[], str],
    *,
    timeout_s: float,
    interval_s: float,
) -> None:
    """Poll ``ready()`` every ``interval_s`` until it is true.

    Raises RuntimeError naming ``service`` with ``log_tail()`` when the process exits first or
    ``timeout_s`` passes (the caller stops the process).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if ready():
            return
        code = proc.poll()
        if code is not None:
            raise RuntimeError(f"{service} exited with {code} before it was ready:\n{log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{service} not ready after {timeout_s:.0f}s:\n{log_tail()}")
        time.sleep(interval_s)


def kill_process(proc: subprocess.Popen[bytes], wait_s: float = 30.0) -> None:
    """SIGKILL ``proc`` by pid (if alive) and reap it, waiting at most ``wait_s``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=wait_s)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the process group led by ``proc``, SIGKILL it after ``grace_s``; reap ``proc``.

    ``proc`` must have been started with ``start_new_session=True``. Children that outlive the
    leader are SIGKILLed too.
    """
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)
            if sig == signal.SIGKILL or not _group_alive(proc.pid):
                break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def pause_process(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped.

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


class Service:
    """Base of the launchers: ``proc`` (the running process or None), ``pid``, ``start``/``stop``,
    ``pause``/``resume``, context-manager use and the interpreter-exit safety net."""

    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        """The pid while the process runs, else None."""
        proc = self.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def restart(self) -> None:
        """Stop, then start again (on the same port where the service keeps one)."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """SIGSTOP the process and wait until it is stopped: it accepts, but answers nothing."""
        pid = self._running_pid()
        pause_process(pid)

    def resume(self) -> None:
        """SIGCONT the process (after :meth:`pause`)."""
        resume_process(self._running_pid())

    def _running_pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self!r} is not running")
        return self.proc.pid

    def _track(self) -> None:
        with _live_lock:
            _live.add(self)

    def _untrack(self) -> None:
        with _live_lock:
            _live.discard(self)

    def __enter__(self) -> Self:
        if self.pid is None:
            self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    with _live_lock:
        services = list(_live)
    for service in services:
        with contextlib.suppress(Exception):
            service.stop()
