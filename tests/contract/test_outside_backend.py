"""The contract suite is a kit: a backend written outside this repository runs it.

A third party's project is written into ``tmp_path`` (a dict-backed backend in its own package,
a test module subclassing :class:`~hybrid_offload.testing.backend_contract.BackendContract` in a
few lines, a ``conftest.py``) and pytest runs it in a child process, with nothing of ``tests/``
on its path: the backend passes the suite, and a variant whose ``get_batch`` returns wrong bytes
fails it, so the suite catches a broken backend.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

BACKEND = '''\
"""A third party's backend: pages in a dict, the least recently used evicted first."""

import threading
from collections import OrderedDict

from hybrid_offload.backends import Backend


class DictBackend(Backend):
    type_name = "dict"
    shared_index = False  # pages live in this process: the connector mirrors its index

    def __init__(self, config):
        super().__init__(config)
        self._lock = threading.Lock()
        self._pages = OrderedDict()  # key -> bytes, least recently used first
        self._used = 0
        self._gone = []  # evicted or deleted since take_evicted()

    def _put_batch(self, items):
        stored = []
        with self._lock:
            for key, buf in items:
                data = bytes(buf)
                if len(data) > self.capacity_bytes:
                    self.stats.put_refused += 1
                    stored.append(False)
                    continue
                self._used -= len(self._pages.pop(key, b""))
                while self._used + len(data) > self.capacity_bytes:
                    old_key, old = self._pages.popitem(last=False)
                    self._used -= len(old)
                    self._gone.append(old_key)
                    self.stats.evictions += 1
                    self.stats.evicted_bytes += len(old)
                self._pages[key] = data
                self._used += len(data)
                self.stats.puts += 1
                self.stats.put_bytes += len(data)
                stored.append(True)
        return stored

    def _get_batch(self, keys):
        with self._lock:
            found = [self._pages.get(key) for key in keys]
            for key, data in zip(keys, found):
                if data is not None:
                    self._pages.move_to_end(key)
            self.stats.gets += len(keys)
            self.stats.hits += sum(data is not None for data in found)
            self.stats.get_bytes += sum(len(data) for data in found if data is not None)
        return found

    def _contains_batch(self, keys):
        with self._lock:
            return [key in self._pages for key in keys]

    def _delete_batch(self, keys):
        deleted = 0
        with self._lock:
            for key in keys:
                data = self._pages.pop(key, None)
                if data is not None:
                    self._used -= len(data)
                    self._gone.append(key)
                    deleted += 1
        return deleted

    def _used_bytes(self):
        with self._lock:
            return self._used

    def take_evicted(self):
        with self._lock:
            gone, self._gone = self._gone, []
        return gone

    def _close(self):
        with self._lock:
            self._pages.clear()
            self._used = 0
'''
#: the broken variant: every page read back reversed
RIGHT_READ = "found = [self._pages.get(key) for key in keys]"
WRONG_READ = "found = [None if (p := self._pages.get(key)) is None else p[::-1] for key in keys]"

TEST_MODULE = """\
from hybrid_offload.backends import BackendConfig, create_backend
from hybrid_offload.testing.backend_contract import BackendContract


class TestDictContract(BackendContract):
    def make_backend(self, tmp_path, capacity_bytes):
        return create_backend(BackendConfig("dict_store.backend:DictBackend", "dict", capacity_bytes))
"""
CONFTEST = """\
import pytest

pytest.register_assert_rewrite("hybrid_offload.testing.backend_contract")
"""


def run_suite(project: Path, backend_source: str) -> subprocess.CompletedProcess[str]:
    """Write the third party's project into ``project`` and run its tests under pytest."""
    (project / "dict_store").mkdir(parents=True)
    (project / "dict_store" / "__init__.py").write_text("")
    (project / "dict_store" / "backend.py").write_text(backend_source)
    (project / "tests").mkdir()
    (project / "tests" / "conftest.py").write_text(CONFTEST)
    (project / "tests" / "test_dict_contract.py").write_text(TEST_MODULE)
    (project / "pytest.ini").write_text("[pytest]\n")  # its own rootdir: none of our config
    # CI set as on CI machines, where pytest does not truncate its diffs of unequal values
    env = {**os.environ, "PYTHONPATH": str(project), "CI": "true"}
    command = [sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", "tests"]
    return subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600)


def counts(output: str) -> dict[str, int]:
    """The summary line's counts: ``{"passed": 43, "skipped": 4, ...}``."""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", output)}


def test_a_backend_written_outside_the_repo_passes_the_suite(tmp_path: Path) -> None:
    result = run_suite(tmp_path / "project", BACKEND)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    got = counts(out.splitlines()[-1])
    assert got.get("passed", 0) >= 30 and "failed" not in got, out[-3000:]
    # only the optional clauses it does not offer are skipped: restarts, a shared index, listing
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert skips and all(re.search(r"restart|shared_index|scan", line) for line in skips), skips


def test_a_backend_returning_wrong_bytes_fails_the_suite(tmp_path: Path) -> None:
    assert RIGHT_READ in BACKEND
    result = run_suite(tmp_path / "project", BACKEND.replace(RIGHT_READ, WRONG_READ))
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-6000:]
    assert re.search(r"FAILED tests/test_dict_contract.py::TestDictContract::test_round_trip_many_pages", out)
    assert counts(out.splitlines()[-1]).get("failed", 0) >= 5, out[-3000:]
    # each failure says in one line where the bytes differ (a pytest diff of pages takes minutes)
    assert re.search(r"pages: \d+ of \d+ differ; first: \[\d+\] differs from byte \d+", out), out[-3000:]
