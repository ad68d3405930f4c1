"""Patches applied inside vLLM, one `vllm.general_plugins` entry point each.

vLLM loads every general plugin in every process it starts (API server, EngineCore, workers);
`VLLM_PLUGINS=name,...` restricts it to the named ones. Each patch module has:

- ``ENTRY_POINT``: its plugin name (pyproject's ``vllm.general_plugins``), saying what it does;
- ``VLLM_VERSIONS``: the vLLM release prefixes it was written for: :data:`hybrid_offload.compat.VLLM_RELEASES`
  (the tested ones), or fewer once a later release no longer needs it;
- ``register()``: idempotent; applies the patch where it is needed, and on a vLLM version not in
  ``VLLM_VERSIONS`` (or when the patched method no longer looks as expected) applies nothing and
  logs a warning naming the patch and what is lost without it.

The helpers below mark wrappers and gate each patch on its versions; reading and comparing
versions is :mod:`hybrid_offload.compat`'s (the tested releases of everything we reach into).
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any

from hybrid_offload import compat

#: A child of vLLM's logger, so the patches' lines show up in vLLM's own log output.
logger = logging.getLogger("vllm.hybrid_offload.patches")

_MARKER = "_hybrid_offload_patch"


def version_supported(entry_point: str, versions: tuple[str, ...], without: str) -> bool:
    """Whether the installed vLLM is one of ``versions``; if not, warn that ``entry_point`` is
    not applied and what is lost (``without``)."""
    found = compat.installed_version("vllm")
    if compat.release_in(found, versions):
        return True
    warn_not_applied(
        entry_point,
        f"vLLM {found or 'unknown'} is not one it was written for ({compat.releases_text(versions)})",
        without,
    )
    return False


def torchvision_loads() -> bool:
    """Whether ``import torchvision`` works (on a CPU engine it does not: absent, or a CUDA build
    beside CPU torch that raises at import; then nothing of it is left in ``sys.modules``)."""
    try:
        importlib.import_module("torchvision")
    except Exception:
        sys.modules.pop("torchvision", None)
        return False
    return True


def warn_not_applied(entry_point: str, why: str, without: str) -> None:
    logger.warning("hybrid_offload: patch %s not applied: %s; %s", entry_point, why, without)


def mark(wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``wrapper`` as one of ours, so `is_patched` finds it and `register` runs once."""
    setattr(wrapper, _MARKER, True)
    return wrapper


def is_patched(function: Any) -> bool:
    return bool(getattr(function, _MARKER, False))


def wrap_method(
    owner: type,
    name: str,
    wrap: Callable[[Any], Any],
    entry_point: str,
    versions: tuple[str, ...],
    without: str,
) -> None:
    """Replace ``owner.name`` with ``wrap(owner.name)`` (a :func:`mark` ed wrapper), unless the
    installed vLLM is not one of ``versions`` (a warning: :func:`version_supported`) or the
    method is already ours."""
    current = getattr(owner, name)
    if version_supported(entry_point, versions, without) and not is_patched(current):
        setattr(owner, name, wrap(current))
