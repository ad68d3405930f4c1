"""Backend registry: type name (the ``type`` in config) -> backend class, imported lazily.

Like fsspec's ``registry``: built-in types are registered as ``"module.path:ClassName"``
strings and imported on first use, so importing this module (or the package) stays cheap and
a backend's own dependencies (redis, nixl) are only needed when that type is configured. An
import failure is never swallowed: it raises :class:`ImportError` naming the type and module,
chained to the original error.

Adding a backend type is one line: ``register_backend("redis", "pkg.mod:RedisBackend")``; a
config may also name a class directly, ``type: "my_pkg.my_module:MyBackend"`` (like vLLM's
``kv_connector_module_path``), which is imported on first use the same way.

Threading: all functions are thread-safe (one module lock); imports happen at most once per
type, under that lock.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import threading

from .base import Backend, BackendConfig, BackendConfigError

__all__ = ["backend_class", "create_backend", "known_types", "register_backend"]

_TYPE_NAME = re.compile(r"[a-z][a-z0-9_-]*")
_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")

_lock = threading.RLock()  # reentrant: an imported module may register more types
# type name -> "module:Class" (not imported yet) or the class itself
_registry: dict[str, str | type[Backend]] = {
    "cpu": "hybrid_offload.backends.cpu:CpuBackend",
    "disk": "hybrid_offload.backends.disk:DiskBackend",
    "redis": "hybrid_offload.backends.redis:RedisBackend",
    "redis-cluster": "hybrid_offload.backends.redis:RedisClusterBackend",
    "nixl_peer": "hybrid_offload.backends.nixl_peer.client:NixlPeerBackend",
    "lmcache": "hybrid_offload.backends.lmcache:LMCacheBackend",
}


def register_backend(type_name: str, target: str | type[Backend], *, clobber: bool = False) -> None:
    """Register ``target`` (a ``"module.path:ClassName"`` string or a class) as ``type_name``.

    Re-registering the same target is a no-op; a different one raises ``ValueError`` unless
    ``clobber``. Nothing is imported here.
    """
    if not isinstance(type_name, str) or not _TYPE_NAME.fullmatch(type_name):
        raise ValueError(f"backend type name must match {_TYPE_NAME.pattern}, got {type_name!r}")
    if isinstance(target, str):
        if not _TARGET.fullmatch(target):
            raise ValueError(f"backend {type_name!r}: want 'module:Class', got {target!r}")
    elif not (isinstance(target, type) and issubclass(target, Backend)):
        raise TypeError(f"backend {type_name!r}: {target!r} is not a Backend subclass")
    with _lock:
        current = _registry.get(type_name)
        if current is not None and current != target and not clobber:
            raise ValueError(
                f"backend type {type_name!r} is already registered ({current!r}); "
                "pass clobber=True to replace it"
            )
        _registry[type_name] = target


def known_types() -> list[str]:
    """Registered type names, sorted."""
    with _lock:
        return sorted(_registry)


def _load(type_name: str, target: str) -> type[Backend]:
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"backend type {type_name!r}: cannot import module {module_name!r}: {exc}"
        ) from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ImportError(
            f"backend type {type_name!r}: module {module_name!r} has no {class_name!r}"
        )
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"backend type {type_name!r}: {target} is not a Backend subclass")
    return cls


def backend_class(type_name: str) -> type[Backend]:
    """The class registered as ``type_name``, imported on first use.

    Raises :class:`BackendConfigError` listing the known types when ``type_name`` is unknown,
    and ``ImportError`` naming the type and module when its module cannot be imported.
    """
    with _lock:
        target = _registry.get(type_name)
        if target is None and _TARGET.fullmatch(type_name):
            target = _registry[type_name] = _load(type_name, type_name)
        if target is None:
            known = ", ".join(sorted(_registry))
            raise BackendConfigError(
                f"unknown backend type {type_name!r} (known: {known}, or 'package.module:Class')"
            )
        if isinstance(target, str):
            target = _registry[type_name] = _load(type_name, target)
        return target


def create_backend(config: BackendConfig) -> Backend:
    """Validate ``config`` against its type and build the backend (may block on I/O).

    Errors in the config raise :class:`BackendConfigError` naming the backend and the key.
    """
    cls = backend_class(config.type)
    capacity = config.capacity_bytes
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise BackendConfigError(
            f"backend {config.name!r}: 'capacity_bytes' must be an integer >= 0, got {capacity!r}"
        )
    try:
        options = cls.validate_options(dict(config.options))
    except BackendConfigError as exc:
        raise BackendConfigError(f"backend {config.name!r}: {exc}") from exc
    return cls.implementation(options)(dataclasses.replace(config, options=options))
