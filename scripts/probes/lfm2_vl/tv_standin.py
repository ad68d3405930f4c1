"""Probe-only stand-in: transformers' ``Lfm2VlImageProcessor`` (torchvision backend only) where
torchvision does not import. NOT part of the product.

transformers 5.19's ``models/lfm2_vl/image_processing_lfm2_vl.py`` starts with
``from torchvision.transforms.v2 import functional as tvF`` and subclasses ``TorchvisionBackend``
(whose module binds ``tvF`` only when torchvision is available); the auto mapping lists no PIL
variant. The processor needs five functions of ``tvF``, all plain torch: ``pil_to_tensor``,
``resize`` (bilinear/bicubic, antialias), ``normalize``, ``pad``, ``crop`` plus the
``InterpolationMode`` enum. This module provides them, imports the real LFM2-VL image processor
module with a fake ``torchvision.transforms.v2.functional`` in ``sys.modules`` only for that
import (so ``is_torchvision_available()`` stays False for everyone else), and injects ``tvF``
and the interpolation mappings into ``transformers.image_processing_backends``.
"""

from __future__ import annotations

import enum
import importlib
import sys
import types


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _functional() -> types.ModuleType:
    import numpy as np
    import torch

    tvf = types.ModuleType("torchvision.transforms.v2.functional")

    def pil_to_tensor(image):
        return torch.from_numpy(np.array(image, copy=True)).permute(2, 0, 1).contiguous()

    def resize(image, size, interpolation=InterpolationMode.BILINEAR, antialias=True):
        mode = {
            InterpolationMode.BICUBIC: "bicubic",
            InterpolationMode.NEAREST: "nearest",
            InterpolationMode.NEAREST_EXACT: "nearest-exact",
        }.get(interpolation, "bilinear")
        dtype = image.dtype
        x = image.float()
        squeeze = x.ndim == 3
        if squeeze:
            x = x[None]
        aa = antialias and mode in ("bilinear", "bicubic")
        x = torch.nn.functional.interpolate(
            x,
            size=list(size),
            mode=mode,
            antialias=aa,
            **({} if mode.startswith("nearest") else {"align_corners": False}),
        )
        if squeeze:
            x = x[0]
        if dtype == torch.uint8:
            x = x.round().clamp(0, 255).to(torch.uint8)
        return x

    def normalize(image, mean, std, inplace=False):
        mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
        return image.sub_(mean).div_(std) if inplace else (image - mean) / std

    def pad(image, padding, fill=0, padding_mode="constant"):
        left, top, right, bottom = (
            (padding * 4)[:4]
            if len(padding) == 1
            else (padding * 2 if len(padding) == 2 else padding)
        )
        return torch.nn.functional.pad(image, (left, right, top, bottom), value=fill)

    def crop(image, top, left, height, width):
        return image[..., top : top + height, left : left + width]

    for f in (pil_to_tensor, resize, normalize, pad, crop):
        setattr(tvf, f.__name__, f)
    tvf.InterpolationMode = InterpolationMode
    return tvf


def install() -> None:
    try:
        importlib.import_module("torchvision")
        return  # a working torchvision: nothing to do
    except Exception:
        sys.modules.pop("torchvision", None)
    from transformers import image_processing_backends as backends
    from transformers.image_utils import PILImageResampling

    tvf = _functional()
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
    fake = {
        "torchvision": types.ModuleType("torchvision"),
        "torchvision.transforms": types.ModuleType("torchvision.transforms"),
        "torchvision.transforms.v2": types.ModuleType("torchvision.transforms.v2"),
        "torchvision.transforms.v2.functional": tvf,
    }
    fake["torchvision.transforms.v2"].functional = tvf
    sys.modules.update(fake)
    try:
        importlib.import_module("transformers.models.lfm2_vl.image_processing_lfm2_vl")
    finally:
        for name in fake:
            sys.modules.pop(name, None)
    # transformers' auto mapping has LFM2-VL's processor under "torchvision" only, and
    # AutoImageProcessor resolves the "pil" backend without torchvision: register it under both
    from transformers import AutoImageProcessor, Lfm2VlConfig
    from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor

    AutoImageProcessor.register(
        Lfm2VlConfig,
        image_processor_classes={"pil": Lfm2VlImageProcessor, "torchvision": Lfm2VlImageProcessor},
        exist_ok=True,
    )
