"""Patch: prefill steps also stop where the connector stores recurrent state.

In "align" mode vLLM holds a Mamba/GDN state only at the end of a scheduler step, and it ends
prefill steps where *its* block size says (`Scheduler._mamba_block_aligned_split`). That block
size is not even the same in one engine: the EngineCore of a multi-process engine splits at
multiples of the platform's default block (128 tokens on CPU), an in-process engine at the
enlarged hybrid block (e.g. 640). The connector needs states at its own checkpoints (the
prompt's tail, every `checkpoint_interval_tokens`, junctions where requests branch), so the
wrapped split also stops at the first checkpoint the connector names strictly inside the step
(`HybridOffloadConnector.prefill_stop`; `HybridMultiConnector.prefill_stop` adds its children's);
it only ever shortens a step. Other connectors (and a vLLM MultiConnector wrapping ours) have no
`prefill_stop` and are left alone. vLLM's own scheduler resumes a step that starts inside a
block (it stops at the next block boundary), as it does for its own tail and junction stops.
Applied only where the split has the signature it was written for.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from hybrid_offload.engine.patches import is_patched, mark, version_supported, warn_not_applied

ENTRY_POINT = "hybrid_offload_prefill_stops"
VLLM_VERSIONS = ("0.32.",)
_SPLIT_PARAMS = ["self", "request", "num_new_tokens", "num_new_local_computed_tokens",
                 "num_external_computed_tokens"]
_WITHOUT = "recurrent states are stored only where vLLM ends prefill steps by itself"


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
        n = current(self, request, num_new_tokens, num_new_local_computed_tokens,
                    num_external_computed_tokens)
        stop = getattr(self.connector, "prefill_stop", None)
        if stop is None or n <= 0:
            return n
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        return min(n, max(stop(request, start, start + n) - start, 1))

    Scheduler._mamba_block_aligned_split = mark(_mamba_block_aligned_split)  # type: ignore[method-assign]
