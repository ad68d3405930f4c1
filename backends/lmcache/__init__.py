"""``lmcache`` backend: pages stored through LMCache 0.5.6's remote connectors (Redis, file
system, ``lm://`` server, ...), so any remote store LMCache speaks to becomes a tier.

* :mod:`.backend` - :class:`LMCacheBackend`, registered as backend type ``lmcache``: LMCache's
  ``RemoteConnector`` driven on a private event-loop thread, with a local index of the pages.
  Importing it imports LMCache (and torch); it raises ``ImportError`` naming
  ``scripts/install_lmcache.sh`` when LMCache is missing.
* :mod:`.options` - the options and their validation; :mod:`.connect` - the connector built
  without the remote's password in any URL LMCache sees; :mod:`.expiry` - expiry of the
  remote's values (option ``ttl_s``).
"""

from __future__ import annotations

from .backend import LMCacheBackend

__all__ = ["LMCacheBackend"]
