"""Services the end-to-end benchmark stores into: a loopback redis-server and a cache peer.

Both are real processes started here and killed by pid when their ``with`` block ends (never by
name). They are deliberately small: the test suite's richer helpers live in ``tests/`` and are
not importable from the installed package.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

START_TIMEOUT_S = 30.0
PEER_READY = re.compile(r"hybrid-offload peer listening on (\S+):(\d+)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[str]:
    """A redis-server on a free loopback port without persistence; yields its ``redis://`` URL.

    Raises RuntimeError when redis-server is missing or does not answer PING within
    ``START_TIMEOUT_S``. The server is SIGKILLed by pid on exit.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found on PATH: run scripts/setup.sh")
    directory.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(directory), "--logfile", str(directory / "redis.log")]  # fmt: skip
    quiet = subprocess.DEVNULL
    proc = subprocess.Popen(argv, stdin=quiet, stdout=quiet, stderr=quiet)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not start (see {directory}/redis.log)")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _kill(proc)


@contextlib.contextmanager
def cache_peer(capacity_bytes: int) -> Iterator[str]:
    """A ``hybrid-offload peer`` process on a free loopback port; yields ``"127.0.0.1:PORT"``.

    Raises RuntimeError when its ready line does not appear within ``START_TIMEOUT_S``. The
    process is SIGKILLed by pid on exit.
    """
    fd, log_name = tempfile.mkstemp(prefix="hybrid-offload-bench-peer-", suffix=".log")
    log = Path(log_name)
    cmd = [sys.executable, "-m", "hybrid_offload", "peer", "--listen", "127.0.0.1:0",
           "--capacity-bytes", str(capacity_bytes)]  # fmt: skip
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (match := PEER_READY.search(log.read_text(errors="replace"))) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"peer did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.02)
        yield f"127.0.0.1:{match.group(2)}"
    finally:
        _kill(proc)
        with contextlib.suppress(OSError):
            log.unlink()
