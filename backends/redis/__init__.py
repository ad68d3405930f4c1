"""``redis`` and ``redis-cluster`` backends: pages in a Redis server or Redis Cluster, one
capacity and exact LRU shared by every client of the same ``prefix``.

* :mod:`.backend` - :class:`RedisBackend` (type ``redis``) and :class:`RedisClusterBackend`
  (type ``redis-cluster``): clients, pipelines, puts, gets, listing and failures.
* :mod:`.index` - the shared accounting index kept inside Redis (capacity, LRU ticks, healing).
* :mod:`.reads` - bounded page reads: GETRANGE in pipelines, an absent key told from an empty
  value; :mod:`.raw` - the plain-RESP reader that receives values straight into the caller's
  buffers (``get_into`` from a ``redis://`` server).
* :mod:`.options` - the options, url checks and redaction, the password; the ``lmcache``
  backend uses them for its Redis remotes too.
"""

from __future__ import annotations

from .backend import RedisBackend, RedisClusterBackend

__all__ = ["RedisBackend", "RedisClusterBackend"]
