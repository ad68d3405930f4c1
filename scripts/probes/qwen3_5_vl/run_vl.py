"""Run the tiny Qwen3.5 VL model on vLLM CPU with one image; probe prefix caching + mm_features.

Usage: VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
    .venv/bin/python scripts/probes/qwen3_5_vl/run_vl.py DIR
"""

import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def image(seed: int, size: int = 64):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def register_video_processor_without_torchvision() -> None:
    """BLOCKER 1 workaround: without torchvision, transformers' AutoVideoProcessor resolves
    "Qwen3VLVideoProcessor" to a dummy that raises ImportError, so Qwen3VLProcessor (which vLLM's
    Qwen3VLProcessingInfo.get_hf_processor builds, even for image-only use) cannot load. The real
    class imports fine from its own module (torchvision is only used to process video frames);
    register it so the auto class finds it by name."""
    import transformers
    from transformers import Qwen3_5Config, video_processing_utils
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    AutoVideoProcessor.register(Qwen3_5Config, Qwen3VLVideoProcessor, exist_ok=True)
    # BLOCKER 2: ProcessorMixin.check_argument_for_proper_class looks up "VideoProcessorMixin"
    # on the top-level transformers module, where it is a torchvision dummy (then falls into
    # VIDEO_PROCESSOR_MAPPING._extra_content, also a dummy); put the real class there.
    transformers.VideoProcessorMixin = video_processing_utils.VideoProcessorMixin
    transformers.BaseVideoProcessor = video_processing_utils.BaseVideoProcessor
    transformers.AutoVideoProcessor = AutoVideoProcessor
    transformers.Qwen3VLVideoProcessor = Qwen3VLVideoProcessor


def main(model: str) -> None:
    import hybrid_offload.engine.patches.qwen_vl_without_torchvision as p  # image processor stand-in

    p.register()
    register_video_processor_without_torchvision()
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=4,
        enable_prefix_caching=True,
        limit_mm_per_prompt={"image": 1, "video": 0},
        enforce_eager=True,
    )
    t_start = time.time() - t0
    print(f"ENGINE START {t_start:.1f}s")

    # capture Request objects the scheduler sees
    engine_core = llm.llm_engine.engine_core.engine_core
    sched = engine_core.scheduler
    seen = {}
    orig_add = sched.add_request

    def add_request(request):
        seen[request.request_id] = request
        return orig_add(request)

    sched.add_request = add_request

    sp = SamplingParams(max_tokens=8, temperature=0.0)
    # hybrid model: attention block size is raised to 640 (mamba page-size alignment), so put
    # ~700 text tokens before the image and ~700 after: block 0 = text only, block 1 = image.
    prefix = "the people of the new year " * 110
    suffix = " and then it was the time of all the other people " * 60
    prompt = (
        f"<|im_start|>user\n{prefix}<|vision_start|><|image_pad|><|vision_end|>"
        f"{suffix}<|im_end|>\n<|im_start|>assistant\n"
    )

    def go(label, img):
        t = time.time()
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": img}}, sp, use_tqdm=False)[0]
        dt = time.time() - t
        print(
            f"[{label}] {dt:.2f}s prompt_tokens={len(out.prompt_token_ids)} "
            f"num_cached_tokens={out.num_cached_tokens} out={out.outputs[0].token_ids}"
        )
        req = list(seen.values())[-1]
        for f in req.mm_features or []:
            print(
                f"   mm_feature: modality={f.modality} identifier={f.identifier} "
                f"mm_hash={getattr(f, 'mm_hash', None)} "
                f"mm_position=(offset={f.mm_position.offset}, length={f.mm_position.length}, "
                f"is_embed={None if f.mm_position.is_embed is None else int(f.mm_position.is_embed.sum())})"
            )
            data = f.data
            if data is not None:
                print("   data keys:", {k: tuple(getattr(v.data, "shape", ())) for k, v in data.items()})
        bh = getattr(req, "block_hashes", None)
        if bh is not None:
            from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

            print(
                f"   block_size={sched.cache_config.block_size} "
                f"mamba_cache_mode={getattr(sched.cache_config, 'mamba_cache_mode', None)} "
                f"n_block_hashes={len(bh)}"
            )
            if bh:
                hsz = sched.cache_config.block_size  # == hash block size here (one hash per 640 tokens)
                for i in range(len(bh)):
                    keys, _ = generate_block_hash_extra_keys(req, i * hsz, (i + 1) * hsz, 0)
                    if keys:
                        print(f"   block {i} [{i * hsz},{(i + 1) * hsz}) extra_keys={keys}")
        return out

    a = go("img A #1", image(1))
    go("img A #2 (identical)", image(1))
    go("img B same size", image(2))
    go("img A #3", image(1))

    # chat API too
    t = time.time()
    out = llm.chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_pil", "image_pil": image(3)},
                    {"type": "text", "text": "what is it"},
                ],
            }
        ],
        sp,
        use_tqdm=False,
    )[0]
    print(
        f"[chat] {time.time() - t:.2f}s prompt_tokens={len(out.prompt_token_ids)} "
        f"cached={out.num_cached_tokens} out={out.outputs[0].token_ids}"
    )
    print("prompt len:", len(a.prompt_token_ids))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "DIR")
