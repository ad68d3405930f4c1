"""The vLLM connector: ``kv_connector_module_path="hybrid_offload.connector"``,
``kv_connector="HybridOffloadConnector"`` (our backends), or ``"MultiConnector"`` (ours composed
with the foreign connectors of ``connectors``; configs written for vLLM's MultiConnector switch
by changing the module path).

Both classes (:mod:`.facade`, :mod:`.composite`) import vLLM; they are loaded on first access
to their names here, so the submodules that do not need vLLM (``config``, ``policy``, ...) import
without it (the cache CLI reads connector configs, and pays no vLLM import).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybrid_offload.connector.composite import MultiConnector
    from hybrid_offload.connector.facade import ACTIVE_CONNECTORS, HybridOffloadConnector

__all__ = ["ACTIVE_CONNECTORS", "HybridOffloadConnector", "MultiConnector"]


def __getattr__(name: str) -> Any:
    if name == "MultiConnector":
        from hybrid_offload.connector import composite

        return composite.MultiConnector
    if name in __all__:
        from hybrid_offload.connector import facade

        return getattr(facade, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
