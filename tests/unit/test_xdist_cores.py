"""Each xdist worker's engines get cores of their own (``tests/xdist_cores.py``): two workers'
OpenMP threads spinning over the same cores made the suite's engines up to 7x slower."""

from __future__ import annotations

import os

import pytest
from xdist_cores import cores_of_worker, one_core_set_per_worker


@pytest.mark.parametrize(("workers", "cpus", "want"), [
    (2, [0, 1], [[0], [1]]),
    (2, [0, 1, 2, 3], [[0, 1], [2, 3]]),
    (3, [4, 5, 6, 7], [[4], [5], [6]]),
    (4, [0, 1], [[0], [1], [0], [1]]),
])  # fmt: skip
def test_workers_split_the_cores(workers: int, cpus: list[int], want: list[list[int]]) -> None:
    assert [cores_of_worker(f"gw{i}", workers, cpus) for i in range(workers)] == want


def test_the_split_is_written_as_defaults_only_under_xdist() -> None:
    env = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}
    assert one_core_set_per_worker(env, cpus=[0, 1]) == [1]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert "OMP_WAIT_POLICY" not in env  # each worker has a core of its own: nothing spins on it

    chosen = {"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "2", "OMP_NUM_THREADS": "2"}
    assert one_core_set_per_worker(chosen, cpus=[0, 1]) == [0]
    assert chosen["OMP_NUM_THREADS"] == "2"  # the environment's own setting wins

    shared = {"PYTEST_XDIST_WORKER": "gw2", "PYTEST_XDIST_WORKER_COUNT": "3"}
    assert one_core_set_per_worker(shared, cpus=[0, 1]) == [0]
    assert shared["OMP_WAIT_POLICY"] == "PASSIVE"

    for alone in ({}, {"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "1"}):
        assert one_core_set_per_worker(alone, cpus=[0, 1]) is None and "OMP_NUM_THREADS" not in alone


def test_this_worker_computes_on_its_own_cores() -> None:
    """Under ``make test`` (``-n 2``) the suite's conftest applied the split before torch
    loaded: torch in this worker computes on its share of the cores."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or workers < 2:
        pytest.skip("not an xdist worker of two or more")
    import torch

    mine = cores_of_worker(worker, workers, sorted(os.sched_getaffinity(0)))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, mine))
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"]) == len(mine)
