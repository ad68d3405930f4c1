"""Each xdist worker's engines compute on cores of their own (importable as ``xdist_cores``;
tests/conftest.py applies it when it is imported, before anything loads torch).

vLLM's CPU build runs an engine's forward pass on OpenMP threads, one per core it binds
(``VLLM_CPU_OMP_THREADS_BIND=auto``: every core) or, in-process, as many as ``OMP_NUM_THREADS``
says (default: every core). Between parallel regions, libgomp's threads spin at a barrier
before they sleep. Two xdist workers each running an engine over the same cores therefore spin
against each other's compute: measured on the 2-core VM, the preemption e2e's two engines took
14 + 33 s alone and 60 + 299 s with the same run beside them (binding both engines to distinct
cores or not). Given one core each, the pair took 16 + 32 s beside each other, and alone one
core is as fast as two for these tiny models.

:func:`cores_of_worker` splits the cores among the workers and :func:`one_core_set_per_worker`
writes the split where engines and torch read it: ``VLLM_CPU_OMP_THREADS_BIND`` for
multi-process engines (vLLM sets the worker's ``OMP_NUM_THREADS`` and places from it) and
``OMP_NUM_THREADS`` for in-process engines and torch in the pytest worker. Settings already in
the environment win; a test that needs two cores names them (``engine_runs.two_core_env``).
With more workers than cores, workers share cores and ``OMP_WAIT_POLICY=PASSIVE`` stops the
spinning at some cost to each engine (measured: 1.4x alone).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping, Sequence


def cores_of_worker(worker: str, workers: int, cpus: Sequence[int]) -> list[int]:
    """The cores xdist worker ``worker`` (``"gw<i>"``) of ``workers`` computes on: an equal
    share of ``cpus``, or one core shared with others where the workers outnumber them."""
    index = int(worker.removeprefix("gw"))
    share = len(cpus) // workers
    if share == 0:
        return [cpus[index % len(cpus)]]
    return list(cpus[index * share : (index + 1) * share])


def one_core_set_per_worker(environ: MutableMapping[str, str] | None = None,
                            cpus: Sequence[int] | None = None) -> list[int] | None:  # fmt: skip
    """Write this xdist worker's cores into ``environ`` (default ``os.environ``) as the defaults
    of the thread settings above, and return them; None outside xdist or with one worker."""
    env = os.environ if environ is None else environ
    worker, workers = env.get("PYTEST_XDIST_WORKER"), int(env.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or workers < 2:
        return None
    available = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    mine = cores_of_worker(worker, workers, available)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, mine)))
    env.setdefault("OMP_NUM_THREADS", str(len(mine)))
    if workers > len(available):
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return mine
