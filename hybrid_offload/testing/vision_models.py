"""A tiny random-weight Qwen3.5 vision-language model that vLLM's CPU build serves offline.

:func:`build_vl_model` writes ``Qwen3_5ForConditionalGeneration``: the text model of
:func:`~hybrid_offload.testing.models.make_config` ``("qwen3_5")`` (GDN + gated attention) under
a two-block vision tower (hidden 128, patch 16, merge 2), the byte-level tokenizer with Qwen's
vision tokens, a chat template that places ``<|vision_start|><|image_pad|><|vision_end|>`` for
each image, and image / video processor configs (images of 64x64 to 256x256 pixels: 4 to 64
placeholder tokens each). Deterministic: the same seed gives the same files. :func:`draw_image`
draws the images tests send.

The patch ``hybrid_offload_qwen_vl_without_torchvision`` (see
:mod:`~hybrid_offload.engine.patches.qwen_vl_without_torchvision`) lets vLLM load its processor
where torchvision does not import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybrid_offload.testing.models import build_tokenizer, make_config, save_quietly

VL_ARCHS = ("qwen3_5_vl",)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
#: a chat template placing one vision run per image part (Qwen's own, without tools)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' or c['type'] == 'image_pil' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: weights' std of the text model: higher than the text archs' so that what came before the
#: chat template's closing tokens (an image, an earlier turn) still changes the tokens
TEXT_INIT_STD = 0.3
#: scale of the vision tower's last projection, so that another image changes the tokens
IMAGE_GAIN = 30.0
#: image sizes the processor keeps (pixels): 64x64 .. 256x256, 4 to 64 placeholder tokens
MIN_PIXELS, MAX_PIXELS = 64 * 64, 256 * 256


def build_vl_model(out_dir: Path, *, seed: int = 0) -> Path:
    """Write the model into ``out_dir`` (created if missing) and return it."""
    import torch
    from transformers import PreTrainedConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(2048)
    tokenizer.add_special_tokens({"additional_special_tokens": [*VISION_TOKENS, *CHAT_TOKENS]})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}

    text = make_config("qwen3_5", init_std=TEXT_INIT_STD)
    text.vocab_size = 64 * -(-len(tokenizer) // 64)
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


def draw_image(seed: int, size: int = 64) -> Any:
    """A deterministic random RGB ``PIL.Image`` of ``size`` x ``size`` pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))

