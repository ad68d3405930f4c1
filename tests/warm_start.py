"""Engine processes started from an interpreter that has vLLM imported already (importable as
``warm_start``; tests/conftest.py installs :func:`launch` as ``hybrid_offload.testing.session.launch``).

Every engine run of the suite is ``python -m MODULE spec out`` in a process of its own (one
engine lifetime is one process), and ~7 s of each is that process importing vLLM, torch and
transformers before the engine starts. Here each pytest worker keeps one *warm* interpreter
(``python warm_start.py``): it imports them once, then forks a child per run, which sets the
run's environment, output and arguments and runs the module as ``__main__``, as ``python -m``
would. The engine then starts as it would anyway: vLLM spawns its EngineCore and workers as
fresh interpreters. The warm interpreter never computes (no thread pool of torch's to lose in a
fork); it reaps its children (and, as their subreaper, the processes they leave behind) and
writes each one's exit code into a file; the waiting test returns once that file is there and
no process of the run's process group is left, as ``subprocess.run`` returns once every process
holding the run's output has closed it (an engine's workers may still be writing their stores
when the run's own process has ended).

A run whose environment differs from the warm interpreter's in a variable read at import
(:data:`READ_AT_IMPORT`: torch's OpenMP, Hugging Face's offline mode, ``PYTHONPATH``), or any
run while the warm interpreter is not up, gets a fresh interpreter instead
(:func:`hybrid_offload.testing.session.fresh_interpreter`).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import IO, Any

from hybrid_offload.testing.deadlines import wait_until

#: imported once by the warm interpreter: what the engine-running modules import
PRELOAD = ("vllm", "vllm.entrypoints.llm", "hybrid_offload.testing.session",
           "hybrid_offload.tools.bench.workload_run", "hybrid_offload.testing.vision_session")  # fmt: skip
PR_SET_CHILD_SUBREAPER = 36
#: variables read when a module is imported or a library loaded, by what the warm interpreter
#: imports: OpenMP's and the math libraries' threads, Hugging Face's offline mode, Python's own,
#: vLLM's logging. A run whose environment differs in one of them starts fresh.
READ_AT_IMPORT = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_",
                  "TOKENIZERS_", "PYTHON", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_")  # fmt: skip


def warm_env() -> dict[str, str]:
    """The warm interpreter's environment: this process's plus what every engine run sets
    besides ``VLLM_*`` (offline Hugging Face, no tokenizer threads)."""
    from hybrid_offload.testing.session import ENGINE_ENV

    return {**os.environ, **{k: v for k, v in ENGINE_ENV.items() if not k.startswith("VLLM_")}}


Env = dict[str, str]


def blocking_fork(env: Env, warm: Env) -> set[str]:
    """The variables that keep a run with ``env`` from forking from an interpreter started with
    ``warm``: those :data:`READ_AT_IMPORT` whose values differ. (Others may: ``VLLM_*`` settings
    are read when an engine starts, and what imports or vLLM's CPU platform write into this
    process's environment, the run's own process writes again.)"""
    differing = {k for k in env.keys() | warm.keys() if env.get(k) != warm.get(k)}
    return {k for k in differing if k.startswith(READ_AT_IMPORT)}


def forkable(env: Env, warm: Env) -> bool:
    """Whether nothing keeps a run with ``env`` from forking (:func:`blocking_fork`)."""
    return not blocking_fork(env, warm)


class WarmInterpreter:
    """One warm interpreter and the runs forked from it (thread-safe)."""

    def __init__(self, env: dict[str, str] | None = None, preload: tuple[str, ...] = PRELOAD) -> None:
        self.env = warm_env() if env is None else env
        self.preload = preload
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="hybrid-offload-warm-")
        self._runs = 0

    def start(self) -> subprocess.Popen[str] | None:
        """The warm interpreter, started (and its imports done) on the first call; None when down."""
        if self._proc is None:
            with open(Path(self._dir.name, "warm.log"), "w") as log:  # its own output: imports' warnings
                argv = [sys.executable, __file__, ",".join(self.preload)]
                pipe = subprocess.PIPE
                self._proc = subprocess.Popen(argv, env=self.env, stdin=pipe, stdout=pipe, stderr=log,
                                              text=True)  # fmt: skip
            assert self._proc.stdout is not None
            if self._proc.stdout.readline().strip() != "ready":
                self._proc.kill()
        return self._proc if self._proc.poll() is None else None

    @property
    def pid(self) -> int | None:
        """The warm interpreter's pid, once started."""
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        """Stop the warm interpreter (runs forked from it go on)."""
        if self._proc is not None and self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
        self._dir.cleanup()

    def _fork(self, request: dict[str, Any]) -> int | None:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        reply = proc.stdout.readline().strip()
        return int(reply) if reply.isdigit() else None

    def launch(self, args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
        """:data:`hybrid_offload.testing.session.Launch`: forked when :func:`forkable`."""
        from hybrid_offload.testing.session import fresh_interpreter

        pid = None
        with self._lock:
            warm = args[:1] == ["-m"] and self.start() is not None
            if warm and forkable(env, self.env):
                self._runs += 1
                base = Path(self._dir.name, f"run-{self._runs}")
                request = {"module": args[1], "args": args[2:], "env": env, "cwd": os.getcwd(),
                           "output": f"{base}.log", "status": f"{base}.status"}  # fmt: skip
                pid = self._fork(request)
        if pid is None:  # not a module, an environment the warm interpreter cannot give, or it is down
            return fresh_interpreter(args, env, timeout)
        status = Path(request["status"])
        try:  # as subprocess.run: until every holder of its output is gone
            wait_until(lambda: status.exists() and _group_gone(pid), f"run {pid} ended", timeout_s=timeout,
                       poll_s=0.2)  # fmt: skip
        except AssertionError:
            os.killpg(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(["python", *args], timeout) from None
        return int(status.read_text()), Path(request["output"]).read_text(errors="replace")


def _group_gone(pgid: int) -> bool:
    """Whether no process of the run's process group is left (an engine's worker processes may
    outlive the run's own, finishing their stores; the warm interpreter reaps them)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


# ---- the warm interpreter (``python warm_start.py``) -------------------------------------------------


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python -m module args`` with the request's environment."""
    code = 1
    try:
        # a process group of its own: the test's timeout kills the engine's processes too. Not a
        # session of its own: under the kernel's autogroup scheduling each session shares the CPU
        # as one, so runs would get the CPU differently from fresh ones, which stay in the test's.
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        sys.stdin = open(0)  # noqa: SIM115 - the process's own streams, for its life
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


def _reap(statuses: dict[int, str]) -> None:
    """Write the exit code of every ended run to its status file; drop what a run left behind
    (reaped here as their subreaper). Only the request loop reaps, so a run's pid is registered
    before it can be reaped."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = statuses.pop(pid, None)
        if path is not None:
            Path(f"{path}.tmp").write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(f"{path}.tmp", path)


def serve(preload: list[str], requests: IO[str], replies: IO[str]) -> None:
    """Import ``preload``, say ``ready``, then fork a child per request line (JSON) and reply its
    pid; write each child's exit code to its ``status`` file once it ends. Returns at EOF."""
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # runs' orphans are reaped here
    before = dict(os.environ)
    for name in preload:
        importlib.import_module(name)
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    statuses: dict[int, str] = {}
    replies.write("ready\n")
    replies.flush()
    while True:
        try:
            ready, _, _ = select.select([requests, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(statuses)
        if requests in ready:
            line = requests.readline()
            if not line:
                return
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _run_child({**request, "env": {**set_by_imports, **request["env"]}})
            statuses[pid] = request["status"]
            replies.write(f"{pid}\n")
            replies.flush()


if __name__ == "__main__":
    serve(sys.argv[1].split(","), sys.stdin, sys.stdout)
    os._exit(0)  # no finalization: nothing is left to flush, and triton's bindings report leaks
