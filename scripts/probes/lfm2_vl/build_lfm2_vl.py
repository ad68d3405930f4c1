"""Probe (issue 44): the smallest random-weight LFM2-VL (``Lfm2VlForConditionalGeneration``) that
vLLM's ``Lfm2VLForConditionalGeneration`` accepts.

Text: ``make_config("lfm2")`` (4 layers, conv / attention alternating). Vision: a 2-layer
siglip2 tower (hidden 128, 2 heads: head dim 64, patch 16, 256 position embeddings = 16x16).
Processor: no tiling (``do_image_splitting`` off), 4..64 image tokens (64..256 px square
images: after the 2x pixel-unshuffle one token covers 32x32 px).

    python scripts/probes/lfm2_vl/build_lfm2_vl.py OUT_DIR [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybrid_offload.testing.models import build_tokenizer, make_config

IMAGE_TOKENS = ("<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>")
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' or c['type'] == 'image_pil' %}<image>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT_INIT_STD = 0.3
IMAGE_GAIN = 30.0


def build(out_dir: Path, *, seed: int = 0, dtype: str = "bfloat16") -> Path:
    import torch
    from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(2048)
    tokenizer.add_special_tokens({"additional_special_tokens": [*IMAGE_TOKENS, *CHAT_TOKENS]})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")

    text = make_config("lfm2", init_std=TEXT_INIT_STD)
    text.vocab_size = 64 * -(-len(tokenizer) // 64)
    text.architectures = ["Lfm2ForCausalLM"]
    text_config = text.to_dict()
    vision = {
        "model_type": "siglip2_vision_model",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,  # head dim 64
        "patch_size": 16,
        "num_patches": 256,
        "num_channels": 3,
        "initializer_range": TEXT_INIT_STD,
        "vision_use_head": False,  # LFM2-VL checkpoints have no pooling head; vLLM builds none
    }
    config = Lfm2VlConfig(
        text_config=text_config,
        vision_config=vision,
        image_token_id=image_token_id,
        projector_hidden_size=128,
        downsample_factor=2,
        tie_word_embeddings=False,
    )
    config.architectures = ["Lfm2VlForConditionalGeneration"]
    config.dtype = dtype
    config.initializer_range = TEXT_INIT_STD
    torch.manual_seed(seed)
    model = Lfm2VlForConditionalGeneration(config).to(getattr(torch, dtype))
    with torch.no_grad():
        model.model.multi_modal_projector.linear_2.weight.mul_(IMAGE_GAIN)
    model.save_pretrained(out_dir)
    _vision_model_prefix(out_dir / "model.safetensors")
    tokenizer.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    preprocessor = {
        "image_processor_type": "Lfm2VlImageProcessor",
        "processor_class": "Lfm2VlProcessor",
        "downsample_factor": 2,
        "do_image_splitting": False,
        "min_tiles": 1,
        "max_tiles": 1,
        "use_thumbnail": False,
        "min_image_tokens": 4,
        "max_image_tokens": 64,
        "encoder_patch_size": 16,
        "tile_size": 256,
        "max_pixels_tolerance": 2.0,
        "do_pad": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    (out_dir / "preprocessor_config.json").write_text(
        json.dumps(preprocessor, indent=2, sort_keys=True)
    )
    (out_dir / "processor_config.json").write_text(
        json.dumps({"processor_class": "Lfm2VlProcessor"}, indent=2)
    )
    return out_dir


def _vision_model_prefix(path: Path) -> None:
    """transformers 5.19 saves the siglip2 tower as ``model.vision_tower.{embeddings,encoder,
    post_layernorm}.*``; vLLM's ``Siglip2Model`` (lfm2_siglip2.py) loads
    ``vision_tower.vision_model.*`` (the published LFM2-VL checkpoints' layout): rename."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    old = "model.vision_tower."
    renamed = {
        (old + "vision_model." + k[len(old) :] if k.startswith(old) else k): v
        for k, v in tensors.items()
    }
    save_file(renamed, path, metadata={"format": "pt"})


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    print(build(args.out_dir, dtype=args.dtype))
