"""Page storage backends for hybrid-offload (``hybrid_offload.backends``).

Importing this package is cheap: backend implementations are imported lazily by the registry
when :func:`create_backend` (or :func:`backend_class`) first needs their type.
"""

from .base import (
    KEY_PATTERN,
    KEY_PREFIX_PATTERN,
    Backend,
    BackendClosedError,
    BackendConfig,
    BackendConfigError,
    BackendError,
    BackendStats,
    BackendUnavailableError,
    Buffer,
    BuffersInUseError,
    InvalidKeyError,
    PageInfo,
    PageLease,
    PageReservation,
    check_keys,
    check_prefix,
)
from .registry import backend_class, create_backend, known_types, register_backend

__all__ = [
    "KEY_PATTERN",
    "KEY_PREFIX_PATTERN",
    "Backend",
    "BackendClosedError",
    "BackendConfig",
    "BackendConfigError",
    "BackendError",
    "BackendStats",
    "BackendUnavailableError",
    "Buffer",
    "BuffersInUseError",
    "InvalidKeyError",
    "PageInfo",
    "PageLease",
    "PageReservation",
    "backend_class",
    "check_keys",
    "check_prefix",
    "create_backend",
    "known_types",
    "register_backend",
]
