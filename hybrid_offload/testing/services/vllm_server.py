"""Real vLLM OpenAI-compatible servers on loopback, and their Prometheus ``/metrics``.

Contract: :class:`ServeProcess` runs ``python -m hybrid_offload serve --config C --model M``
(or, with ``config=None``, plain vLLM: ``python -m vllm.entrypoints.openai.api_server``, no
connector) on a free loopback port in its own session (process group), with ``env`` added to
this process's environment and ``vllm_args`` passed to vLLM. ``start()`` returns once
``GET /health`` answers, or raises RuntimeError with the tail of the server log (a port lost
to another process is retried on another). ``stop()`` kills the whole group (API server,
EngineCore, workers): SIGTERM, then SIGKILL after a short grace. The log file is appended to
across restarts; ``with server.log_on_failure():`` adds its tail to any exception raised in
the block. HTTP goes through ``urllib``; :class:`Metrics` parses Prometheus text.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hybrid_offload.testing.services.common import Service, free_port, stop_process_group, wait_ready

__all__ = ["API_SERVER_MODULE", "Metrics", "ServeProcess", "fetch_metrics", "start_serve"]

logger = logging.getLogger(__name__)

#: vLLM's OpenAI-compatible server, run as ``python -m``
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
START_TIMEOUT_S = 240.0
STOP_GRACE_S = 5.0
_PORT_ATTEMPTS = 3
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


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
            with contextlib.suppress(ValueError):
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


class ServeProcess(Service):
    """One vLLM OpenAI server process group on ``127.0.0.1:port`` (see the module docstring).

    ``config`` is a ``hybrid-offload serve`` config file, or None for plain vLLM. The log is
    ``log_path``; ``startup_s`` is the wall time of the last start until /health answered.
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

    def command(self) -> list[str]:
        """The argv of the server on ``self.port``."""
        where = ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.config is None:
            argv = [sys.executable, "-m", API_SERVER_MODULE, "--model", str(self.model), *where]
            return argv + self.vllm_args
        argv = [sys.executable, "-m", "hybrid_offload", "serve", "--config", str(self.config)]
        argv += ["--model", str(self.model), *where]
        return argv + (["--", *self.vllm_args] if self.vllm_args else [])

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start on a free port and wait for /health; RuntimeError (with the log tail) if not."""
        for attempt in range(_PORT_ATTEMPTS):
            self.port = free_port()
            self._spawn()
            began = time.monotonic()
            try:
                assert self.proc is not None
                wait_ready(
                    f"vLLM server on port {self.port}",
                    self.proc,
                    lambda: _healthy(self.base_url),
                    self.log_tail,
                    timeout_s=timeout,
                    interval_s=0.25,
                )
            except RuntimeError:
                lost_port = "address already in use" in self.log().lower()
                self.stop()
                if not lost_port or attempt == _PORT_ATTEMPTS - 1:
                    raise
            else:
                self.startup_s = time.monotonic() - began
                return

    def _spawn(self) -> None:
        argv = self.command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            out.write(f"\n==== {' '.join(argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,  # its own process group: stop() kills every child
            )
        self._track()
        logger.info("server pid %d on port %d: %s", self.proc.pid, self.port, self.log_path)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after a grace period; reap. Idempotent."""
        proc, self.proc = self.proc, None
        self._untrack()
        if proc is not None:
            stop_process_group(proc, STOP_GRACE_S)

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
        return fetch_metrics(self.base_url)

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

    def __repr__(self) -> str:
        return f"ServeProcess(port={self.port}, pid={self.pid}, log={self.log_path})"


def start_serve(
    config: Path,
    model: Path,
    log_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    vllm_args: Sequence[str] = (),
    timeout: float = START_TIMEOUT_S,
) -> ServeProcess:
    """A started, healthy ``hybrid-offload serve`` logging to ``log_dir/serve.log``.

    The caller must ``stop()`` it (or use ``with``).
    """
    server = ServeProcess(model, Path(log_dir) / "serve.log", config=config, env=env, vllm_args=vllm_args)
    server.start(timeout)
    return server
