"""Real redis-server processes on loopback: single servers and small Redis Clusters.

Contract::

    server = start_redis_server(directory)           # started; server.url: redis://127.0.0.1:PORT/0
    server.stop(); server.start()                    # kill, then restart on the same port
    with start_redis_server(directory) as server: ...  # stopped at the end of the block

    cluster = start_redis_cluster(directory, n=3)    # cluster.url: redis+cluster://127.0.0.1:P1

Every server: ``--bind 127.0.0.1``, no persistence (``--save "" --appendonly no``), its own
``--dir`` and log file (``redis-PORT.log`` in that directory unless ``log_name`` says
otherwise; what it prints before it opens that file is appended there too). ``start()``
returns once PING answers (a NOAUTH error counts: it is up) or raises RuntimeError with the
log tail. ``start_redis_server`` picks a free loopback port; a server that loses the race for
it is retried on another (parallel-safe under pytest-xdist). Servers are stopped by pid
(SIGKILL), never by name.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

from hybrid_offload.testing.services.common import Service, free_port, kill_process, read_tail, wait_ready

__all__ = [
    "RedisCluster",
    "RedisServer",
    "redis_server_binary",
    "start_redis_cluster",
    "start_redis_server",
]

START_TIMEOUT_S = 20.0
_PORT_ATTEMPTS = 8


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


def _ping(port: int, timeout: float = 0.5) -> bool:
    """Whether a server answers on ``port`` (a NOAUTH error counts: it is up)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")


class RedisServer(Service):
    """One redis-server process on ``127.0.0.1:port`` (see the module docstring).

    ``extra_args`` go to redis-server after ours (later flags win); ``log_name`` is the log
    file's name in ``directory``; ``start_timeout_s`` bounds the wait for PING.
    """

    def __init__(
        self,
        port: int,
        directory: Path,
        extra_args: tuple[str, ...] = (),
        *,
        log_name: str | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.port = port
        self.directory = Path(directory)
        self.extra_args = tuple(extra_args)
        self.url = f"redis://127.0.0.1:{port}/0"
        self.log_path = self.directory / (log_name or f"redis-{port}.log")
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

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
        return read_tail(self.log_path, lines)

    def start(self) -> None:
        """(Re)start on the same port; return once PING answers. Raises RuntimeError."""
        with self._lock:
            if self.pid is not None:
                return
            self.directory.mkdir(parents=True, exist_ok=True)
            # redis-server logs to the file itself; what it prints before opening it (a bad
            # flag, say) is appended there too, so the error below shows it
            with open(self.log_path, "ab") as early:
                self.proc = subprocess.Popen(
                    self._argv(), stdin=subprocess.DEVNULL, stdout=early, stderr=early, cwd=self.directory
                )
            self._track()
            proc = self.proc
        try:
            wait_ready(
                f"redis-server on port {self.port}",
                proc,
                lambda: _ping(self.port),
                self.log_tail,
                timeout_s=self.start_timeout_s,
                interval_s=0.02,
            )
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGKILL the server by pid and wait for it to exit; idempotent."""
        with self._lock:
            proc, self.proc = self.proc, None
            self._untrack()
            if proc is not None:
                kill_process(proc)

    def __repr__(self) -> str:
        return f"RedisServer(port={self.port}, pid={self.pid})"


def _start_on_free_port(
    directory: Path,
    extra_args: tuple[str, ...],
    *,
    cluster_bus: bool,
    log_name: str | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> RedisServer:
    last: Exception | None = None
    for _ in range(_PORT_ATTEMPTS):
        port = free_port(cluster_bus=cluster_bus)
        server = RedisServer(port, directory, extra_args, log_name=log_name, start_timeout_s=start_timeout_s)
        try:
            server.start()
            return server
        except RuntimeError as exc:  # lost the port to another process: try another
            last = exc
            if "Address already in use" not in str(exc) and "bind" not in str(exc).lower():
                raise
    raise RuntimeError(f"could not start redis-server on a free port: {last}")


def start_redis_server(
    directory: Path,
    *extra_args: str,
    log_name: str | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> RedisServer:
    """A started redis-server on a free loopback port, files under ``directory``.

    The caller stops it (``stop()``, or ``with``).
    """
    return _start_on_free_port(
        Path(directory), tuple(extra_args), cluster_bus=False, log_name=log_name,
        start_timeout_s=start_timeout_s,
    )  # fmt: skip


class RedisCluster:
    """A cluster of :class:`RedisServer` nodes (primaries only, slots split evenly).

    ``startup_nodes`` are ``"127.0.0.1:PORT"`` of every node; ``url`` names the first node as
    ``redis+cluster://``. Stop a node and ``start()`` it again: it keeps its port and
    ``nodes.conf``, so it takes its slots back.
    """

    def __init__(self, nodes: list[RedisServer]) -> None:
        self.nodes = nodes
        self.startup_nodes = [f"127.0.0.1:{node.port}" for node in nodes]
        self.url = f"redis+cluster://127.0.0.1:{nodes[0].port}"

    def stop(self) -> None:
        """Stop every node (idempotent)."""
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


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


def start_redis_cluster(directory: Path, n: int = 3) -> RedisCluster:
    """Start ``n`` cluster-enabled nodes on loopback, join them, wait for cluster_state:ok.

    Node ``i`` keeps its files in ``directory/node<i>``. Raises RuntimeError (every node
    stopped) when a node does not start, ``redis-cli --cluster create`` fails, or the cluster
    is not ok within the start timeout.
    """
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
                raise RuntimeError("redis cluster did not reach cluster_state:ok on every node")
            time.sleep(0.05)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return RedisCluster(nodes)
