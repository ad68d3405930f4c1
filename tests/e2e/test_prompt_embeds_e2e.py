"""End to end (issue 44): a prompt given as embeddings is served from the cache, from its own
pages only.

vLLM holds token id 0 at every position of a prompt given as embeddings (``prompt_embeds``), so
pages keyed by token ids alone would serve one embedded prompt another's KV and state; ours are
keyed by the embeddings too (:mod:`~hybrid_offload.connector.scheduler.extras`). One connector
engine (vLLM's default multi-process engine, falcon_h1 in float32, ``enable_prompt_embeds``,
vLLM's own prefix cache emptied before every request) runs two passes over:

* ``embedded``: a prompt of arbitrary length given as embeddings (the model's own rows of some
  token ids);
* ``nudged``: the same embeddings with one row in the middle shifted (as many positions, all 0);
* ``ids``: those token ids as ids.

In the first pass ``nudged`` comes right after ``embedded`` was stored: nothing from the shifted
row's chunk on may be served. In the second pass each is served its own stored prefix, and the
greedy tokens equal the first pass's, where nothing was loaded.
"""

from __future__ import annotations

import random
import re

import pytest

from hybrid_offload.testing.session import run_session_subprocess

pytestmark = pytest.mark.e2e


def test_a_prompt_given_as_embeddings_is_served_from_its_own_pages_only(model_dir) -> None:
    rng = random.Random(23)
    ids = [rng.randrange(3, 1000) for _ in range(rng.randint(600, 900))]
    shifted = rng.randint(len(ids) // 3, 2 * len(ids) // 3)
    prompts = [{"embeds_of": ids}, {"embeds_of": ids, "nudge_rows": [shifted]}, ids]
    result = run_session_subprocess(
        {
            "model": str(model_dir("falcon_h1")), "prompts": prompts, "passes": 2, "max_tokens": 8,
            "reset_prefix_cache": "request", "warmup": False,
            "connector": {"backends": [{"type": "cpu", "name": "cpu", "capacity_bytes": "512MiB"}]},
            "llm_kwargs": {"dtype": "float32", "enable_prompt_embeds": True},
        },
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )  # fmt: skip
    chunk = int(re.findall(r"chunk_tokens=(\d+)", result["log"])[0])
    first, second = (p["requests"] for p in result["passes"])
    embedded, nudged, as_ids = first
    assert embedded["cached_tokens"] == 0  # a cold cache
    assert nudged["cached_tokens"] <= shifted // chunk * chunk, (nudged, shifted, chunk)
    assert as_ids["cached_tokens"] == 0  # its positions hold ids, not 0s: no page of the others
    whole = (len(ids) - 1) // chunk * chunk
    for name, row in zip(("embedded", "nudged", "ids"), second, strict=True):
        assert row["cached_tokens"] >= 0.9 * whole, (name, row, whole)
    assert [r["tokens"] for r in second] == [r["tokens"] for r in first]
