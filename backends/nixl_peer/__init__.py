"""``nixl_peer`` backend: cache peer processes holding pages in NIXL-registered memory.

* :mod:`.protocol` - the binary control protocol (HELLO, LOOKUP, GET/RELEASE, ALLOC/COMMIT, ...).
* :mod:`.pool` - the peer's page index and pool allocator (LRU, leases, reservations).
* :mod:`.server` - the peer process (``hybrid-offload peer``); :mod:`.connections` bounds its
  connections, :mod:`.exposure` decides where it may listen and confines UCX there.
* :mod:`.ring` - consistent hashing of keys onto peers.
* :mod:`.client` - :class:`NixlPeerBackend`, registered as backend type ``nixl_peer``.

Importing this package does not import NIXL: the client and the server import it (through
:func:`nixl_api`) when they first need an agent.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

__all__ = ["NixlPeerBackend", "make_agent", "nixl_api"]


def nixl_api() -> ModuleType:
    """NIXL's ``_api`` module (``nixl_agent``, ``nixl_agent_config``, ...).

    ``import nixl`` picks its CUDA build by asking torch; with a CPU torch not imported yet that
    means importing torch (seconds, every peer start). When torch is not loaded and its
    on-disk version names no CUDA, take the first installed build directly, as ``nixl``'s own
    fallback does; otherwise (or if that fails) import ``nixl`` normally.
    """
    if "nixl" not in sys.modules and "torch" not in sys.modules:
        try:
            import nixl_meta_utils

            cuda = nixl_meta_utils._torch_cuda_version_from_disk()
        except Exception:  # older/newer nixl: use the normal import
            cuda = "unknown"
        if cuda is None:
            for name in ("nixl_cu13", "nixl_cu12"):
                try:
                    return importlib.import_module(f"{name}._api")
                except ImportError:
                    continue
    return importlib.import_module("nixl._api")


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` set in this process's environment (UCX reads it when the agent is built)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def make_agent(
    name: str, *, progress_thread: bool, progress_delay_us: int = 0, env: Mapping[str, str] | None = None
) -> Any:
    """A NIXL agent with the UCX backend; ``env`` (e.g. ``UCX_NET_DEVICES``) applies while it
    is built only.

    ``progress_delay_us``: the progress thread's sleep between polls. NIXL's Python wrapper
    always passes 0, and a progress thread that never sleeps spins one core at 100 % even
    when idle (measured here: 1.00 core idle at 0 us, 0.02 at 100 us); on a small machine that
    core is taken from the engines. The wrapper's config class is swapped for one whose
    ``pthrDelay`` keeps our value, for the duration of the constructor only.
    """
    api = nixl_api()
    config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    if not (progress_thread and progress_delay_us > 0):
        with _AGENT_CONFIG_LOCK, _environment(env or {}):
            return api.nixl_agent(name, config)
    base = api.nixlBind.nixlAgentConfig

    class _DelayedProgressConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802  (NIXL's name)
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _ignored: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, progress_delay_us)

    with _AGENT_CONFIG_LOCK, _environment(env or {}):
        api.nixlBind.nixlAgentConfig = _DelayedProgressConfig
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgentConfig = base


_AGENT_CONFIG_LOCK = threading.Lock()

from .client import NixlPeerBackend  # noqa: E402  (after nixl_api: client imports it lazily)
