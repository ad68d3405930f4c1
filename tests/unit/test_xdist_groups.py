"""``--dist loadgroup`` (the Makefile's) keeps an ``xdist_group`` on one worker, so that the
module fixtures the e2e tests share (engine runs) run once: ``tests/xdist_groups.py`` makes the
groups take effect on pytest 9.2 (pytest-dev/pytest-xdist#1386)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS_DIR)!r})
from xdist_groups import pytest_collection_modifyitems  # noqa: F401
"""

GROUPED = """
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("shared")


@pytest.fixture(scope="module")
def shared():
    with open(Path(__file__).with_name("fixture.log"), "a") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")


@pytest.mark.parametrize("i", range(8))
def test_uses_the_shared_fixture(shared, i):
    pass
"""

OTHERS = """
import time

import pytest


@pytest.mark.parametrize("i", range(8))
def test_elsewhere(i):
    time.sleep(0.05)
"""


def test_a_group_runs_on_one_worker_with_its_module_fixture_once(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_others.py").write_text(OTHERS)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         "-rA", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "test_uses_the_shared_fixture[0]@shared" in run.stdout, run.stdout[-3000:]
    workers = (tmp_path / "fixture.log").read_text().split()
    assert len(workers) == 1, f"the group's module fixture ran on {workers}"
