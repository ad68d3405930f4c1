"""Engine runs forked from a warm interpreter (``tests/warm_start.py``) get their own
environment, arguments, output and exit code, are killed with their process group at their
timeout, and a run whose environment the warm interpreter cannot give starts fresh."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from warm_start import WarmInterpreter, blocking_fork, forkable

from hybrid_offload.testing.deadlines import wait_until

CHILD = """
import os, subprocess, sys, time
print("parent", os.getppid(), "var", os.environ.get("VLLM_PROBE"), "args", sys.argv[1:], "main", __name__,
      "group_leader", os.getpgid(0) == os.getpid(), "session", os.getsid(0))
if sys.argv[1] == "sleep":  # and a process of its own (an engine's EngineCore, say)
    grandchild = subprocess.Popen(["sleep", "120"])
    open(sys.argv[2], "w").write(f"{os.getpid()} {grandchild.pid}")
    time.sleep(120)
if sys.argv[1] == "orphan":  # leaves a process behind that writes on after the run's own ended
    subprocess.Popen(["sh", "-c", f"sleep 2; echo late; touch {sys.argv[2]}"])
    sys.exit(0)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def warm(tmp_path: Path):
    (tmp_path / "probe_child.py").write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    interpreter = WarmInterpreter(env=env, preload=("json",))
    yield interpreter
    interpreter.close()


def test_a_forked_run_gets_its_environment_arguments_output_and_exit_code(warm: WarmInterpreter) -> None:
    """In a process group of its own (killed as one), in the test's session as a fresh run is
    (under autogroup scheduling a session shares the CPU as one)."""
    code, out = warm.launch(["-m", "probe_child", "3"], {**warm.env, "VLLM_PROBE": "x"}, timeout=60)
    assert code == 3
    assert out.split() == ["parent", str(warm.pid), "var", "x", "args", "['3']", "main", "__main__",
                           "group_leader", "True", "session", str(os.getsid(0))]  # fmt: skip


def test_a_run_ends_when_the_processes_it_left_behind_end(warm: WarmInterpreter, tmp_path: Path) -> None:
    """As ``subprocess.run`` waits for every holder of the output: an engine's worker processes
    finish their stores after the run's own process has ended."""
    marker = tmp_path / "written"
    code, out = warm.launch(["-m", "probe_child", "orphan", str(marker)], warm.env, timeout=60)
    assert code == 0 and marker.exists() and out.split()[-1] == "late"


def test_an_environment_the_warm_interpreter_cannot_give_starts_fresh(warm: WarmInterpreter) -> None:
    env = {**warm.env, "OMP_NUM_THREADS": "7"}
    assert not forkable(env, warm.env)
    code, out = warm.launch(["-m", "probe_child", "0"], env, timeout=60)
    assert code == 0 and out.split()[:2] == ["parent", str(os.getpid())]


def test_a_run_past_its_timeout_is_killed_with_its_group(warm: WarmInterpreter, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        warm.launch(["-m", "probe_child", "sleep", str(pid_file)], warm.env, timeout=3)
    pids = [int(pid) for pid in pid_file.read_text().split()]
    wait_until(lambda: all(map(gone, pids)), "the run and its own process gone", timeout_s=30, poll_s=0.1)


def gone(pid: int) -> bool:
    """No such process, or only its exit status left (a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_settings_read_at_import_start_fresh_others_fork() -> None:
    warm = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    assert forkable({**warm, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, warm)
    assert forkable({**warm, "PYTEST_CURRENT_TEST": "tests/e2e/test_x.py::test_y (call)"}, warm)
    assert forkable({**warm, "LD_PRELOAD": "libtcmalloc_minimal.so.4", "NUMEXPR_MAX_THREADS": "2"}, warm)
    assert blocking_fork({**warm, "VLLM_LOGGING_LEVEL": "DEBUG", "OMP_NUM_THREADS": "2"}, warm) == {
        "VLLM_LOGGING_LEVEL", "OMP_NUM_THREADS"}
    assert not forkable({**warm, "HF_HUB_OFFLINE": "0"}, warm)
    assert not forkable({k: v for k, v in warm.items() if k != "HF_HUB_OFFLINE"}, warm)
    assert not forkable({**warm, "PYTHONPATH": "/elsewhere"}, warm)


def test_the_suite_runs_engines_through_its_warm_interpreter() -> None:
    """Inside a test, with the environment every engine run adds, after whatever tests this
    worker ran before (vLLM's CPU platform and imports write variables into the environment)."""
    from hybrid_offload.testing import session

    warm = getattr(session.launch, "__self__", None)
    assert isinstance(warm, WarmInterpreter), session.launch
    assert warm.start() is not None
    assert blocking_fork({**os.environ, **session.ENGINE_ENV}, warm.env) == set()

