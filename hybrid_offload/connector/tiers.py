"""Opening a tier: its backend, wrapped in the health gate and the instruments, once.

:func:`open_tier` is the only place the connector opens a backend. The scheduler and the worker
get back an :class:`OpenTier` whose ``backend`` they call like any backend; its failures back it
off, and every call is counted by the side's :class:`~hybrid_offload.backends.wrappers.CallRecorder`
(:class:`WorkerRecorder`, :class:`SchedulerRecorder`). The data path catches
:class:`~hybrid_offload.backends.base.BackendError` and treats the pages as misses; nothing
else about a failing backend is its business.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from hybrid_offload.backends.base import Backend, BackendConfigError, BackendError
from hybrid_offload.backends.health import BackendHealth
from hybrid_offload.backends.registry import create_backend
from hybrid_offload.backends.wrappers import CallRecorder, HealthGatedBackend, InstrumentedBackend
from hybrid_offload.connector.config import ROOT, ConfigError, Tier
from hybrid_offload.core.metrics import Locked, SchedulerCounters, WorkerCounters
from hybrid_offload.core.model_card import ModelCardError, card_from_spec, card_key, encode_card
from hybrid_offload.core.spec import ModelSpec

logger = logging.getLogger(__name__)

#: error kinds (``hybrid_offload.core.metrics.ERROR_KINDS``) of failed data calls, by method
ERROR_KIND = {
    "put_batch": "put",
    "get_batch": "get",
    "get_into": "get",
    "lease_batch": "get",
    "reserve_batch": "put",
    "contains_batch": "lookup",
    "delete_batch": "delete",
    "touch_batch": "touch",
}
#: the calls whose latency is a metric (``store_seconds`` / ``load_seconds``), by method: for a
#: tier that keeps pages in place (cpu), taking the pages (a lease) and reserving their room
TIMED = {"put_batch": "store", "reserve_batch": "store", "get_into": "load", "lease_batch": "load"}


@dataclass(frozen=True)
class OpenTier:
    """An opened tier: the wrapped ``backend`` and the ``health`` its gate consults."""

    tier: Tier
    backend: Backend
    health: BackendHealth

    @property
    def name(self) -> str:
        return self.tier.name


def open_tier(
    tier: Tier, index: int, recorder: CallRecorder, clock: Callable[[], float] = time.monotonic
) -> OpenTier:
    """Create ``backends[index]`` (may block on I/O) and wrap it: instruments outside, health
    gate inside, so a skipped call is counted as skipped and never timed.

    A problem with its configuration that only shows now (a disk path that cannot be created
    or written) raises :class:`ConfigError` naming the key; network backends do not connect
    here, so an unreachable server is not an error (the worker warns at start-up). ``clock``
    drives the backoff.
    """
    try:
        backend = create_backend(tier.backend)
    except BackendConfigError as exc:
        raise ConfigError(f"{ROOT}.backends[{index}]: {exc}") from exc
    policy = tier.policy
    health = BackendHealth(tier.name, policy.retry_after_s, policy.retry_after_max_s, clock)
    # wrappers are Backends virtually (Backend.register): the type checker is told so here
    gated = cast(Backend, HealthGatedBackend(backend, health))
    return OpenTier(tier, cast(Backend, InstrumentedBackend(gated, recorder)), health)


class WorkerRecorder:
    """The worker's counting: latency of stores and loads, errors by kind (and
    ``backend_errors``), skipped calls as ``unavailable``, usage gauges."""

    def __init__(self, stats: Locked[WorkerCounters]) -> None:
        self._stats = stats

    def called(self, backend: str, op: str, seconds: float) -> None:
        if op in TIMED:
            self._stats.record_call(backend, TIMED[op], seconds)

    def failed(self, backend: str, op: str, exc: BackendError) -> None:
        self._stats.add(backend_errors=1)
        self._stats.record_error(backend, ERROR_KIND[op])

    def skipped(self, backend: str, op: str) -> None:
        self._stats.add_backend(backend, unavailable=1)
        self._stats.record_error(backend, "skipped")

    def usage(
        self, backend: str, used_bytes: int | None, evictions: int, state_bytes: int | None = None
    ) -> None:
        self._stats.update_backend(
            backend, used_bytes=used_bytes, evictions=evictions, state_bytes=state_bytes
        )


class SchedulerRecorder:
    """The scheduler's counting: a failed lookup is an error and makes the backend
    ``unavailable`` for that request; a skipped one is counted as skipped."""

    def __init__(self, stats: Locked[SchedulerCounters]) -> None:
        self._stats = stats

    def called(self, backend: str, op: str, seconds: float) -> None:
        return  # lookups are counted per request by the scheduler, not per call

    def failed(self, backend: str, op: str, exc: BackendError) -> None:
        self._stats.add_backend(backend, unavailable=1)
        self._stats.record_error(backend, ERROR_KIND[op])

    def skipped(self, backend: str, op: str) -> None:
        self._stats.record_error(backend, "skipped")

    def usage(
        self, backend: str, used_bytes: int | None, evictions: int, state_bytes: int | None = None
    ) -> None:
        return  # the scheduler reports availability and capacity only (refresh_gauges)


def write_model_card(
    spec: ModelSpec, chunk_tokens: int, tiers: dict[str, OpenTier], page_key: bytes | None = None
) -> None:
    """This model's card (:mod:`hybrid_offload.core.model_card`) into every writable tier another
    process can list, so ``hybrid-offload cache`` can name the model of this fingerprint. Best
    effort, once per engine (one worker). Not a page: never reported to the scheduler. Signed
    under ``page_key`` (the cache secret's page subkey) where the engine has a secret."""
    try:
        key = card_key(spec.fingerprint)
        card = encode_card(card_from_spec(spec, chunk_tokens), page_key)
    except ModelCardError as exc:
        logger.warning("hybrid-offload: no model card written: %s", exc)
        return
    for name, opened in tiers.items():
        if opened.tier.policy.read_only or not opened.backend.shared_index:
            continue  # in-process pools (cpu, lmcache) cannot be listed by another process
        try:
            opened.backend.put_batch([(key, card)])
        except BackendError as exc:  # prepare already warned about unreachable backends
            logger.debug("backend %s: writing the model card failed: %s", name, exc)
        except Exception:
            logger.exception("backend %s: writing the model card failed", name)
