"""Patch: prefill steps also stop where the connector stores recurrent state.

In "align" mode vLLM holds a Mamba/GDN state only at the end of a scheduler step, and it ends
prefill steps where *its* block size says (`Scheduler._mamba_block_aligned_split`). That block
size is not even the same in one engine: the EngineCore of a multi-process engine splits at
multiples of the platform's default block (128 tokens on CPU), an in-process engine at the
enlarged hybrid block (e.g. 640). The connector needs states at its own checkpoints (the
prompt's tail, junctions where requests branch), so the wrapped split also stops at the first
checkpoint the connector names strictly inside the step (`HybridOffloadConnector.prefill_stop`;
`HybridMultiConnector.prefill_stop` adds its children's); it only ever shortens a step. States
every `checkpoint_interval_tokens` are taken where vLLM's steps end (the split tells the
connector what they end on: blocks in ``align`` mode), so they cost no step. Other connectors
(and a vLLM MultiConnector wrapping ours) have no `prefill_stop` and are left alone. vLLM's
own scheduler resumes a step that starts inside a block (it stops at the next block
boundary), as it does for its own tail and junction stops.
Applied only where the split has the signature it was written for.

In other Mamba cache modes (``none``: prefix caching off, the mode speculative decoding runs in
on CPU) vLLM never calls the split, so no prefill step would stop at a checkpoint and states
would be stored only where steps happen to end. The patch therefore also wraps
``Scheduler.__init__``: when the scheduler's connector has ``prefill_stop`` and the model has
Mamba layers, the split is called in every mode, and outside ``align`` it applies the
connector's stops only (vLLM's block alignment is an ``align``-mode rule). The connector also
uses it to end decoding steps with draft tokens before a chunk boundary's last position
(:meth:`~hybrid_offload.connector.scheduler.store_plan.StorePlanner.decode_stop`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from hybrid_offload.compat import VLLM_RELEASES
from hybrid_offload.engine.patches import is_patched, mark, version_supported, warn_not_applied

ENTRY_POINT = "hybrid_offload_prefill_stops"
VLLM_VERSIONS = VLLM_RELEASES
_SPLIT_PARAMS = ["self", "request", "num_new_tokens", "num_new_local_computed_tokens",
                 "num_external_computed_tokens"]
_WITHOUT = "recurrent states are stored only where vLLM ends prefill steps by itself"
#: set on schedulers whose split runs only for the connector's stops (not ``align`` mode)
_OWN_STOPS_ONLY = "_hybrid_offload_own_stops_only"


def register() -> None:
    """Patch `Scheduler._mamba_block_aligned_split` (every platform)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    current = Scheduler._mamba_block_aligned_split
    if not version_supported(ENTRY_POINT, VLLM_VERSIONS, _WITHOUT) or is_patched(current):
        return
    params = list(inspect.signature(current).parameters)
    if params != _SPLIT_PARAMS:
        warn_not_applied(ENTRY_POINT, f"the split takes {params}, not {_SPLIT_PARAMS}", _WITHOUT)
        return

    @functools.wraps(current)
    def _mamba_block_aligned_split(
        self: Any, request: Any, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        own_only = getattr(self, _OWN_STOPS_ONLY, False)
        if own_only:
            n = num_new_tokens
        else:
            n = current(self, request, num_new_tokens, num_new_local_computed_tokens,
                        num_external_computed_tokens)
        stop = getattr(self.connector, "prefill_stop", None)
        if stop is None or n <= 0:
            return n
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        align = 1 if own_only else self.cache_config.block_size  # vLLM's own steps end on blocks
        return min(n, max(stop(request, start, start + n, align) - start, 1))

    Scheduler._mamba_block_aligned_split = mark(_mamba_block_aligned_split)  # type: ignore[method-assign]
    if not is_patched(Scheduler.__init__):
        Scheduler.__init__ = split_in_every_mode(Scheduler.__init__)  # type: ignore[method-assign]


def split_in_every_mode(init: Any) -> Any:
    """Wrap ``Scheduler.__init__``: with a connector that names stops and Mamba layers, the
    split runs outside ``align`` mode too, applying the connector's stops only."""

    @functools.wraps(init)
    def init_with_stops(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        wants = getattr(getattr(self, "connector", None), "prefill_stop", None) is not None
        if wants and self.has_mamba_layers and not self.need_mamba_block_aligned_split:
            self.need_mamba_block_aligned_split = True
            setattr(self, _OWN_STOPS_ONLY, True)

    return mark(init_with_stops)
