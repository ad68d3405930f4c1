"""Processes a benchmark drives: a vLLM OpenAI server and a redis-server, on free loopback ports.

:class:`ServeProcess` runs ``python -m hybrid_offload serve --config C --model M`` (or,
with ``config=None``, vLLM's api_server without any connector, with the same environment
defaults as ``hybrid-offload serve``) in its own session, so :meth:`ServeProcess.stop` kills
the whole process group (API server, EngineCore, workers): SIGTERM, then SIGKILL after a
grace period. :meth:`ServeProcess.start` returns once ``GET /health`` answers, or raises
RuntimeError with the tail of the server log. :class:`RedisProcess` is one redis-server
without persistence, stopped by pid. Everything started here and still alive at interpreter
exit is killed (``atexit``). :class:`Metrics` parses Prometheus text from ``/metrics``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
STOP_GRACE_S = 5.0
_PORT_ATTEMPTS = 3
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

_alive: set[ServeProcess | RedisProcess] = set()


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Metrics:
    """Prometheus text exposition, parsed into ``(name, labels, value)`` samples."""

    def __init__(self, text: str) -> None:
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if match is None or line.startswith("#"):
                continue
            labels = dict(_LABEL.findall(match.group(2) or ""))
            with contextlib.suppress(ValueError):
                self.samples.append((match.group(1), labels, float(match.group(3))))

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(
            value
            for sample, have, value in self.samples
            if sample == name and all(have.get(k) == v for k, v in labels.items())
        )


def fetch_metrics(base_url: str, timeout: float = 30.0) -> Metrics:
    """``GET base_url/metrics``, parsed."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as reply:
        return Metrics(reply.read().decode())


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class ServeProcess:
    """One vLLM OpenAI server process group on ``127.0.0.1:port`` (see the module docstring).

    ``config`` is a ``hybrid-offload serve`` config file, or None for plain vLLM (no
    connector). ``env`` is added to this process's environment; ``vllm_args`` go to vLLM.
    The log (appended across restarts) is ``log_path``.
    """

    def __init__(
        self,
        model: Path,
        log_path: Path,
        *,
        config: Path | None = None,
        env: Mapping[str, str] | None = None,
        vllm_args: Sequence[str] = (),
    ) -> None:
        self.model = Path(model)
        self.log_path = Path(log_path)
        self.config = None if config is None else Path(config)
        self.env = dict(env or {})
        self.vllm_args = list(vllm_args)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> tuple[list[str], dict[str, str]]:
        """The argv and full environment of the server on ``self.port``."""
        from hybrid_offload.tools.cli.serve import API_SERVER_MODULE, serve_env

        where = ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.config is None:
            argv = [sys.executable, "-m", API_SERVER_MODULE, "--model", str(self.model), *where]
            argv += self.vllm_args
        else:
            argv = [sys.executable, "-m", "hybrid_offload", "serve", "--config", str(self.config)]
            argv += ["--model", str(self.model), *where]
            argv += ["--", *self.vllm_args] if self.vllm_args else []
        env = serve_env({**os.environ, **self.env}, self.vllm_args, self.model.is_dir())
        return argv, env

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start on a free port and wait for /health; RuntimeError (with the log tail) if not."""
        for attempt in range(_PORT_ATTEMPTS):
            self.port = free_port()
            self._spawn()
            try:
                self._wait_healthy(timeout)
                return
            except RuntimeError:
                lost_port = "address already in use" in self.log().lower()
                self.stop()
                if not lost_port or attempt == _PORT_ATTEMPTS - 1:
                    raise

    def _spawn(self) -> None:
        argv, env = self.command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            out.write(f"\n==== {' '.join(argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip
        _alive.add(self)
        logger.info("server pid %d on port %d: %s", self.proc.pid, self.port, self.log_path)

    def _wait_healthy(self, timeout: float) -> None:
        began = time.monotonic()
        while time.monotonic() < began + timeout:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if _healthy(self.base_url):
                self.startup_s = time.monotonic() - began
                return
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after a grace period; reap. Idempotent."""
        proc, self.proc = self.proc, None
        _alive.discard(self)
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 30.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait_s)
                if sig == signal.SIGKILL or not _group_alive(proc.pid):
                    break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # children that outlived their parent

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` of the server log, without vLLM's route listing."""
        kept = [line for line in self.log().splitlines() if "Route: " not in line]
        return "\n".join(kept[-lines:])


class RedisProcess:
    """A redis-server on a free loopback port, files under ``directory``, no persistence."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> None:
        """Start and wait until PING answers; RuntimeError if redis-server is missing or fails."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found on PATH (scripts/setup.sh installs it)")
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(_PORT_ATTEMPTS):
            self.port = free_port()
            argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1"]
            argv += ["--save", "", "--appendonly", "no"]
            argv += ["--dir", str(self.directory), "--logfile", str(self.directory / "redis.log")]
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            _alive.add(self)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                if _ping(self.port):
                    return
                time.sleep(0.05)
            self.stop()
        raise RuntimeError(f"redis-server did not start; see {self.directory / 'redis.log'}")

    def stop(self) -> None:
        """SIGKILL by pid and reap; idempotent."""
        proc, self.proc = self.proc, None
        _alive.discard(self)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=30)


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@atexit.register
def _kill_all() -> None:
    for process in list(_alive):
        process.stop()
