"""Real service processes for the tests and the benchmarks: one launcher per service.

* :mod:`.redis`: ``redis-server`` (single servers, small Redis Clusters);
* :mod:`.peer`: the cache peer (``python -m hybrid_offload peer``);
* :mod:`.vllm_server`: vLLM's OpenAI server (``hybrid-offload serve``, or plain vLLM);
* :mod:`.common`: free loopback ports, readiness waits, stopping by pid or process group.

Every launcher listens on a free loopback port, ``start()`` returns once the service answers
(or raises RuntimeError naming the service, with its log tail), ``stop()`` is idempotent,
``with launcher:`` stops it at the end, and whatever is still running at interpreter exit is
stopped. Nothing here imports pytest or :mod:`hybrid_offload.tools`.
"""

from hybrid_offload.testing.services.common import Service, free_port
from hybrid_offload.testing.services.peer import PeerFactory, PeerProcess, start_peer
from hybrid_offload.testing.services.redis import (
    RedisCluster,
    RedisServer,
    redis_server_binary,
    start_redis_cluster,
    start_redis_server,
)
from hybrid_offload.testing.services.vllm_server import Metrics, ServeProcess, fetch_metrics, start_serve

__all__ = [
    "Metrics",
    "PeerFactory",
    "PeerProcess",
    "RedisCluster",
    "RedisServer",
    "ServeProcess",
    "Service",
    "fetch_metrics",
    "free_port",
    "redis_server_binary",
    "start_peer",
    "start_redis_cluster",
    "start_redis_server",
    "start_serve",
]
