"""Real cache peer processes (``python -m hybrid_offload peer``) on loopback.

Contract: ``start_peer(capacity_bytes)`` (or ``with PeerProcess(capacity_bytes) as peer:``)
runs ``sys.executable -m hybrid_offload peer --listen 127.0.0.1:0`` and waits, at most
``start_timeout_s``, for its ready line (:data:`READY`); ``address`` is then
``"127.0.0.1:PORT"`` with the port the peer chose (no port race between processes). Restarts
reuse that port. A ``token`` is written to a private file passed as ``--token-file`` (never on
the command line); ``extra_args`` go to the command line as they are; ``nofile`` lowers the
process's open-file limit (RLIMIT_NOFILE). The peer's stdout and stderr go to a temporary log
file (``log``), removed with the token file when the peer is killed. Killed by pid only.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypedDict, Unpack

from hybrid_offload.testing.services.common import Service, kill_process, wait_ready

__all__ = ["READY", "PeerFactory", "PeerOptions", "PeerProcess", "start_peer"]

#: the line a peer prints once it listens
READY = re.compile(r"hybrid-offload peer listening on (\S+):(\d+)")
START_TIMEOUT_S = 30.0
LOG_TAIL_CHARS = 3000


class PeerProcess(Service):
    """One peer process; ``address`` is ``"127.0.0.1:PORT"`` once started."""

    def __init__(
        self,
        capacity_bytes: int,
        token: str | None = None,
        *,
        lease_timeout_s: float | None = None,
        alloc_timeout_s: float | None = None,
        extra_args: Sequence[str] = (),
        nofile: int | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.token = token
        self.lease_timeout_s = lease_timeout_s
        self.alloc_timeout_s = alloc_timeout_s
        self.extra_args = list(extra_args)
        self.nofile = nofile
        self.start_timeout_s = start_timeout_s
        self.token_path: Path | None = None
        self.port = 0
        self.address = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self.startup_s = 0.0  # wall time of the last start() until the ready line

    def _command(self) -> list[str]:
        cmd = [sys.executable, "-m", "hybrid_offload", "peer", "--listen", f"127.0.0.1:{self.port}"]
        cmd += ["--capacity-bytes", str(self.capacity_bytes)]
        if self.token is not None:
            if self.token_path is None:  # in a directory of its own: secret files never sit in /tmp
                directory = Path(tempfile.mkdtemp(prefix="hybrid-offload-peer-token-"))
                fd = os.open(directory / "token", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(self.token)
                self.token_path = directory / "token"
            cmd += ["--token-file", str(self.token_path)]
        else:
            cmd += ["--insecure"]  # a peer without a token must say so
        if self.lease_timeout_s is not None:
            cmd += ["--lease-timeout-s", str(self.lease_timeout_s)]
        if self.alloc_timeout_s is not None:
            cmd += ["--alloc-timeout-s", str(self.alloc_timeout_s)]
        return cmd + self.extra_args

    def _limit_files(self) -> None:
        if self.nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def _ready(self) -> bool:
        match = READY.search(self.log)
        if match is None:
            return False
        self.port = int(match.group(2))
        self.address = f"127.0.0.1:{self.port}"
        return True

    def start(self) -> None:
        """(Re)start on the same port (any free port the first time); wait for the ready line.

        Raises RuntimeError with the log tail (the peer killed) if it exits or times out first.
        """
        self.kill()
        fd, log = tempfile.mkstemp(prefix="hybrid-offload-peer-", suffix=".log")
        self.log_path = Path(log)
        began = time.monotonic()
        with os.fdopen(fd, "wb") as out:
            self.proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                preexec_fn=self._limit_files,
            )
        self._track()
        try:
            wait_ready(
                "cache peer",
                self.proc,
                self._ready,
                lambda: self.log[-LOG_TAIL_CHARS:],
                timeout_s=self.start_timeout_s,
                interval_s=0.01,
            )
        except RuntimeError:
            self.kill()
            raise
        self.startup_s = time.monotonic() - began

    def kill(self) -> None:
        """SIGKILL by pid and reap; remove the log and token files. Idempotent."""
        proc, self.proc = self.proc, None
        self._untrack()
        if proc is None:
            return
        kill_process(proc, wait_s=10)
        for path in (self.log_path, self.token_path):
            if path is not None:
                with contextlib.suppress(OSError):
                    path.unlink()
        if self.token_path is not None:
            with contextlib.suppress(OSError):
                self.token_path.parent.rmdir()
        self.token_path = None

    def stop(self) -> None:
        """The same as :meth:`kill`."""
        self.kill()

    def terminate(self, timeout: float = 10.0) -> int | None:
        """SIGTERM by pid; wait for a clean exit; returns the exit code (None if it hung)."""
        proc = self.proc
        if proc is None:
            return None
        proc.terminate()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        self.kill()
        return code

    @property
    def log(self) -> str:
        """Everything the peer printed since its last start ("" once killed)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def __repr__(self) -> str:
        return f"PeerProcess(address={self.address!r}, pid={self.pid})"


class PeerOptions(TypedDict, total=False):
    """The keyword arguments of :class:`PeerProcess` after ``capacity_bytes`` and ``token``."""

    lease_timeout_s: float | None
    alloc_timeout_s: float | None
    extra_args: Sequence[str]
    nofile: int | None
    start_timeout_s: float


def start_peer(capacity_bytes: int, token: str | None = None, **options: Unpack[PeerOptions]) -> PeerProcess:
    """A started peer on a free loopback port; the caller must ``kill()`` it (or use ``with``)."""
    peer = PeerProcess(capacity_bytes, token, **options)
    peer.start()
    return peer


#: ``peers(capacity_bytes, token, **options) -> PeerProcess`` (the contract tests' fixture)
PeerFactory = Callable[..., PeerProcess]
