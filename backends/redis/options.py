"""Options of the redis backends: defaults, validation (errors name the key), url redaction and
the password (from ``password_file`` / ``password_env`` only, never from the url or a literal
option: see :mod:`hybrid_offload.core.secrets`).

Options (defaults): ``url`` (``redis://[user@]host:port/db``; ``rediss://`` for TLS, with
``ssl_ca_certs`` to trust a private CA; ``redis+cluster://`` / ``rediss+cluster://`` for a
cluster, db 0 only; a password in it is refused, naming ``password_file`` / ``password_env``),
``password_file`` / ``password_env`` (None: no AUTH), ``prefix`` (``hop``), ``ttl_s`` (None),
``orphan_ttl_s`` (60: expiry of a page until its put is accounted; keep it well above
``socket_timeout_s + connect_timeout_s``), ``socket_timeout_s`` (2.0), ``connect_timeout_s``
(1.0), ``max_connections`` (8, per server), ``max_batch_bytes`` (64 MiB). Type
``redis-cluster`` also takes ``startup_nodes: ["host:port", ...]`` (with or instead of ``url``).

Pure: parses and checks, never connects (reads the password file or variable).
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from redis.cluster import ClusterNode

from hybrid_offload.core.secrets import Secret, SecretError, secret_from_options

from ..base import BackendConfigError

__all__ = [
    "COMMON_DEFAULTS",
    "bad_option",
    "check_common_options",
    "check_url",
    "parse_node",
    "redact_url",
    "redis_password",
]

MiB = 1 << 20
_PREFIX = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_SCHEMES = {"redis": False, "rediss": False, "redis+cluster": True, "rediss+cluster": True}
_NODE = re.compile(r"(?P<host>[^\s:]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})")

COMMON_DEFAULTS: dict[str, Any] = {
    "url": "redis://127.0.0.1:6379/0",
    "prefix": "hop",
    "ttl_s": None,
    "orphan_ttl_s": 60.0,
    "socket_timeout_s": 2.0,
    "connect_timeout_s": 1.0,
    "max_connections": 8,
    "max_batch_bytes": 64 * MiB,
    "ssl_ca_certs": None,
    # a literal "password" is refused by name (secret_from_options); known so the error says why
    "password": None,
    "password_file": None,
    "password_env": None,
}


#: query keys that carry credentials (redis-py's ``from_url`` reads ``password`` there); not
#: e.g. ``ssl_keyfile``, a path
_CREDENTIAL_KEYS = ("password", "passwd", "pwd", "auth", "token", "secret")


def redact_url(url: str) -> str:
    """``url`` with its password (if any) and its query string (if any) replaced by ``***``."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparsable url>"
    if parts.query:
        parts = parts._replace(query="***")
    if password is not None:
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        parts = parts._replace(netloc=f"{user}:***@{host}")
    return urlunsplit(parts)


def bad_option(key: str, why: str) -> BackendConfigError:
    return BackendConfigError(f"option {key!r}: {why}")


def refuse_url_credentials(key: str, url: str) -> None:
    """BackendConfigError naming option ``key`` if ``url`` holds a password (in its user info
    or a credential query key): it would be visible on command lines and in logs."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError as exc:
        raise bad_option(key, f"cannot parse {redact_url(url)!r}: {exc}") from exc
    if password is not None:
        raise bad_option(
            key,
            f"{redact_url(url)!r} holds a password, which would be visible on command lines and in "
            "logs: give it with 'password_file' (a file holding it) or 'password_env' (the name of "
            "an environment variable holding it); a user name may stay in the url",
        )
    credentials = sorted({k for k, _ in parse_qsl(parts.query, keep_blank_values=True)
                          if any(c in k.lower() for c in _CREDENTIAL_KEYS)})  # fmt: skip
    if credentials:
        raise bad_option(
            key,
            f"{redact_url(url)!r} holds credentials in its query ({', '.join(credentials)}), which "
            "would be visible on command lines and in logs: give the password with 'password_file' "
            "or 'password_env'",
        )


def check_url(url: Any, *, cluster_only: bool) -> bool:
    """Validate ``url`` (no password in it); return whether it selects cluster mode."""
    if not isinstance(url, str) or not url:
        raise bad_option("url", f"must be a non-empty string, got {url!r}")
    refuse_url_credentials("url", url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise bad_option("url", f"cannot parse {redact_url(url)!r}: {exc}") from exc
    if parts.scheme not in _SCHEMES:
        raise bad_option("url", f"scheme must be one of {sorted(_SCHEMES)}, got {parts.scheme!r}")
    if not parts.hostname:
        raise bad_option("url", f"{url!r} names no host")
    cluster = cluster_only or _SCHEMES[parts.scheme]
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise bad_option("url", f"database must be a number, got {db!r}")
    if cluster and db not in ("", "0"):
        raise bad_option("url", "a cluster has only database 0")
    del port
    return cluster


def redis_password(options: dict[str, Any]) -> Secret | None:
    """The password from ``password_file`` / ``password_env`` (None without either);
    BackendConfigError naming the option when it is literal, both, or unreadable."""
    option = next((k for k in ("password_file", "password_env") if options.get(k) is not None), "password")
    try:
        return secret_from_options(options, "password", what=f"option {option!r}")
    except SecretError as exc:
        raise BackendConfigError(str(exc)) from None


def _positive_number(options: dict[str, Any], key: str, *, allow_none: bool = False) -> None:
    value = options[key]
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise bad_option(key, f"must be a number > 0{' or null' if allow_none else ''}, got {value!r}")


def _positive_int(options: dict[str, Any], key: str) -> None:
    value = options[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_option(key, f"must be an integer >= 1, got {value!r}")


def check_common_options(options: dict[str, Any], *, cluster_only: bool) -> None:
    """Check the options both redis types take (defaults already filled in)."""
    if options["url"] is not None or not cluster_only:
        check_url(options["url"], cluster_only=cluster_only)
    prefix = options["prefix"]
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise bad_option("prefix", f"must match {_PREFIX.pattern} (no braces), got {prefix!r}")
    _positive_number(options, "ttl_s", allow_none=True)
    _positive_number(options, "orphan_ttl_s")
    _positive_number(options, "socket_timeout_s")
    _positive_number(options, "connect_timeout_s")
    _positive_int(options, "max_connections")
    _positive_int(options, "max_batch_bytes")
    ca = options["ssl_ca_certs"]
    if ca is not None and (not isinstance(ca, str) or not os.path.isfile(ca)):
        raise bad_option("ssl_ca_certs", f"must be the path of a CA bundle file, got {ca!r}")
    redis_password(options)  # a missing file or variable shows at config time


def parse_node(node: Any) -> ClusterNode:
    """A ``host:port`` entry of ``startup_nodes``."""
    match = _NODE.fullmatch(node) if isinstance(node, str) else None
    if match is None or not 0 < int(match["port"]) < 65536:
        raise bad_option("startup_nodes", f"entries must be 'host:port', got {node!r}")
    return ClusterNode(unquote(match["host"]).strip("[]"), int(match["port"]))
