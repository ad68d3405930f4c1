"""Options of the lmcache backend: defaults and validation (errors name the key).

Options, each checked with a :class:`BackendConfigError` naming the key:

* ``remote_url`` (required): an LMCache remote URL, e.g. ``redis://127.0.0.1:6379`` or
  ``fs://localhost:0/var/cache/pages``, without credentials (refused: they would show on
  command lines and in logs; shown URLs are redacted).
* ``password_file`` / ``password_env``: the password of a Redis remote (``redis``, ``rediss``,
  ``redis-sentinel``, ``redis-cluster``), from a file or an environment variable; a literal
  ``password`` is refused. It is handed to redis-py only, never in a URL (LMCache logs the
  URLs it gets: :mod:`hybrid_offload.backends.lmcache.connect`). ``resp://`` is refused (that
  connector reads fixed full-chunk-size values; pages vary in size). For ``redis`` /
  ``rediss`` / ``unix`` URLs without them, ``socket_timeout`` and ``socket_connect_timeout``
  (= ``op_timeout_s``) are added so a hung server fails a call instead of blocking LMCache's
  I/O loop.
* ``namespace`` (``"hybrid-offload"``): prefix of LMCache's key (its ``model_name``), so
  several deployments can share one store.
* ``op_timeout_s`` (10.0): a batch call that has not finished by then raises
  :class:`BackendUnavailableError`.
* ``close_timeout_s`` (2.0): how long :meth:`LMCacheBackend.close` waits for LMCache's
  ``close()``.
* ``ttl_s`` (86400.0): values expire this long after their last put or get, so the remote does
  not grow across restarts (Redis and fs remotes; ``null``: never; other remotes cannot expire
  values: a warning at start-up). See :mod:`hybrid_offload.backends.lmcache.expiry`.

Pure: no LMCache import except its URL parser (imported lazily), no I/O.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from hybrid_offload.core.secrets import Secret

from ..base import BackendConfigError
from ..redis.options import redact_url, redis_password, refuse_url_credentials

__all__ = ["OPTION_DEFAULTS", "check_remote_url", "lmcache_password", "validate_lmcache_options"]

_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_REDIS_SCHEMES = ("redis", "rediss", "unix")
#: remotes whose LMCache connector takes a password (handed over by connect.py, never in a URL)
_PASSWORD_SCHEMES = ("redis", "rediss", "redis-sentinel", "redis-cluster")


def lmcache_password(options: dict[str, Any]) -> Secret | None:
    """The remote's password from ``password_file`` / ``password_env`` (a literal ``password``
    is refused), as the redis backend reads its own."""
    return redis_password(options)


OPTION_DEFAULTS: dict[str, Any] = {
    "remote_url": None,
    "namespace": "hybrid-offload",
    "op_timeout_s": 10.0,
    "close_timeout_s": 2.0,
    # values expire this long after their last put or get (Redis, fs): see expiry.py
    "ttl_s": 86400.0,
    # the remote's password (redis, rediss, redis-sentinel, redis-cluster): a file or a variable
    "password": None,
    "password_file": None,
    "password_env": None,
}


def _positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise BackendConfigError(f"option {name!r} must be a number > 0, got {value!r}")
    return float(value)


def check_remote_url(url: Any, op_timeout_s: float) -> str:
    """Validate ``remote_url`` (no credentials in it: ``password_file`` / ``password_env``);
    return it with socket timeouts added for Redis URLs."""
    if not isinstance(url, str) or "://" not in url:
        raise BackendConfigError(
            f"option 'remote_url' must be an LMCache remote URL such as "
            f"'redis://127.0.0.1:6379' or 'fs://localhost:0/path', got {redact_url(str(url))!r}"
        )
    refuse_url_credentials("remote_url", url)
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
            raise BackendConfigError(f"option 'remote_url': bad port in {redact_url(url)!r}") from exc
        if scheme != "unix" and (not parts.hostname or port is None):
            raise BackendConfigError(
                "option 'remote_url' needs host and port, e.g. redis://127.0.0.1:6379, got "
                f"{redact_url(url)!r}"
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
            f"option 'remote_url': LMCache cannot parse {redact_url(url)!r} (it wants "
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
    password = lmcache_password(merged)
    if password is not None and urlsplit(merged["remote_url"]).scheme not in _PASSWORD_SCHEMES:
        raise BackendConfigError(
            f"option 'password_file' / 'password_env': only {', '.join(_PASSWORD_SCHEMES)} remotes "
            f"take a password, not {urlsplit(merged['remote_url']).scheme}://"
        )
    if merged["ttl_s"] is not None:
        merged["ttl_s"] = _positive_number("ttl_s", merged["ttl_s"])
    return merged
