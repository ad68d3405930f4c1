"""A request's cache scope: what besides the model and its tokens decides the request's KV.

The scope seeds the request's key chain (:meth:`HybridOffloadPlanner.scope_seed`). It is
canonical JSON, so no field value can make two different scopes encode alike:

* ``lora``: the adapter's name, path and identity (its files' content, see
  :func:`~hybrid_offload.engine.model_identity.adapter_identity`), never its per-process integer id.
  The identity is taken when the scheduler first sees the adapter's id and pinned to it, with
  the stamp of every entry of the adapter directory (device, inode, size, mtime and ctime: the
  stamp under which :mod:`~hybrid_offload.core.file_digest` caches a content digest). vLLM's
  workers load an adapter once per id (and again from its files when their LRU dropped it), so
  files rewritten later under the same id would name weights the workers may not use. Requests
  with an adapter whose stamps changed since (any write, even one that keeps the size and sets
  the mtime back, since no one can set the ctime back), or that cannot be read, skip the cache
  until it is loaded under a new id;
* ``salt``: vLLM's ``cache_salt``;
* ``weights``: the weights version, where the weights differ from those the engine started with
  (the fingerprint names those): the request's ``kv_transfer_params["hybrid_offload"]
  ["weights_version"]`` where the caller gives one and the operator trusts callers to
  (``accept_weights_version``; engines of a fleet that applied the same update share pages),
  else the engine's epoch: empty until the first cache reset, then a random nonce per reset (a
  restart or another engine never reuses it). A version from an untrusted caller is ignored:
  a client naming another version than the engine's weights would store KV that other
  engines load as that version's.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import reprlib
from typing import TYPE_CHECKING, Any

from hybrid_offload.backends.retention import SESSIONS
from hybrid_offload.connector.config import MAX_VERSION_LEN
from hybrid_offload.core.file_digest import file_stamp
from hybrid_offload.engine.model_identity import adapter_identity

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

#: the request parameter namespace (``kv_transfer_params``) and the key in it
PARAMS_KEY = "hybrid_offload"
WEIGHTS_VERSION_KEY = "weights_version"
SESSION_KEY = "session"


class ScopeError(ValueError):
    """A request's scope cannot be told (a malformed weights version): it does not use the
    cache."""


class AdapterIdentities:
    """LoRA adapter identities pinned per (adapter id, path) at first sight (see the module
    docstring); each lookup stats the adapter directory's entries to see that their stamps
    are as pinned, and its files are read only at first sight."""

    def __init__(self) -> None:
        self._pinned: dict[tuple[int, str], tuple[tuple[Any, ...], str]] = {}

    @staticmethod
    def _signature(path: str) -> tuple[Any, ...]:
        try:
            with os.scandir(path) as entries:
                return tuple(sorted(
                    (e.name, *file_stamp(st))
                    for e in entries
                    for st in (e.stat(),)
                ))  # fmt: skip
        except (OSError, ValueError):  # missing, not a directory, a NUL in the path
            return ()

    def get(self, adapter_id: int, path: str) -> str:
        """The adapter's identity (canonical JSON); raises :class:`ScopeError` when its files
        changed since it was pinned or cannot be read."""
        signature = self._signature(path)
        pinned = self._pinned.get((adapter_id, path))
        if pinned is None:
            try:
                identity = adapter_identity(path)
            except (OSError, RuntimeError) as exc:
                raise ScopeError(f"LoRA adapter {path!r} cannot be read: {exc}") from None
            if self._signature(path) != signature:  # written while it was read: not pinned
                raise ScopeError(f"LoRA adapter {path!r} changed while it was read")
            pinned = (signature, json.dumps(identity, sort_keys=True, separators=(",", ":")))
            self._pinned[(adapter_id, path)] = pinned
        if pinned[0] != signature:
            raise ScopeError(
                f"LoRA adapter {path!r} (id {adapter_id}) changed on disk since the engine first "
                "used it: its requests skip the cache until it is loaded under a new id"
            )
        return pinned[1]


@functools.cache
def _warn_ignored_version() -> None:
    logger.warning(
        "kv_transfer_params.%s.%s ignored (the epoch is used): set accept_weights_version: true "
        "where only trusted callers (a router or trainer) reach the engine",
        PARAMS_KEY,
        WEIGHTS_VERSION_KEY,
    )


def weights_version(request: Request) -> str | None:
    """The caller's weights version for this request, None when it gives none; raises
    :class:`ScopeError` when it is not a non-empty string of at most 256 characters."""
    params = getattr(request, "kv_transfer_params", None)
    ours = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if not isinstance(ours, dict) or WEIGHTS_VERSION_KEY not in ours:
        return None
    version = ours[WEIGHTS_VERSION_KEY]
    if not isinstance(version, str) or not 0 < len(version) <= MAX_VERSION_LEN:
        raise ScopeError(
            f"kv_transfer_params.{PARAMS_KEY}.{WEIGHTS_VERSION_KEY} must be a non-empty string of "
            f"at most {MAX_VERSION_LEN} characters, got {reprlib.repr(version)}"
        )
    return version


def session_hint(request: Request) -> str | None:
    """What the caller says of the request's session (``kv_transfer_params["hybrid_offload"]
    ["session"]``: one of :data:`~hybrid_offload.backends.retention.SESSIONS`), None without a
    hint. Not part of the scope (it changes what is kept, not what is stored); a value not
    understood is ignored with one warning per value (a hint never fails a request)."""
    params = getattr(request, "kv_transfer_params", None)
    ours = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    value = ours.get(SESSION_KEY) if isinstance(ours, dict) else None
    if value is None or value in SESSIONS:
        return value
    _warn_bad_session(reprlib.repr(value))
    return None


@functools.lru_cache(maxsize=64)
def _warn_bad_session(value: str) -> None:
    logger.warning(
        "kv_transfer_params.%s.%s = %s ignored: expected one of %s", PARAMS_KEY, SESSION_KEY, value,
        ", ".join(SESSIONS),
    )  # fmt: skip


def request_scope(
    request: Request, epoch: str, adapters: AdapterIdentities, *, accept_version: bool = False
) -> bytes:
    """The request's scope bytes (see the module docstring); raises :class:`ScopeError`.
    ``accept_version``: whether the caller's weights version counts (else it is ignored, with one
    warning per process)."""
    scope: dict[str, Any] = {}
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        path = str(getattr(lora, "lora_path", "") or "")
        scope["lora"] = {
            "name": lora.lora_name,
            "path": path,
            "identity": adapters.get(int(getattr(lora, "lora_int_id", 0)), path) if path else "",
        }
    salt = getattr(request, "cache_salt", None)
    if salt:
        scope["salt"] = salt
    version = weights_version(request)
    if version is not None and not accept_version:
        _warn_ignored_version()
        version = None
    if version is not None:
        scope["weights"] = {"version": version}
    elif epoch:
        scope["weights"] = {"epoch": epoch}
    if not scope:
        return b""
    return json.dumps(scope, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
