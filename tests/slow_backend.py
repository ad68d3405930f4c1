"""A cpu backend whose loads take ``delay_s`` longer: an artificially slow tier for tests of the
adaptive load policy. Configured by module path: ``{"type": "slow_backend:SlowCpuBackend"}``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, ClassVar

from hybrid_offload.backends.base import PageLease
from hybrid_offload.backends.cpu import CpuBackend


class SlowCpuBackend(CpuBackend):
    """CpuBackend that sleeps ``delay_s`` in every ``get_into`` and ``lease_batch`` (after the
    base's checks)."""

    type_name: ClassVar[str] = "slow_cpu"
    option_defaults: ClassVar[dict[str, Any]] = {"delay_s": 0.0}

    def _get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        time.sleep(float(self.config.options["delay_s"]))
        return super()._get_into(keys, buffers)

    def _lease_batch(self, keys: Sequence[str]) -> PageLease:
        time.sleep(float(self.config.options["delay_s"]))
        return super()._lease_batch(keys)
