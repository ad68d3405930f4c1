"""``nixl_peer`` backend: cache peer processes holding pages in NIXL-registered memory.

* :mod:`.protocol` - the binary control protocol (HELLO, LOOKUP, GET/RELEASE, ALLOC/COMMIT, ...).
* :mod:`.pool` - the peer's page index and pool allocator (LRU, leases, reservations).
* :mod:`.server` - the peer process (``hybrid-offload peer``).
* :mod:`.ring` - consistent hashing of keys onto peers.
* :mod:`.client` - :class:`NixlPeerBackend`, registered as backend type ``nixl_peer``.

Importing this package does not import NIXL: the client and the server import it (through
:func:`nixl_api`) when they first need an agent.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

__all__ = ["NixlPeerBackend", "nixl_api"]


def nixl_api() -> ModuleType:
    """NIXL's ``_api`` module (``nixl_agent``, ``nixl_agent_config``, ...).

    ``import nixl`` picks its CUDA build by asking torch; with a CPU torch not imported yet that
    means importing torch (seconds, every peer start). When torch is not loaded and its
    on-disk version names no CUDA, take the first installed build directly, as ``nixl``'s own
    fallback does; otherwise (or if that fails) import ``nixl`` normally.
    """
    if "nixl" not in sys.modules and "torch" not in sys.modules:
        try:
            import nixl_meta_utils

            cuda = nixl_meta_utils._torch_cuda_version_from_disk()
        except Exception:  # older/newer nixl: use the normal import
            cuda = "unknown"
        if cuda is None:
            for name in ("nixl_cu13", "nixl_cu12"):
                try:
                    return importlib.import_module(f"{name}._api")
                except ImportError:
                    continue
    return importlib.import_module("nixl._api")


from .client import NixlPeerBackend  # noqa: E402  (after nixl_api: client imports it lazily)
