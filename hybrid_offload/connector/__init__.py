"""The vLLM connectors, loaded with ``kv_connector_module_path="hybrid_offload.connector"``:

- ``kv_connector="HybridOffloadConnector"``: our backends (the facade,
  :mod:`hybrid_offload.connector.facade`);
- ``kv_connector="HybridMultiConnector"``: our backends composed with foreign child connectors
  (``kv_connector_extra_config.connectors``; :mod:`hybrid_offload.connector.composite`), also
  exported as ``MultiConnector``, so a config written for vLLM's MultiConnector switches by
  changing the module path.

Both import vLLM; they are loaded on first access to their names here, so the submodules that
do not need vLLM (``config``, ``policy``, ...) import without it (the cache CLI reads connector
configs, and pays no vLLM import).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybrid_offload.connector.composite import HybridMultiConnector, MultiConnector
    from hybrid_offload.connector.facade import ACTIVE_CONNECTORS, HybridOffloadConnector

__all__ = ["ACTIVE_CONNECTORS", "HybridMultiConnector", "HybridOffloadConnector", "MultiConnector"]
#: exported name -> the submodule that defines it
_LAZY = {
    "ACTIVE_CONNECTORS": "facade",
    "HybridOffloadConnector": "facade",
    "HybridMultiConnector": "composite",
    "MultiConnector": "composite",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
