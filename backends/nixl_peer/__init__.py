"""``nixl_peer`` backend: cache peer processes holding pages in NIXL-registered memory.

* :mod:`.protocol` - the binary control protocol (HELLO, LOOKUP, GET/RELEASE, ALLOC/COMMIT, ...).
* :mod:`~hybrid_offload.backends.page_pool` - the peer's page index and pool allocator (LRU, leases,
  reservations).
* :mod:`.server` - the peer process (``hybrid-offload peer``); :mod:`.connections` bounds its
  connections, :mod:`.exposure` decides where it may listen and confines UCX there.
* :mod:`.ring` - consistent hashing of keys onto peers.
* :mod:`.client` - :class:`NixlPeerBackend`, registered as backend type ``nixl_peer``.

Importing this package does not import NIXL: the client and the server import it (through
:func:`hybrid_offload.compat.nixl_api`, the one gate to NIXL's private parts) when they first
need an agent.
"""

from __future__ import annotations

from .client import NixlPeerBackend

__all__ = ["NixlPeerBackend"]
