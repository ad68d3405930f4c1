"""Real redis-server processes for tests: single servers and small clusters on loopback.

Plain helpers (no pytest dependency), reused by the contract, fault and end-to-end tests::

    server = start_redis_server(tmp_path)           # redis://127.0.0.1:PORT/0
    try:
        ...
        server.stop(); server.start()                # kill, then restart on the same port
    finally:
        server.stop()

    cluster = start_redis_cluster(tmp_path, n=3)     # cluster.url: redis+cluster://127.0.0.1:P1
    try: ... finally: cluster.stop()

Parallel-safe (pytest-xdist): every server gets a free loopback port (bind to port 0; a server
that loses the race for its port is retried on another), its own ``--dir`` and log file, no
persistence (``--save "" --appendonly no``). Servers are stopped by pid (SIGKILL), never by
name; servers still running when the interpreter exits are killed too (``atexit``). Callers
stop what they start (``try/finally`` or a yield fixture).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import weakref
from pathlib import Path

__all__ = [
    "RedisClusterProcess",
    "RedisServer",
    "free_port",
    "redis_server_binary",
    "start_redis_cluster",
    "start_redis_server",
]

START_TIMEOUT_S = 20.0
_PORT_ATTEMPTS = 8
_CLUSTER_BUS_OFFSET = 10000

_live: weakref.WeakSet[RedisServer] = weakref.WeakSet()
_live_lock = threading.Lock()


def _kill_all() -> None:
    with _live_lock:
        servers = list(_live)
    for server in servers:
        server.stop()


atexit.register(_kill_all)


def redis_server_binary() -> str:
    """Path of ``redis-server``; fails with a clear message when it is not installed."""
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError(
            "redis-server not found on PATH: run scripts/setup.sh (it installs redis-server "
            "and redis-tools from apt)"
        )
    return path


def _redis_cli_binary() -> str:
    path = shutil.which("redis-cli")
    if path is None:
        raise RuntimeError("redis-cli not found on PATH: run scripts/setup.sh (redis-tools)")
    return path


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
        if port + _CLUSTER_BUS_OFFSET < 65536 and _port_free(port + _CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free loopback port found")


def _ping(port: int, timeout: float = 0.5) -> bool:
    """Whether a server answers on ``port`` (a NOAUTH error counts: it is up)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")


class RedisServer:
    """One redis-server process on ``127.0.0.1:port`` (see the module docstring)."""

    def __init__(self, port: int, directory: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port
        self.directory = Path(directory)
        self.extra_args = tuple(extra_args)
        self.url = f"redis://127.0.0.1:{port}/0"
        self.log_path = self.directory / f"redis-{port}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def _argv(self) -> list[str]:
        return [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--logfile", str(self.log_path),
            "--daemonize", "no",
            *self.extra_args,
        ]  # fmt: skip

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> None:
        """(Re)start on the same port; return once PING answers. Raises RuntimeError."""
        with self._lock:
            if self.pid is not None:
                return
            self.directory.mkdir(parents=True, exist_ok=True)
            self._proc = subprocess.Popen(
                self._argv(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=self.directory,
            )
            with _live_lock:
                _live.add(self)
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    code = self._proc.returncode
                    self._proc = None
                    raise RuntimeError(
                        f"redis-server on port {self.port} exited with {code}:\n{self.log_tail()}"
                    )
                if _ping(self.port):
                    return
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGKILL the server by pid and wait for it to exit; idempotent."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is None:
                return
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __repr__(self) -> str:
        return f"RedisServer(port={self.port}, pid={self.pid})"


def _start_on_free_port(directory: Path, extra_args: tuple[str, ...], cluster_bus: bool) -> RedisServer:
    last: Exception | None = None
    for _ in range(_PORT_ATTEMPTS):
        server = RedisServer(free_port(cluster_bus=cluster_bus), directory, extra_args)
        try:
            server.start()
            return server
        except RuntimeError as exc:  # lost the port to another process: try another
            last = exc
            if "Address already in use" not in str(exc) and "bind" not in str(exc).lower():
                raise
    raise RuntimeError(f"could not start redis-server on a free port: {last}")


def start_redis_server(directory: Path, *extra_args: str) -> RedisServer:
    """Start a redis-server on a free loopback port, files under ``directory``."""
    return _start_on_free_port(Path(directory), tuple(extra_args), cluster_bus=False)


class RedisClusterProcess:
    """A cluster of ``RedisServer`` nodes (primaries only, slots split evenly)."""

    def __init__(self, nodes: list[RedisServer]) -> None:
        self.nodes = nodes
        self.startup_nodes = [f"127.0.0.1:{node.port}" for node in nodes]
        self.url = f"redis+cluster://127.0.0.1:{nodes[0].port}"

    def stop(self) -> None:
        """Stop every node (idempotent)."""
        for node in self.nodes:
            node.stop()


def _cluster_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"CLUSTER INFO\r\n")
            data = b""
            while b"cluster_state:" not in data or not data.endswith(b"\r\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return False
    return b"cluster_state:ok" in data


def start_redis_cluster(directory: Path, n: int = 3) -> RedisClusterProcess:
    """Start ``n`` cluster-enabled nodes on loopback, join them, wait for cluster_state:ok."""
    if n < 3:
        raise ValueError("redis-cli --cluster create needs at least 3 primaries")
    directory = Path(directory)
    nodes: list[RedisServer] = []
    try:
        for i in range(n):
            node_dir = directory / f"node{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            args = (
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", "2000",
            )  # fmt: skip
            nodes.append(_start_on_free_port(node_dir, args, cluster_bus=True))
        create = [
            _redis_cli_binary(),
            "--cluster", "create",
            *[f"127.0.0.1:{node.port}" for node in nodes],
            "--cluster-replicas", "0",
            "--cluster-yes",
        ]  # fmt: skip
        result = subprocess.run(create, capture_output=True, text=True, timeout=60, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{result.stdout}\n{result.stderr}")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(_cluster_ok(node.port) for node in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("cluster did not reach cluster_state:ok on every node")
            time.sleep(0.05)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return RedisClusterProcess(nodes)
