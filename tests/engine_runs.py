"""Helpers for tests that run real vLLM engines (importable as ``engine_runs``).

Prompts share chunk-aligned prefixes; results come from :mod:`hybrid_offload.testing.session`.

Shared reference engines: a test that compares with an engine without the connector declares
its prompts at its module's top level (:func:`reference`) and gets that engine's result from the
``reference_run`` fixture (tests/conftest.py). Every reference declared with the same arch and
engine settings (:attr:`Reference.engine`) runs in one engine, once per xdist worker, the first
time a test asks for one of them; identical declarations are one. Who shares which:

* falcon_h1, 12 tokens: ``shared_prefix_prompts(128)`` of test_connector_e2e.py (its
  ``test_cpu_then_disk_after_restart[falcon_h1]``) and test_foreign_connectors_e2e.py
  (``test_child_with_higher_weight_loads_and_output_is_unchanged``);
* falcon_h1, 8 tokens: test_bad_config_e2e.py (seed 4), test_shared_tier_faults_e2e.py (seeds 2
  and 3: ``test_server_killed_and_restarted_mid_run[falcon_h1-redis]``,
  ``test_hung_peer_is_bounded_by_its_timeout_and_used_again_after``) and
  test_disk_faults_e2e.py (its ``documents()``);
* qwen3_next, 12 tokens: test_connector_e2e.py (both tests of qwen3_next) and
  test_shared_backends_e2e.py (seed 1); 8 tokens: test_shared_tier_faults_e2e.py (seed 2);
* qwen3_5 (both its tests), llama and lfm2 (float32, logprobs), 12 tokens: test_connector_e2e.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from hybrid_offload.testing.deadlines import wait_until

#: the default chunk sizes of the archs the e2e tests run
CHUNK_TOKENS = {"qwen3_next": 128, "qwen3_5": 128, "falcon_h1": 128, "llama": 256, "lfm2": 128}
VOCAB = 2048


def shared_prefix_prompts(chunk: int, seed: int = 0, chunks: int = 3) -> list[list[int]]:
    """Two documents of ``chunks`` chunks and a few tokens, each followed by two short questions.

    The recomputed tail after the last chunk boundary stays short (5 and 33 tokens), so the
    loaded Mamba/GDN state decides the output.
    """
    rng = random.Random(seed)
    prompts = []
    for _ in range(2):
        doc = [rng.randrange(3, VOCAB) for _ in range(chunks * chunk + 4)]
        for n in (1, 29):
            prompts.append(doc + [rng.randrange(3, VOCAB) for _ in range(n)])
    return prompts


@dataclasses.dataclass(frozen=True)
class Reference:
    """Prompts that a test compares with an engine without the connector (one pass, one request
    at a time, vLLM's prefix cache reset before each), and that engine's settings."""

    arch: str
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    #: the session spec's ``logprobs`` and ``llm_kwargs`` (JSON)
    settings: str

    @property
    def engine(self) -> tuple[str, int, str]:
        """References with the same engine run in one."""
        return (self.arch, self.max_tokens, self.settings)

    def spec(self, model: Path, prompts: list[list[int]]) -> dict[str, Any]:
        """The session spec of this reference's engine running ``prompts``."""
        settings = json.loads(self.settings)
        extra = {"logprobs": settings["logprobs"]} if settings["logprobs"] is not None else {}
        return {"model": str(model), "prompts": prompts, "max_tokens": self.max_tokens, "passes": 1,
                "reset_prefix_cache": "request", "connector": None, "llm_kwargs": settings["llm_kwargs"],
                **extra}  # fmt: skip


#: every reference declared so far: test modules declare theirs when imported (collected)
DECLARED: list[Reference] = []


def reference(arch: str, prompts: list[list[int]], *, max_tokens: int, logprobs: int | None = None,
              dtype: str = "bfloat16") -> Reference:  # fmt: skip
    """Declare ``prompts`` as compared with an engine of ``arch`` without the connector; call it
    at a module's top level, so that the first test asking ``reference_run`` for any reference
    of the same engine gets them all run at once."""
    ref = Reference(arch, tuple(map(tuple, prompts)), max_tokens,
                    json.dumps({"logprobs": logprobs, "llm_kwargs": {"dtype": dtype}}, sort_keys=True))
    if ref not in DECLARED:
        DECLARED.append(ref)
    return ref


def tokens(result: dict[str, Any], index: int) -> list[list[int]]:
    """Output token ids of every request of pass ``index``."""
    return [r["tokens"] for r in result["passes"][index]["requests"]]


def hit_rate(result: dict[str, Any], index: int, backend: str) -> float:
    """Tokens loaded from ``backend`` in pass ``index`` / the chunk-aligned prompt tokens."""
    sched = result["passes"][index]["scheduler"]
    loaded = sched["backends"].get(backend, {}).get("loaded_tokens", 0)
    return loaded / sched["aligned_prompt_tokens"]


def wait_for_pass(barrier: Path, index: int, session: Future, timeout: float = 600.0) -> None:
    """Block until a session with ``pass_barrier=barrier`` finished pass ``index``."""
    done = barrier / f"pass-{index}.done"

    def finished() -> bool:
        if not done.exists() and session.done():
            session.result()  # raises the session's failure
            raise AssertionError(f"session ended before pass {index} finished")
        return done.exists()

    wait_until(finished, f"pass {index} finished", timeout_s=timeout, poll_s=0.1)


def release_pass(barrier: Path, index: int) -> None:
    """Let a session waiting after pass ``index`` go on."""
    (barrier / f"pass-{index}.go").touch()


def two_core_env(what: str) -> dict[str, str]:
    """The environment for an engine of two ranks or stages (``what``) on vLLM's CPU build: one
    core each (``VLLM_CPU_OMP_THREADS_BIND``); skips the test on a one-core machine."""
    import pytest

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"vLLM CPU binds each of {what} to its own core; this machine has one")
    return {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}
