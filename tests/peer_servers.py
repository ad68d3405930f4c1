"""Real ``hybrid-offload peer`` processes for tests (importable as ``peer_servers``).

``start_peer(capacity)`` runs ``sys.executable -m hybrid_offload peer`` on a free
loopback port and waits (bounded) for its ready line. A ``token`` is written to a private file
and passed as ``--token-file`` (never on the command line); ``extra_args`` go to the command
line as they are; ``nofile`` lowers the process's open-file limit (RLIMIT_NOFILE).
Parallel-safe: the first start listens on port 0 and reads the port the peer chose from its
ready line (no port race between xdist workers); restarts reuse that port. Processes are killed
by pid only, and every process still alive at interpreter exit is killed. Use them from
fixtures with ``yield`` and ``kill()``.
"""

from __future__ import annotations

import atexit
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

__all__ = ["PeerFactory", "PeerProcess", "start_peer"]

READY = re.compile(r"hybrid-offload peer listening on (\S+):(\d+)")
START_TIMEOUT_S = 30.0

_alive: set[PeerProcess] = set()


class PeerProcess:
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
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.token = token
        self.lease_timeout_s = lease_timeout_s
        self.alloc_timeout_s = alloc_timeout_s
        self.extra_args = list(extra_args)
        self.nofile = nofile
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
            if self.token_path is None:
                fd, name = tempfile.mkstemp(prefix="hybrid-offload-peer-token-")
                with os.fdopen(fd, "w") as f:
                    f.write(self.token)
                self.token_path = Path(name)
            cmd += ["--token-file", str(self.token_path)]
        if self.lease_timeout_s is not None:
            cmd += ["--lease-timeout-s", str(self.lease_timeout_s)]
        if self.alloc_timeout_s is not None:
            cmd += ["--alloc-timeout-s", str(self.alloc_timeout_s)]
        return cmd + self.extra_args

    def _limit_files(self) -> None:
        if self.nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def start(self) -> None:
        """(Re)start on the same port (any free port the first time); wait for the ready line."""
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
        _alive.add(self)
        deadline = began + START_TIMEOUT_S
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            match = READY.search(text)
            if match:
                self.port = int(match.group(2))
                self.address = f"127.0.0.1:{self.port}"
                self.startup_s = time.monotonic() - began
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        tail = self.log_path.read_text(errors="replace")[-3000:]
        self.kill()
        raise RuntimeError(f"peer did not start (exit {self.proc.returncode}):\n{tail}")

    def kill(self) -> None:
        """SIGKILL by pid and reap; idempotent."""
        proc, self.proc = self.proc, None
        _alive.discard(self)
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        for path in (self.log_path, self.token_path):
            if path is not None:
                with contextlib.suppress(OSError):
                    path.unlink()
        self.token_path = None

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

    def restart(self) -> None:
        self.kill()
        self.start()

    @property
    def log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")


def start_peer(
    capacity_bytes: int,
    token: str | None = None,
    *,
    lease_timeout_s: float | None = None,
    alloc_timeout_s: float | None = None,
    extra_args: Sequence[str] = (),
    nofile: int | None = None,
) -> PeerProcess:
    """A started peer on a free loopback port; the caller must ``kill()`` it."""
    peer = PeerProcess(
        capacity_bytes,
        token,
        lease_timeout_s=lease_timeout_s,
        alloc_timeout_s=alloc_timeout_s,
        extra_args=extra_args,
        nofile=nofile,
    )
    peer.start()
    return peer


@atexit.register
def _kill_all() -> None:
    for peer in list(_alive):
        peer.kill()


#: ``peers(capacity_bytes, token, **options) -> PeerProcess`` (the contract tests' fixture)
PeerFactory = Callable[..., PeerProcess]
