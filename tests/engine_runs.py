"""Helpers for tests that run real vLLM engines (importable as ``engine_runs``).

Prompts share chunk-aligned prefixes; results come from :mod:`hybrid_offload.testing.session`.
"""

from __future__ import annotations

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
