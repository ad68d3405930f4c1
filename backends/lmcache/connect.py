"""LMCache's remote connector, built without the remote's password in any URL LMCache sees.

LMCache 0.5.6 logs the URL it is handed at INFO on every connect ("Creating connector for URL:
...", "Creating Redis connector for URL: ...") through its own loggers, which do not propagate
to the root logger and write to stderr themselves, so no redaction of ours sees those lines;
its ``parse_remote_url`` logs it at DEBUG too (issue 45 N11). So the password never goes into
a URL:

* ``redis://`` / ``rediss://`` (LMCache's ``RedisConnector``, which reads a password only from
  its URL): ``CreateConnector`` gets the URL without one, then the password is set in the
  connector's redis-py pool (``connection_kwargs``) before any connection exists (the pool
  connects on the first command), so every connection AUTHs with it.
* ``redis-sentinel://`` / ``redis-cluster://`` (their adapters parse ``user:password@`` out of
  the URL, after logging it): the connector class is built directly with the ``username`` /
  ``password`` arguments the adapter would have passed, and wrapped as ``CreateConnector``
  wraps it (``InstrumentedRemoteConnector``).
* Without a password, or for other schemes: ``CreateConnector(url)`` unchanged.

A connector of another shape than LMCache 0.5.6's (no redis-py pool to give the password to)
raises ``RuntimeError``: the password is never handed over another way.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from lmcache.v1.storage_backend.connector import CreateConnector, parse_remote_url
from lmcache.v1.storage_backend.connector.instrumented_connector import InstrumentedRemoteConnector

from hybrid_offload.core.secrets import Secret

__all__ = ["create_connector"]

_POOL_SCHEMES = ("redis", "rediss")
_DIRECT_SCHEMES = ("redis-sentinel", "redis-cluster")


def create_connector(
    url: str, password: Secret | None, loop: Any, allocator: Any, config: Any, metadata: Any
) -> Any:
    """What ``CreateConnector`` builds for ``url`` with ``password`` (None: no AUTH), the
    password handed to redis-py only (see the module docstring). ``url`` holds no password.
    Call it on ``loop``'s thread, as ``CreateConnector``; it never connects to the remote."""
    scheme = urlsplit(url).scheme
    if password is None or scheme not in (*_POOL_SCHEMES, *_DIRECT_SCHEMES):
        return CreateConnector(url, loop, allocator, config, metadata)
    if scheme in _DIRECT_SCHEMES:
        return InstrumentedRemoteConnector(_direct(url, password.text(), loop, allocator))
    connector = CreateConnector(url, loop, allocator, config, metadata)
    pool = getattr(getattr(connector, "_connector", None), "pool", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if not isinstance(kwargs, dict):
        raise RuntimeError(
            "LMCache's Redis connector has no redis-py pool to give the password to (this "
            "backend supports LMCache 0.5.6)"
        )
    kwargs["password"] = password.text()
    return connector


def _direct(url: str, password: str, loop: Any, allocator: Any) -> Any:
    """LMCache's sentinel or cluster connector for ``url`` (``scheme://[user@]host:port[,...]``),
    built as its adapter builds it, with ``password`` as an argument."""
    from lmcache.v1.storage_backend.connector.redis_connector import (
        RedisClusterConnector,
        RedisSentinelConnector,
    )

    scheme, _, rest = url.partition("://")
    user, _, hosts = rest.rpartition("@")
    nodes = []
    for host in hosts.split(","):
        parsed = parse_remote_url(f"{scheme}://{host}")
        nodes.append((parsed.host, parsed.port))
    cls = RedisClusterConnector if scheme == "redis-cluster" else RedisSentinelConnector
    return cls(
        hosts_and_ports=nodes,
        username=unquote(user),
        password=password,
        loop=loop,
        local_cpu_backend=allocator,
    )
