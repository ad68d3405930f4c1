"""Page storage backends for hybrid-offload (``hybrid_offload.backends``).

Importing this package is cheap: backend implementations are imported lazily by the registry
when :func:`create_backend` (or :func:`backend_class`) first needs their type.
"""

from .base import (
    KEY_PATTERN,
    Backend,
    BackendClosedError,
    BackendConfig,
    BackendConfigError,
    BackendError,
    BackendStats,
    BackendUnavailableError,
    Buffer,
    InvalidKeyError,
    check_keys,
)
from .registry import backend_class, create_backend, known_types, register_backend

__all__ = [
    "KEY_PATTERN",
    "Backend",
    "BackendClosedError",
    "BackendConfig",
    "BackendConfigError",
    "BackendError",
    "BackendStats",
    "BackendUnavailableError",
    "Buffer",
    "InvalidKeyError",
    "backend_class",
    "check_keys",
    "create_backend",
    "known_types",
    "register_backend",
]
