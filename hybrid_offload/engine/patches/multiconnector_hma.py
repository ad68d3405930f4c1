"""Patch: vLLM asks our composing connector, not its own MultiConnector, whether HMA stays on.

vLLM decides whether the hybrid KV cache manager (HMA) stays on from
`KVConnectorFactory.supports_hma_config`, which for `kv_connector: "MultiConnector"` asks vLLM's
own MultiConnector about the `connectors` list, whatever the module path. With our module path
(`kv_connector_module_path: "hybrid_offload.connector"`) that name selects our
`HybridMultiConnector` (composing our backends with foreign connectors), and there vLLM's check
is wrong three ways: it turns HMA off for a config with only native `backends` (hybrids then
fail to start), it fails on our child keys `name` / `load_weight`, and for a child without HMA
support it gives vLLM's generic "Failed to promote" error instead of ours naming the child. So
for that name with our module path the answer is our class's (it supports HMA, and checks each
child itself); every other config, `kv_connector: "HybridMultiConnector"` included, gets vLLM's
own answer, which is already right for it.
"""

from __future__ import annotations

import functools
from typing import Any

from hybrid_offload.compat import VLLM_RELEASES
from hybrid_offload.engine.patches import is_patched, mark, version_supported

ENTRY_POINT = "hybrid_offload_multiconnector_hma"
VLLM_VERSIONS = VLLM_RELEASES
CONNECTOR_MODULE = "hybrid_offload.connector"
#: the name vLLM's check treats specially; our module exports HybridMultiConnector under it
VLLM_NAME = "MultiConnector"


def register() -> None:
    """Patch `KVConnectorFactory.supports_hma_config` (every platform)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    current = KVConnectorFactory.supports_hma_config
    if not version_supported(
        ENTRY_POINT, VLLM_VERSIONS,
        'kv_connector "MultiConnector" with our module path may start without HMA or be refused '
        '(kv_connector "HybridMultiConnector" needs no patch)',
    ) or is_patched(current):
        return
    original = current.__func__  # type: ignore[attr-defined]  # a bound classmethod

    @functools.wraps(original)
    def supports_hma_config(cls: Any, kv_transfer_config: Any) -> bool:
        if (kv_transfer_config.kv_connector == VLLM_NAME
                and kv_transfer_config.kv_connector_module_path == CONNECTOR_MODULE):
            return supports_hma(cls.get_connector_class(kv_transfer_config))
        return original(cls, kv_transfer_config)

    KVConnectorFactory.supports_hma_config = classmethod(mark(supports_hma_config))  # type: ignore[assignment]
