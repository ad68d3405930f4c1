"""Patch: LFM2-VL's image processor where torchvision is not (vLLM's CPU build).

Why: vLLM's ``lfm2_vl`` module imports ``transformers.models.lfm2_vl.image_processing_lfm2_vl``,
whose first lines are ``from torchvision.transforms.v2 import functional as tvF``. transformers
ships no PIL variant of that processor (its auto mapping lists only a ``torchvision`` class), and
on a CPU engine no torchvision loads (see
:mod:`~hybrid_offload.engine.patches.qwen_vl_without_torchvision`). So LFM2-VL models fail vLLM's
model inspection there ("failed to be inspected"), and once importable, transformers refuses to
build their processor ("Missing optional dependencies: torchvision").

What: only where ``import torchvision`` fails,

- build :func:`functional`, the five functions of ``torchvision.transforms.v2.functional`` the
  processor calls (``pil_to_tensor``, ``resize``, ``normalize``, ``pad``, ``crop``) and its
  ``InterpolationMode``, in plain torch;
- import transformers' LFM2-VL image processor module with that module standing in for
  torchvision's only during the import (``is_torchvision_available()`` stays False for every
  other model), and give transformers' torchvision image-processor base the same functions and
  interpolation mappings, which it binds only where torchvision is available;
- register the processor for LFM2-VL configs under both backends, so transformers' auto class
  finds it when it asks for the PIL one.

Pixels differ slightly from torchvision's (its antialiased resize is not bit-equal to
``torch.nn.functional.interpolate``'s), and so do content keys of images
(``multimodal_keys: content``): caches are not shared between a machine with torchvision and one
without, as they are not between builds. Nothing of vLLM is changed; with torchvision
installed nothing is done. Applied in every vLLM process through the plugin entry point.
"""

from __future__ import annotations

import enum
import importlib
import sys
import types
from collections.abc import Sequence
from typing import Any

from hybrid_offload.compat import VLLM_RELEASES
from hybrid_offload.engine.patches import logger, torchvision_loads, version_supported

ENTRY_POINT = "hybrid_offload_lfm2_vl_without_torchvision"
VLLM_VERSIONS = VLLM_RELEASES
PROCESSOR_MODULE = "transformers.models.lfm2_vl.image_processing_lfm2_vl"
FUNCTIONAL = "torchvision.transforms.v2.functional"


class InterpolationMode(enum.Enum):
    """torchvision's names for resampling filters (transformers maps PIL's onto these)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


#: the filters torch's ``interpolate`` has; the others (box, hamming, lanczos) resize bilinearly
_TORCH_MODES = {
    InterpolationMode.NEAREST: "nearest",
    InterpolationMode.NEAREST_EXACT: "nearest-exact",
    InterpolationMode.BICUBIC: "bicubic",
}
_PAD_MODES = {"constant": "constant", "edge": "replicate", "reflect": "reflect"}


def pil_to_tensor(image: Any) -> Any:
    """A PIL image as a ``(C, H, W)`` tensor of its own dtype (uint8 for RGB)."""
    import numpy as np
    import torch

    array = np.array(image, copy=True)
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def resize(
    image: Any, size: Sequence[int], interpolation: InterpolationMode = InterpolationMode.BILINEAR,
    antialias: bool = True,
) -> Any:  # fmt: skip
    """``image`` (``(..., C, H, W)``) resized to ``size`` = ``(height, width)``; uint8 stays uint8
    (rounded and clamped, as torchvision does)."""
    import torch

    if isinstance(size, int) or len(size) != 2:
        raise TypeError(f"resize: size must be (height, width), got {size!r}")
    mode = _TORCH_MODES.get(interpolation, "bilinear")
    lead = image.shape[:-3]
    x = image.reshape(-1, *image.shape[-3:]).float()
    smooth = {} if mode.startswith("nearest") else {"align_corners": False, "antialias": antialias}
    x = torch.nn.functional.interpolate(x, size=[int(s) for s in size], mode=mode, **smooth)
    if image.dtype == torch.uint8:
        x = x.round().clamp(0, 255).to(torch.uint8)
    elif image.dtype != x.dtype:
        x = x.to(image.dtype)
    return x.reshape(*lead, *x.shape[-3:])


def normalize(image: Any, mean: Sequence[float], std: Sequence[float], inplace: bool = False) -> Any:
    """``(image - mean) / std`` per channel (``(..., C, H, W)``, a float tensor)."""
    import torch

    m = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return image.sub_(m).div_(s) if inplace else (image - m) / s


def pad(image: Any, padding: int | Sequence[int], fill: float = 0, padding_mode: str = "constant") -> Any:
    """``image`` padded by ``padding``: one value for all sides, (left/right, top/bottom), or
    (left, top, right, bottom), as torchvision reads it."""
    import torch

    sides = [padding] if isinstance(padding, int) else list(padding)
    if len(sides) not in (1, 2, 4) or padding_mode not in _PAD_MODES:
        raise ValueError(f"pad: unsupported padding {padding!r} / mode {padding_mode!r}")
    left, top, right, bottom = sides * 4 if len(sides) == 1 else (sides * 2 if len(sides) == 2 else sides)
    mode = _PAD_MODES[padding_mode]
    value = {"value": fill} if mode == "constant" else {}
    return torch.nn.functional.pad(image, (left, right, top, bottom), mode=mode, **value)


def crop(image: Any, top: int, left: int, height: int, width: int) -> Any:
    return image[..., top : top + height, left : left + width]


def functional() -> types.ModuleType:
    """A module standing in for ``torchvision.transforms.v2.functional``: the functions above."""
    module = types.ModuleType(FUNCTIONAL, "hybrid_offload's stand-in (LFM2-VL's image processor only)")
    for f in (pil_to_tensor, resize, normalize, pad, crop):
        setattr(module, f.__name__, f)
    module.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    module._hybrid_offload_patch = True  # type: ignore[attr-defined]
    return module


def _ours(processor_module: types.ModuleType | None) -> bool:
    """Whether ``processor_module`` was imported with our stand-in."""
    return bool(getattr(getattr(processor_module, "tvF", None), "_hybrid_offload_patch", False))


def _import_processor(tvf: types.ModuleType) -> Any:
    """transformers' LFM2-VL image processor class, imported with ``tvf`` as torchvision's
    functional module for that import only."""
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2")
    fake = {name: types.ModuleType(name) for name in names}
    fake["torchvision.transforms.v2"].functional = tvf  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in (*names, FUNCTIONAL)}
    sys.modules.update({**fake, FUNCTIONAL: tvf})
    try:
        return importlib.import_module(PROCESSOR_MODULE).Lfm2VlImageProcessor
    finally:
        for name, before in saved.items():
            if before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before


def install() -> None:
    """Make LFM2-VL's image processor importable and the one transformers builds (idempotent)."""
    from transformers import AutoImageProcessor, Lfm2VlConfig
    from transformers import image_processing_backends as backends
    from transformers.image_utils import PILImageResampling

    current = sys.modules.get(PROCESSOR_MODULE)
    ours = current if current is not None and _ours(current) else None
    tvf = ours.tvF if ours is not None else functional()
    mapping = {
        PILImageResampling.NEAREST: InterpolationMode.NEAREST_EXACT,
        PILImageResampling.BOX: InterpolationMode.BOX,
        PILImageResampling.BILINEAR: InterpolationMode.BILINEAR,
        PILImageResampling.HAMMING: InterpolationMode.HAMMING,
        PILImageResampling.BICUBIC: InterpolationMode.BICUBIC,
        PILImageResampling.LANCZOS: InterpolationMode.LANCZOS,
    }
    backends.tvF = tvf
    backends.pil_torch_interpolation_mapping = mapping
    backends.torch_pil_interpolation_mapping = {v: k for k, v in mapping.items()}
    processor = ours.Lfm2VlImageProcessor if ours is not None else _import_processor(tvf)
    # registering "pil" alone raises: the "torchvision" entry there is a placeholder class
    AutoImageProcessor.register(
        Lfm2VlConfig, image_processor_classes={"pil": processor, "torchvision": processor}, exist_ok=True
    )


def register() -> None:
    """Install the stand-in where torchvision does not load (idempotent)."""
    current = sys.modules.get(PROCESSOR_MODULE)
    if (current is not None and not _ours(current)) or (current is None and torchvision_loads()):
        return  # imported already with torchvision working, or torchvision loads
    if not version_supported(ENTRY_POINT, VLLM_VERSIONS, "LFM2-VL models fail to load without torchvision"):
        return
    try:
        install()
    except ImportError as exc:  # a transformers without LFM2-VL: nothing to stand in
        logger.warning("hybrid_offload: patch %s not applied: %s", ENTRY_POINT, exc)
