"""Options of the lmcache backend: defaults and validation (errors name the key).

Options, each checked with a :class:`BackendConfigError` naming the key:

* ``remote_url`` (required): an LMCache remote URL, e.g. ``redis://127.0.0.1:6379`` or
  ``fs://localhost:0/var/cache/pages``. ``resp://`` is refused (that connector reads fixed
  full-chunk-size values; pages vary in size). For ``redis``/``rediss``/``unix`` URLs without
  them, ``socket_timeout`` and ``socket_connect_timeout`` (= ``op_timeout_s``) are added so a
  hung server fails a call instead of blocking LMCache's I/O loop.
* ``namespace`` (``"hybrid-offload"``): prefix of LMCache's key (its ``model_name``), so
  several deployments can share one store.
* ``op_timeout_s`` (10.0): a batch call that has not finished by then raises
  :class:`BackendUnavailableError`.
* ``close_timeout_s`` (2.0): how long :meth:`LMCacheBackend.close` waits for LMCache's
  ``close()``.
* ``ttl_s`` (86400.0): values expire this long after their last put or get, so the remote does
  not grow across restarts (Redis and fs remotes; ``null``: never; other remotes cannot expire
  values: a warning at start-up). See :mod:`hybrid_offload.backends.lmcache_expiry`.

Pure: no LMCache import except its URL parser (imported lazily), no I/O.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .base import BackendConfigError

__all__ = ["OPTION_DEFAULTS", "check_remote_url", "validate_lmcache_options"]

_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_REDIS_SCHEMES = ("redis", "rediss", "unix")

OPTION_DEFAULTS: dict[str, Any] = {
    "remote_url": None,
    "namespace": "hybrid-offload",
    "op_timeout_s": 10.0,
    "close_timeout_s": 2.0,
    # values expire this long after their last put or get (Redis, fs): see lmcache_expiry
    "ttl_s": 86400.0,
}


def _positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise BackendConfigError(f"option {name!r} must be a number > 0, got {value!r}")
    return float(value)


def check_remote_url(url: Any, op_timeout_s: float) -> str:
    """Validate ``remote_url``; return it with socket timeouts added for Redis URLs."""
    if not isinstance(url, str) or "://" not in url:
        raise BackendConfigError(
            f"option 'remote_url' must be an LMCache remote URL such as "
            f"'redis://127.0.0.1:6379' or 'fs://localhost:0/path', got {url!r}"
        )
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme == "resp":
        raise BackendConfigError(
            "option 'remote_url': resp:// reads fixed full-chunk-size values and cannot hold "
            "pages of varying size; use redis://"
        )
    if scheme in _REDIS_SCHEMES:
        try:
            port = parts.port
        except ValueError as exc:
            raise BackendConfigError(f"option 'remote_url': bad port in {url!r}") from exc
        if scheme != "unix" and (not parts.hostname or port is None):
            raise BackendConfigError(
                f"option 'remote_url' needs host and port, e.g. redis://127.0.0.1:6379, got {url!r}"
            )
        query = dict(parse_qsl(parts.query))
        query.setdefault("socket_timeout", f"{op_timeout_s:g}")
        query.setdefault("socket_connect_timeout", f"{op_timeout_s:g}")
        return urlunsplit(parts._replace(query=urlencode(query)))
    from lmcache.v1.storage_backend.connector import parse_remote_url

    try:  # LMCache's own parser (an assert) for lm://, fs://, ...
        parse_remote_url(url)
    except (AssertionError, ValueError) as exc:
        raise BackendConfigError(
            f"option 'remote_url': LMCache cannot parse {url!r} (it wants "
            f"scheme://host:port[/path], e.g. fs://localhost:0/path): {exc}"
        ) from exc
    return url


def validate_lmcache_options(merged: dict[str, Any]) -> dict[str, Any]:
    """Check the options (defaults filled in); return them normalized."""
    if merged["remote_url"] is None:
        raise BackendConfigError("option 'remote_url' is required (e.g. 'redis://127.0.0.1:6379')")
    op_timeout = _positive_number("op_timeout_s", merged["op_timeout_s"])
    merged["op_timeout_s"] = op_timeout
    merged["close_timeout_s"] = _positive_number("close_timeout_s", merged["close_timeout_s"])
    namespace = merged["namespace"]
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise BackendConfigError(f"option 'namespace' must match {_NAMESPACE.pattern}, got {namespace!r}")
    check_remote_url(merged["remote_url"], op_timeout)
    if merged["ttl_s"] is not None:
        merged["ttl_s"] = _positive_number("ttl_s", merged["ttl_s"])
    return merged
