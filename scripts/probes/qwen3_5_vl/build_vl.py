"""Build a tiny random-weight Qwen3.5 VL model (Qwen3_5ForConditionalGeneration) for vLLM CPU.

Usage: .venv/bin/python scripts/probes/qwen3_5_vl/build_vl.py OUT_DIR
"""

import json
import sys
import time
from pathlib import Path

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def main(out: Path) -> None:
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from hybrid_offload.testing.models import build_tokenizer, make_config

    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer(2048)
    tok.add_special_tokens({"additional_special_tokens": [*VISION_TOKENS, "<|im_start|>", "<|im_end|>"]})
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    print("tokenizer len", len(tok), ids)
    tok.chat_template = CHAT_TEMPLATE

    text = make_config("qwen3_5")  # hidden 256, 4 layers, GDN dims as in _qwen3_5
    text.vocab_size = 2112  # >= len(tok), multiple of 64
    text_dict = text.to_dict()
    text_dict.pop("architectures", None)

    vision = dict(
        depth=2,
        hidden_size=128,
        intermediate_size=256,
        num_heads=2,  # head_dim 64
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=256,
        num_position_embeddings=256,  # 16x16 grid of pos embeds
        deepstack_visual_indexes=[],
    )
    config = Qwen3_5Config(
        text_config=text_dict,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.dtype = "bfloat16"

    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # chat template also as a standalone file (vLLM/transformers pick either)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    # Small image sizes: 64x64 .. 128x128 pixels -> 2x2 .. 4x4 merged tokens.
    size = {"shortest_edge": 64 * 64, "longest_edge": 128 * 128}
    common = dict(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size=size,
        processor_class="Qwen3VLProcessor",
    )
    (out / "preprocessor_config.json").write_text(
        json.dumps(dict(common, image_processor_type="Qwen2VLImageProcessor"), indent=2)
    )
    (out / "video_preprocessor_config.json").write_text(
        json.dumps(
            dict(common, video_processor_type="Qwen3VLVideoProcessor", fps=2, min_frames=4, max_frames=8),
            indent=2,
        )
    )
    print("weights:", sorted({k.split(".")[0] + "." + k.split(".")[1] for k in model.state_dict()}))
    print(f"built {out} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "DIR"))
