"""Real ``hybrid-offload serve`` processes for tests (importable as ``serve_servers``).

``start_serve(config, model, log_dir)`` runs ``sys.executable -m hybrid_offload serve``
on a free loopback port in its own session (process group) and waits, with a deadline, until
``GET /health`` answers. ``stop()`` kills the whole group (API server, EngineCore and worker
processes): SIGTERM, then SIGKILL after a short grace. Servers still alive at interpreter exit
are killed too. ``with server.log_on_failure():`` adds the tail of the server log to any
exception raised inside it, so a failing assertion shows what the server said.

HTTP goes through ``urllib`` (no extra dependency); ``/metrics`` is parsed into
:class:`Metrics` (sums of samples per name, optionally filtered by labels).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from redis_servers import free_port

__all__ = ["Metrics", "ServeProcess", "start_serve"]

START_TIMEOUT_S = 240.0
STOP_GRACE_S = 5.0
_PORT_ATTEMPTS = 3
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

_alive: set[ServeProcess] = set()


class Metrics:
    """Prometheus text exposition, parsed: ``(name, labels, value)`` per sample."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if match is None or line.startswith("#"):
                continue
            labels = dict(_LABEL.findall(match.group(2) or ""))
            self.samples.append((match.group(1), labels, float(match.group(3))))

    def names(self) -> set[str]:
        return {name for name, _, _ in self.samples}

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(
            value
            for sample, have, value in self.samples
            if sample == name and all(have.get(k) == v for k, v in labels.items())
        )

    def label_values(self, name: str, label: str) -> set[str]:
        return {have[label] for sample, have, _ in self.samples if sample == name and label in have}


class ServeProcess:
    """One ``hybrid-offload serve`` process group on ``127.0.0.1:port``."""

    def __init__(
        self,
        config: Path,
        model: Path,
        log_dir: Path,
        *,
        env: Mapping[str, str] | None = None,
        vllm_args: Sequence[str] = (),
    ) -> None:
        self.config = Path(config)
        self.model = Path(model)
        self.log_dir = Path(log_dir)
        self.env = dict(env or {})
        self.vllm_args = list(vllm_args)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.log_dir / "serve.log"
        self.startup_s = 0.0  # wall time from spawn until /health answered

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        cmd = [sys.executable, "-m", "hybrid_offload", "serve", "--config", str(self.config)]
        cmd += ["--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port)]
        return cmd + (["--", *self.vllm_args] if self.vllm_args else [])

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start on a free port and wait for /health; raise RuntimeError with the log tail."""
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
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            out.write(f"\n==== {' '.join(self._command())}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,  # its own process group: stop() kills every child
            )
        _alive.add(self)

    def _wait_healthy(self, timeout: float) -> None:
        began = time.monotonic()
        deadline = began + timeout
        while time.monotonic() < deadline:
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

    # ---- HTTP ----------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, timeout: float = 120.0) -> Any:
        """JSON request; raises AssertionError with the reply body on an HTTP error."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{method} {path} -> {exc.code}: {exc.read()[:2000]!r}") from exc
        return json.loads(raw) if raw else None

    def complete(self, prompt: str | list[int], **params: Any) -> dict[str, Any]:
        """POST /v1/completions for this server's model."""
        return self.request("POST", "/v1/completions", {"model": str(self.model), "prompt": prompt, **params})

    def metrics(self) -> Metrics:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=30) as reply:
            return Metrics(reply.read().decode())

    def reset_prefix_cache(self, timeout: float = 30.0) -> None:
        """Drop vLLM's own prefix cache (not the connector's); needs VLLM_SERVER_DEV_MODE=1.

        vLLM refuses (``success: false``) while blocks are held, e.g. by a request that is
        finishing: retried until the deadline.
        """
        deadline = time.monotonic() + timeout
        while True:
            reply = self.request("POST", "/reset_prefix_cache")
            if reply and reply.get("success"):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"/reset_prefix_cache kept failing: {reply}")
            time.sleep(0.1)

    # ---- logs ----------------------------------------------------------------------------
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 120) -> str:
        """The last ``lines`` of the server log, without vLLM's route listing."""
        kept = [line for line in self.log().splitlines() if "Route: " not in line]
        return "\n".join(kept[-lines:])

    @contextlib.contextmanager
    def log_on_failure(self) -> Iterator[None]:
        """Attach the server log tail to any exception raised in the block."""
        try:
            yield
        except BaseException as exc:
            exc.add_note(f"---- server log ({self.log_path}), last lines ----\n{self.log_tail()}")
            raise


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def start_serve(
    config: Path,
    model: Path,
    log_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    vllm_args: Sequence[str] = (),
) -> ServeProcess:
    """A started, healthy server; the caller must ``stop()`` it."""
    server = ServeProcess(config, model, log_dir, env=env, vllm_args=vllm_args)
    server.start()
    return server


@atexit.register
def _kill_all() -> None:
    for server in list(_alive):
        server.stop()
