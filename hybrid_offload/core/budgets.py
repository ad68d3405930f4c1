"""The worker's default store budgets, sized from the model's pages.

Pure: no vLLM, no torch. A fixed default (256 MiB) suits tiny models and drops most stores of
a large one: one 8192-token prefill step of Qwen3-Next-80B copies out 192 MiB of attention
and a recurrent state set of 76 MiB at each state it stores, and each running request holds
its newest decoding state (one state set) until it finishes. So, unless the operator sets
them, the budgets follow this rank's page sizes and vLLM's step and batch limits:

* ``pending`` (stores copied out and not yet in their tiers): two full steps in flight, each
  ``step_tokens`` of attention and two state sets (one where the step ends, one at a tail or
  junction inside it);
* ``held`` (copies kept for requests until their keys are known): per request vLLM may run at
  once, a state set and one chunk of attention, at most ``cap`` bytes (the caller passes a
  share of the host's memory: held copies live in host memory).

Neither is ever below :data:`MIN_BUDGET_BYTES`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

from hybrid_offload.core.spec import GroupSpec

__all__ = [
    "MIN_BUDGET_BYTES",
    "StoreBudgets",
    "attention_bytes_per_token",
    "host_memory_bytes",
    "state_set_bytes",
    "store_budgets",
]

#: the smallest default budget (and the fixed default before budgets were sized)
MIN_BUDGET_BYTES = 256 << 20


@dataclass(frozen=True)
class StoreBudgets:
    """Bytes of stores in flight (``pending``) and of held copies (``held``)."""

    pending: int
    held: int


def attention_bytes_per_token(groups: Sequence[GroupSpec]) -> int:
    """K/V bytes one token takes in this rank's attention layers (every attention group)."""
    return sum(g.page_bytes * len(g.layer_names) // g.block_size for g in groups if g.is_attention)


def state_set_bytes(groups: Sequence[GroupSpec]) -> int:
    """Unpadded bytes of one request's recurrent state in this rank's Mamba/GDN layers."""
    return sum(g.state_bytes * len(g.layer_names) for g in groups if not g.is_attention)


def store_budgets(
    groups: Sequence[GroupSpec], step_tokens: int, max_requests: int, chunk_tokens: int, cap: int
) -> StoreBudgets:
    """The default budgets (see the module docstring) for a rank with ``groups``, steps of up
    to ``step_tokens`` tokens and up to ``max_requests`` requests running at once."""
    attention, states = attention_bytes_per_token(groups), state_set_bytes(groups)
    pending = 2 * (step_tokens * attention + 2 * states)
    held = min(max_requests * (states + chunk_tokens * attention), cap)
    return StoreBudgets(max(pending, MIN_BUDGET_BYTES), max(held, MIN_BUDGET_BYTES))


def host_memory_bytes() -> int:
    """This host's physical memory (0 where the platform does not say)."""
    with contextlib.suppress(ValueError, OSError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 0
