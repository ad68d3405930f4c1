"""The vLLM connector: ``kv_connector_module_path="hybrid_offload.connector"``,
``kv_connector="HybridOffloadConnector"`` (or ``"MultiConnector"``, for configs written for
vLLM's MultiConnector).

The facade (:mod:`hybrid_offload.connector.facade`) imports vLLM; it is loaded on first access
to its names here, so the submodules that do not need vLLM (``config``, ``policy``, ...) import
without it (the cache CLI reads connector configs, and pays no vLLM import).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybrid_offload.connector.facade import (
        ACTIVE_CONNECTORS,
        HybridOffloadConnector,
        MultiConnector,
    )

__all__ = ["ACTIVE_CONNECTORS", "HybridOffloadConnector", "MultiConnector"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hybrid_offload.connector import facade

        return getattr(facade, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
