"""Tiny random-weight hybrid vision-language models that vLLM's CPU build serves offline.

:func:`build_vl_model` writes one of :data:`VL_ARCHS`, each a text model of
:func:`~hybrid_offload.testing.models.make_config` under a two-layer vision tower (hidden 128,
patch 16, 2x2 merge), the byte-level tokenizer with the model's image tokens, a chat template
placing the model's image placeholder for each image part, and processor configs (images of
64x64 to 256x256 pixels: 4 to 64 placeholder tokens each). Deterministic: the same seed gives the
same files. :func:`draw_image` draws the images tests send.

- ``qwen3_5_vl``: ``Qwen3_5ForConditionalGeneration`` (GDN + gated attention), placeholder
  ``<|vision_start|><|image_pad|><|vision_end|>``, with a video processor config.
- ``lfm2_vl``: ``Lfm2VlForConditionalGeneration`` (LFM2's short convolutions + attention under a
  SigLIP2 tower), placeholder ``<image>`` (vLLM expands it to ``<|image_start|>``, the image's
  ``<image>`` tokens, ``<|image_end|>``), no tiling.

Where torchvision does not import, vLLM loads their processors through our patches
(:mod:`~hybrid_offload.engine.patches.qwen_vl_without_torchvision`,
:mod:`~hybrid_offload.engine.patches.lfm2_vl_without_torchvision`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybrid_offload.testing.models import build_tokenizer, make_config, save_quietly

VL_ARCHS = ("qwen3_5_vl", "lfm2_vl")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
LFM2_IMAGE_TOKENS = ("<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>")
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")


def chat_template(image: str, video: str | None = None) -> str:
    """A chat template (ChatML, no tools) placing ``image`` for each image part and ``video``
    for each video part."""
    videos = f"{{% elif c['type'] == 'video' %}}{video}" if video else ""
    return (
        "{% for message in messages %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for c in message['content'] %}"
        "{% if c['type'] == 'image' or c['type'] == 'image_url' or c['type'] == 'image_pil' %}"
        f"{image}{videos}"
        "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


#: Qwen's: one vision run per image part
CHAT_TEMPLATE = chat_template(
    "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"
)
#: weights' std of the text model: higher than the text archs' so that what came before the
#: chat template's closing tokens (an image, an earlier turn) still changes the tokens
TEXT_INIT_STD = 0.3
#: scale of the vision tower's last projection, so that another image changes the tokens
IMAGE_GAIN = 30.0
#: image sizes the processor keeps (pixels): 64x64 .. 256x256, 4 to 64 placeholder tokens
MIN_PIXELS, MAX_PIXELS = 64 * 64, 256 * 256


def build_vl_model(out_dir: Path, *, arch: str = "qwen3_5_vl", seed: int = 0) -> Path:
    """Write the ``arch`` model (one of :data:`VL_ARCHS`) into ``out_dir`` (created if missing)
    and return it."""
    builders = {"qwen3_5_vl": _build_qwen3_5_vl, "lfm2_vl": _build_lfm2_vl}
    if arch not in builders:
        raise ValueError(f"unknown vision-language arch {arch!r}; expected one of {VL_ARCHS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return builders[arch](out_dir, seed)


def _tokenizer_and_text(arch: str, image_tokens: tuple[str, ...], template: str) -> tuple[Any, Any]:
    """The byte-level tokenizer with ``image_tokens``, the chat tokens and ``template``; the
    text model's config (:func:`make_config` of ``arch``) with a vocabulary that holds it."""
    tokenizer = build_tokenizer(2048)
    tokenizer.add_special_tokens({"additional_special_tokens": [*image_tokens, *CHAT_TOKENS]})
    tokenizer.chat_template = template
    text = make_config(arch, init_std=TEXT_INIT_STD)
    text.vocab_size = 64 * -(-len(tokenizer) // 64)
    return tokenizer, text


def _build_qwen3_5_vl(out_dir: Path, seed: int) -> Path:
    import torch
    from transformers import PreTrainedConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tokenizer, text = _tokenizer_and_text("qwen3_5", VISION_TOKENS, CHAT_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text_config = text.to_dict()
    text_config.pop("architectures", None)
    vision = {
        "depth": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_heads": 2,  # head dim 64, as the CPU attention wants
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": text.hidden_size,
        "num_position_embeddings": 256,
        "deepstack_visual_indexes": [],
    }
    config = Qwen3_5Config(
        text_config=text_config,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.dtype = "bfloat16"
    vision_config = config.vision_config
    assert isinstance(vision_config, PreTrainedConfig)  # made of the dict given
    # the text model's std (HF's 0.02 makes the vision tower's output too faint to change tokens)
    config.initializer_range = vision_config.initializer_range = text.initializer_range
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config)
    module: torch.nn.Module = model  # typed as a module: transformers' `to` wrapper types as a function
    module.to(torch.bfloat16)  # in place (the model's own `to` runs)
    with torch.no_grad():  # loud images: a random tower's output barely moves a random model's tokens
        model.model.visual.merger.linear_fc2.weight.mul_(IMAGE_GAIN)
    save_quietly(model, out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    common = {
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "processor_class": "Qwen3VLProcessor",
    }
    processors = {
        "preprocessor_config.json": {**common, "image_processor_type": "Qwen2VLImageProcessor"},
        "video_preprocessor_config.json": {
            **common, "video_processor_type": "Qwen3VLVideoProcessor",
            "fps": 2, "min_frames": 4, "max_frames": 8,
        },
    }  # fmt: skip
    for name, content in processors.items():
        (out_dir / name).write_text(json.dumps(content, indent=2, sort_keys=True))
    return out_dir


def _build_lfm2_vl(out_dir: Path, seed: int) -> Path:
    import torch
    from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration

    template = chat_template("<image>")
    tokenizer, text = _tokenizer_and_text("lfm2", LFM2_IMAGE_TOKENS, template)
    text.architectures = ["Lfm2ForCausalLM"]
    vision = {
        "model_type": "siglip2_vision_model", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 16,
        "num_patches": 256,  # position embeddings: 16 x 16 patches, a 256-px image
        "num_channels": 3, "initializer_range": TEXT_INIT_STD,
        "vision_use_head": False,  # LFM2-VL checkpoints have no pooling head; vLLM builds none
    }  # fmt: skip
    config = Lfm2VlConfig(
        text_config=text.to_dict(), vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        projector_hidden_size=128, downsample_factor=2, tie_word_embeddings=False,
    )  # fmt: skip
    config.architectures = ["Lfm2VlForConditionalGeneration"]
    config.dtype = "bfloat16"
    config.initializer_range = TEXT_INIT_STD
    torch.manual_seed(seed)
    model = Lfm2VlForConditionalGeneration(config)
    module: torch.nn.Module = model
    module.to(torch.bfloat16)
    with torch.no_grad():
        model.model.multi_modal_projector.linear_2.weight.mul_(IMAGE_GAIN)
    save_quietly(model, out_dir)
    _vision_model_prefix(out_dir / "model.safetensors")
    tokenizer.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(template)
    preprocessor = {
        "image_processor_type": "Lfm2VlImageProcessor", "processor_class": "Lfm2VlProcessor",
        "downsample_factor": 2, "encoder_patch_size": 16, "do_image_splitting": False,
        "min_tiles": 1, "max_tiles": 1, "use_thumbnail": False, "tile_size": 256,
        "min_image_tokens": MIN_PIXELS // (32 * 32), "max_image_tokens": MAX_PIXELS // (32 * 32),
        "max_pixels_tolerance": 2.0, "do_pad": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
    }  # fmt: skip
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2, sort_keys=True))
    processor = {"processor_class": "Lfm2VlProcessor"}
    (out_dir / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return out_dir


def _vision_model_prefix(path: Path) -> None:
    """transformers 5.19 saves LFM2-VL's SigLIP2 tower as ``model.vision_tower.{embeddings,
    encoder,post_layernorm}.*``; vLLM's ``Siglip2Model`` loads ``model.vision_tower.vision_model.*``
    (the published LFM2-VL checkpoints' layout): rename in place."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    old = "model.vision_tower."
    new = old + "vision_model."
    renamed = {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in tensors.items()}
    save_file(renamed, path, metadata={"format": "pt"})


def draw_image(seed: int, size: int = 64) -> Any:
    """A deterministic random RGB ``PIL.Image`` of ``size`` x ``size`` pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))

