"""vLLM's real scheduler at a GPU engine's sizes, on a machine without a GPU.

A GPU engine of a hybrid model raises the attention block until an attention page holds a
Mamba/GDN state (``Platform._align_hybrid_block_size``): 544 tokens for Qwen3-Next-80B at TP 1
and 2, 272 at TP 4 (its GDN state in bf16, as a GPU engine keeps it). How vLLM then cuts a
prefill into steps (its ``align``-mode split, our ``prefill_stops`` patch, the connector's
stops) is scheduler code that runs anywhere, so
:func:`build_scheduler` builds vLLM's own :class:`~vllm.v1.core.sched.scheduler.Scheduler`
from a real model config (written to a directory, no weights) with that block size, and
:func:`prefill_steps` drives one request through it as the engine core would, counting steps.

The block size is vLLM's formula with the GPU attention backends' kernel alignment (16 tokens,
FlashAttention's and FlashInfer's smallest kernel block) and the state dtype a GPU engine keeps:
the CPU platform this runs on would pick its own (it forces float32 states for its kernels).
:func:`geometry` gives the bytes a model's pages take, for ``bench trace``.
"""

from __future__ import annotations

import dataclasses
import math
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_offload.testing.models import extra_fields

if TYPE_CHECKING:
    from vllm.config.cache import MambaCacheMode, MambaDType

__all__ = [
    "MODELS", "SCHEDULER_MODELS", "build_scheduler", "geometry", "geometry_of", "gpu_block_size",
    "prefill_steps",
]  # fmt: skip

#: the smallest kernel block of vLLM's GPU attention backends (FlashAttention, FlashInfer)
GPU_KERNEL_ALIGNMENT = 16
#: the context the scheduler is built for
MAX_MODEL_LEN = 131072


def _qwen3_next_80b() -> Any:
    """Qwen3-Next-80B-A3B: 48 layers, every 4th full attention (2 KV heads x 256), GDN with
    16 key heads and 32 value heads of 128."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, intermediate_size=5120, vocab_size=151936, max_position_embeddings=262144,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(48)],
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512,
    )  # fmt: skip


def _nemotron_h_8b() -> Any:
    """Nemotron-H-8B-shaped: 52 layers ("M-" with an attention layer "*" every ~8), attention
    32 heads (8 KV) x 128, Mamba2 128 heads x 64, state 128, 8 groups."""
    from transformers import NemotronHConfig

    pattern = ("M-M-M-M*-" * 6 + "M-M-M-M-")[:52]
    return NemotronHConfig(
        hidden_size=4096, **extra_fields(num_hidden_layers=52, hybrid_override_pattern=pattern),
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=21504,
        vocab_size=131072,
        mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
        expand=2, max_position_embeddings=131072,
    )  # fmt: skip


def _falcon_h1_34b() -> Any:
    """Falcon-H1-34B: 72 layers, each with attention (20 heads, 4 KV, x 128) and Mamba2 beside
    it (32 heads x 128, state 256)."""
    from transformers import FalconH1Config

    return FalconH1Config(
        hidden_size=5120, num_hidden_layers=72, num_attention_heads=20, num_key_value_heads=4,
        **extra_fields(head_dim=128), intermediate_size=21504, vocab_size=261120,
        max_position_embeddings=262144,
        mamba_d_ssm=4096, mamba_n_heads=32, mamba_d_head=128, mamba_n_groups=1, mamba_d_state=256,
        mamba_d_conv=4, mamba_expand=2,
    )  # fmt: skip


#: the recurrent state's dtype a GPU engine keeps (vLLM's CPU platform forces float32 where its
#: own kernels need it; NemotronH's config class picks float32 on every platform)
GPU_SSM_DTYPES: dict[str, MambaDType] = {
    "qwen3_next_80b": "auto", "nemotron_h_8b": "float32", "falcon_h1_34b": "auto",
}  # fmt: skip

#: model name -> its config (shapes as published; no weights needed)
MODELS = {"qwen3_next_80b": _qwen3_next_80b, "nemotron_h_8b": _nemotron_h_8b, "falcon_h1_34b": _falcon_h1_34b}

#: the models :func:`build_scheduler` can build (Falcon-H1's layers hold both kinds: :func:`geometry` only)
SCHEDULER_MODELS = ("qwen3_next_80b", "nemotron_h_8b")


def _specs(vllm_config: Any, block: int, mode: str = "align") -> tuple[Any, Any]:
    """(attention, Mamba) KV cache specs of one layer at ``block`` tokens a block (the Mamba
    page padded to the attention page; ``mode`` ``none``: a state block of ``max_model_len``)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import is_hybrid
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    model = vllm_config.model_config
    cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
    if not is_hybrid(cls):
        raise ValueError(f"{model.architecture} keeps no Mamba state")
    attention = FullAttentionSpec(
        block_size=block, num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
        head_size=model.get_head_size(), dtype=model.dtype,
    )  # fmt: skip
    mamba = MambaSpec(
        shapes=cls.get_mamba_state_shape_from_config(vllm_config),
        dtypes=cls.get_mamba_state_dtype_from_config(vllm_config),
        block_size=block if mode == "align" else model.max_model_len,
        page_size_padded=attention.page_size_bytes, mamba_type=_mamba_type(model.hf_config),
        mamba_cache_mode=mode,
    )  # fmt: skip
    return attention, mamba


def gpu_block_size(vllm_config: Any) -> int:
    """vLLM's hybrid block size for this config on a GPU (``_align_hybrid_block_size``'s
    arithmetic with :data:`GPU_KERNEL_ALIGNMENT`)."""
    attention, mamba = _specs(vllm_config, 1)
    state = dataclasses.replace(mamba, page_size_padded=None).page_size_bytes
    return GPU_KERNEL_ALIGNMENT * math.ceil(state / (GPU_KERNEL_ALIGNMENT * attention.page_size_bytes))


def _kv_cache_config(vllm_config: Any, block: int, num_blocks: int, mode: str) -> Any:
    """The KV cache groups vLLM forms for the model: its attention layers in one group, its
    Mamba layers in groups of as many layers, every page as large as an attention block's."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    types = _layer_types(vllm_config.model_config.hf_config)
    attention = [i for i, t in enumerate(types) if t == "attention"]
    mamba = [i for i, t in enumerate(types) if t == "mamba"]
    attention_spec, mamba_spec = _specs(vllm_config, block, mode)
    per_group = len(attention)
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn" for i in attention], attention_spec)]
    for g in range(math.ceil(len(mamba) / per_group)):
        names = [f"model.layers.{i}.mixer" for i in mamba[g * per_group : (g + 1) * per_group]]
        groups.append(KVCacheGroupSpec(names, mamba_spec))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def _layer_types(hf: Any) -> list[str]:
    if hf.model_type == "falcon_h1":
        return ["both"] * hf.num_hidden_layers
    if hf.model_type == "qwen3_next":
        return ["attention" if t == "full_attention" else "mamba" for t in hf.layer_types]
    pattern = hf.hybrid_override_pattern
    return ["attention" if c == "*" else "mamba" if c == "M" else "mlp" for c in pattern]


def _mamba_type(hf: Any) -> Any:
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    gdn = hf.model_type == "qwen3_next"
    return MambaAttentionBackendEnum.GDN_ATTN if gdn else MambaAttentionBackendEnum.MAMBA2


def build_scheduler(
    model: str, tp: int, connector: dict[str, Any] | None = None, max_num_batched_tokens: int = 8192,
    num_blocks: int = 2000, workdir: Path | None = None, prefix_caching: bool = True,
) -> Any:  # fmt: skip
    """vLLM's scheduler for ``model`` (a :data:`MODELS` name) at tensor parallel size ``tp``,
    GPU block size, Mamba cache mode ``align`` (without ``prefix_caching``: ``none``, one state
    block of ``max_model_len`` per request), with our connector when ``connector`` (its
    ``kv_connector_extra_config``) is given; ``scheduler.block_size`` is the scheduling block
    (the lcm of the groups' blocks, as the engine passes it). Registers the ``prefill_stops``
    patch, as the engine's plugin does."""
    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from hybrid_offload.engine.patches import prefill_stops

    prefill_stops.register()
    max_len, mode = MAX_MODEL_LEN, "align" if prefix_caching else "none"
    config = _vllm_config(model, tp, max_num_batched_tokens, prefix_caching, workdir)
    block = gpu_block_size(config)
    config.cache_config.block_size = block
    config.cache_config.mamba_block_size = block if prefix_caching else max_len
    kv_cache_config = _kv_cache_config(config, block, num_blocks, mode)
    page = kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    config.cache_config.mamba_page_size_padded = page
    config.cache_config.num_gpu_blocks = num_blocks
    if connector is not None:
        config.kv_transfer_config = KVTransferConfig(
            kv_connector="HybridOffloadConnector", kv_connector_module_path="hybrid_offload.connector",
            kv_role="kv_both", kv_connector_extra_config={"model_version": f"{model}-shapes", **connector},
        )  # fmt: skip
    return Scheduler(
        vllm_config=config, kv_cache_config=kv_cache_config, log_stats=False,
        block_size=block if prefix_caching else math.lcm(block, max_len),
        structured_output_manager=StructuredOutputManager(config),
    )  # fmt: skip


def _vllm_config(
    model: str, tp: int = 1, max_num_batched_tokens: int = 8192, prefix_caching: bool = True,
    workdir: Path | None = None,
) -> Any:  # fmt: skip
    """vLLM's config of ``model`` (its config written to a folder, no weights), bf16, with the
    state dtype of a GPU engine (:data:`GPU_SSM_DTYPES`)."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

    folder = Path(workdir or tempfile.gettempdir()) / f"hybrid-offload-{model}"  # one name at every TP
    folder.mkdir(parents=True, exist_ok=True)
    hf = MODELS[model]()
    hf.dtype = "bfloat16"
    hf.save_pretrained(folder)
    max_len = MAX_MODEL_LEN
    mode: MambaCacheMode = "align" if prefix_caching else "none"
    config = VllmConfig(
        model_config=ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16",
                                 max_model_len=max_len),
        cache_config=CacheConfig(enable_prefix_caching=prefix_caching, mamba_cache_mode=mode),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16,
                                         max_model_len=max_len, is_encoder_decoder=False),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )  # fmt: skip
    config.cache_config.mamba_ssm_cache_dtype = GPU_SSM_DTYPES[model]
    return config


def geometry(model: str, workdir: Path | None = None) -> tuple[int, int]:
    """(attention bytes per token, bytes of one state set) of ``model`` (a :data:`MODELS` name)
    at TP 1 in bf16 on a GPU (see :func:`geometry_of`)."""
    return geometry_of(_vllm_config(model, workdir=workdir))


def geometry_of(config: Any) -> tuple[int, int]:
    """(attention bytes per token, bytes of one state set) of the model of vLLM ``config``: its
    layers' KV cache specs as vLLM sizes them, summed over the layers of each kind."""
    attention, mamba = _specs(config, 1)
    state = dataclasses.replace(mamba, page_size_padded=None).page_size_bytes
    types = _layer_types(config.model_config.hf_config)
    n_attention = sum(t in ("attention", "both") for t in types)
    n_mamba = sum(t in ("mamba", "both") for t in types)
    return n_attention * attention.page_size_bytes, n_mamba * state


def prefill_steps(
    scheduler: Any, tokens: int, seed: int, on_step: Callable[[Any], None] | None = None
) -> list[int]:
    """Tokens of one new request of ``tokens`` random prompt tokens (``seed``: requests with
    different seeds share no prefix) in each step vLLM schedules for it until its prefill is
    done (one token sampled, then it finishes); ``on_step`` sees each step's scheduler output."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    init_none_hash(sha256)
    rng = random.Random(seed)
    request = Request(
        request_id=f"prefill-{tokens}-{seed}",
        prompt_token_ids=[rng.randrange(1000, 100_000) for _ in range(tokens)],
        sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
        block_hasher=get_request_block_hasher(scheduler.block_size, sha256),
    )  # fmt: skip
    scheduler.add_request(request)
    steps: list[int] = []
    while True:
        out = scheduler.schedule()
        scheduled = out.num_scheduled_tokens
        if not scheduled:
            raise RuntimeError(f"the scheduler stopped scheduling {request.request_id} after {steps}")
        if request.request_id in scheduled:
            steps.append(scheduled[request.request_id])
        if on_step is not None:
            on_step(out)
        done = request.num_computed_tokens >= tokens
        ids = list(scheduled)
        sampled = [[7] if rid == request.request_id and done else [] for rid in ids]
        index = {r: i for i, r in enumerate(ids)}
        scheduler.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index=index,
                                                            sampled_token_ids=sampled))  # fmt: skip
        if done:
            return steps
