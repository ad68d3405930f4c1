"""Issue 44 (4): the hybrids vLLM's CPU build cannot run, covered by construction.

vLLM 0.32's CPU build refuses Jamba (Mamba1: no ``selective_scan_fwd`` op), OLMo-hybrid (GDN:
``triton.set_allocator``), Kimi-Linear (KDA: ``cutlass`` missing) and Bailing-MoE-V2.5 (linear
attention with MLA: CPU_MLA refuses the 128-token block a hybrid MLA model gets). No engine of
them runs here, so their KV cache is built as a GPU engine of vLLM builds it, from vLLM's own
code, and then goes through our translation and our data path:

* a tiny config of each arch (transformers' ``JambaConfig`` and ``OlmoHybridConfig``, vLLM's
  ``KimiLinearConfig``; Bailing's checkpoints ship their config as remote code: vLLM's own
  ``bailing_hybrid`` config class, ``BailingMoeV3TextConfig``, registered for that model type)
  gives a real ``VllmConfig`` at TP 1, 2 and 4;
* the block size is vLLM's ``Platform._align_hybrid_block_size`` run with a GPU attention
  backend class (FlashAttention, TritonMLA for MLA; no layer is built, so the backend lookup
  is given that class), from the GPU engines' 16-token default, with the state dtype a GPU
  engine keeps (``mamba_ssm_cache_dtype`` auto: the CPU platform forces float32);
* every layer's spec is what its ``get_kv_cache_spec`` returns: ``MambaSpec`` with the model
  class's ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config`` and the
  layer class's ``mamba_type``, ``FullAttentionSpec`` or ``MLAAttentionSpec`` (one latent
  "head" of ``kv_lora_rank + qk_rope_head_dim``), and vLLM's ``get_kv_cache_groups`` groups
  them;
* ``model_spec_from_vllm`` translates that ``KVCacheConfig`` (the connector's own call), and
  :class:`~hybrid_offload.testing.datapath.SpecWorld` stores and loads requests through an
  :class:`~hybrid_offload.connector.worker.offload_worker.OffloadWorker` over a KV cache laid
  out as vLLM's GPU runner lays it out.

What translation refuses is asserted as refused, with its message (:data:`TRANSLATION`): MLA
(Kimi-Linear's and Bailing's attention layers) at any TP size, Mamba1 and linear-attention
states at TP > 1. Their state groups are still proven alone (the MLA group left out of the
config), so that only the refused part is unproven.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm", reason="builds vLLM's own KV cache specs (scripts/gpu_check.sh has torch only)")
from hybrid_offload.backends import BackendConfig
from hybrid_offload.core.planner import GPU_HYBRID_ALIGNMENT
from hybrid_offload.core.spec import ModelSpec
from hybrid_offload.engine.translate import model_spec_from_vllm
from hybrid_offload.testing.datapath import SpecWorld, changed_blocks, fill_random, kv_bytes_at
from hybrid_offload.testing.services import RedisServer

TP_SIZES = (1, 2, 4)
#: the CPU's own copies, and the CPU taking a GPU engine's paths (load thread, store thread)
DEVICES = ["cpu", "cpu+gpu-path"]
NUM_BLOCKS = 64
MAX_SHARDS = 8  # the connector's default tp_shards
LAYERS = 8


# ---- the archs, as vLLM builds them ------------------------------------------------------------
def _jamba() -> Any:
    from transformers import JambaConfig

    return JambaConfig(  # Jamba: one attention layer in 8 (here in 4), Mamba1 elsewhere
        hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=1000, pad_token_id=0, eos_token_id=1, attn_layer_period=4,
        attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, architectures=["JambaForCausalLM"],
    )  # fmt: skip


def _olmo_hybrid() -> Any:
    from transformers import OlmoHybridConfig

    return OlmoHybridConfig(  # 3 GDN layers to 1 attention layer; value heads != key heads
        hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=1000, pad_token_id=0, eos_token_id=1,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(LAYERS)],
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, architectures=["OlmoHybridForCausalLM"],
    )  # fmt: skip


def _kimi_linear() -> Any:
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    return KimiLinearConfig(  # Kimi-Linear: 3 KDA layers to 1 MLA layer (NoPE), 1-based layer lists
        hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=128,
        vocab_size=1000, pad_token_id=0, eos_token_id=1, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, mla_use_nope=True,
        linear_attn_config={"kda_layers": [i + 1 for i in range(LAYERS) if i % 4 != 3],
                            "full_attn_layers": [i + 1 for i in range(LAYERS) if i % 4 == 3],
                            "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4},
        architectures=["KimiLinearForCausalLM"],
    )  # fmt: skip


def _bailing() -> Any:
    from transformers import AutoConfig
    from vllm.transformers_utils.configs.bailing_moe_v3_vl import BailingMoeV3TextConfig

    # Ling/Ring 2.5 checkpoints (model type bailing_hybrid) bring their config as remote code;
    # vLLM's own class for that model type reads as they do
    AutoConfig.register("bailing_hybrid", BailingMoeV3TextConfig, exist_ok=True)
    return BailingMoeV3TextConfig(  # linear attention, every layer_group_size-th layer MLA
        hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
        head_dim=16, intermediate_size=128, vocab_size=1000, pad_token_id=0, eos_token_id=1,
        layer_group_size=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        num_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1,
        architectures=["BailingMoeV2_5ForCausalLM"],
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Arch:
    """One arch: its tiny config, its KV cache layers (name as vLLM registers it, whether it
    holds a state) per decoder layer, and the vLLM layer class of its state layers."""

    config: Callable[[], Any]
    layers: Callable[[Any], list[tuple[str, bool]]]
    state_layer: str  # module:class


ARCHS = {
    "jamba": Arch(
        _jamba,
        lambda hf: [(f"model.layers.{i}.attn", False) if t == "attention"
                    else (f"model.layers.{i}.mixer", True) for i, t in enumerate(hf.layers_block_type)],
        "vllm.model_executor.layers.mamba.mamba_mixer:MambaMixer",
    ),
    "olmo_hybrid": Arch(
        _olmo_hybrid,
        lambda hf: [(f"model.layers.{i}.self_attn.attn", False) if t == "full_attention"
                    else (f"model.layers.{i}.linear_attn", True) for i, t in enumerate(hf.layer_types)],
        "vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn:OlmoHybridGatedDeltaNetAttention",
    ),
    "kimi_linear": Arch(
        _kimi_linear,
        lambda hf: [(f"model.layers.{i}.self_attn", hf.is_kda_layer(i)) for i in range(hf.num_hidden_layers)],
        "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn:KimiGatedDeltaNetAttention",
    ),
    "bailing_moe_linear": Arch(
        _bailing,
        lambda hf: [(f"model.layers.{i}.self_attn", True) if (i + 1) % hf.layer_group_size
                    else (f"model.layers.{i}.self_attn.attn", False) for i in range(hf.num_hidden_layers)],
        "vllm.model_executor.layers.mamba.linear.bailing_linear_attn:BailingMoELinearAttention",
    ),
}  # fmt: skip


@dataclasses.dataclass
class Built:
    """What a GPU engine of vLLM builds for one arch at one TP size: its config, every layer's
    KV cache spec, and the KV cache config of vLLM's groups (``states_only``: without the
    attention groups, for the archs whose attention layers translation refuses)."""

    config: Any
    layer_specs: dict[str, Any]
    kv_cache_config: Any

    def states_only(self) -> Any:
        from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

        groups = [g for g in self.kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]
        return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)

    def vllm_group(self, names: Sequence[str]) -> Any:
        """vLLM's spec of the group of these layers."""
        return next(g.kv_cache_spec for g in self.kv_cache_config.kv_cache_groups
                    if tuple(g.layer_names) == tuple(names))  # fmt: skip


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Built]:
    """``build(arch, tp, conv_layout="SD")``: what a GPU engine of ``arch`` at TP=``tp`` builds
    (``conv_layout``: ``VLLM_SSM_CONV_STATE_LAYOUT``; translate with :func:`translate`, which
    reads it too)."""
    bases: dict[str, Any] = {}

    def get(arch: str, tp: int, conv_layout: str = "SD") -> Built:
        if arch not in bases:
            bases[arch] = _vllm_config(ARCHS[arch], tmp_path_factory.mktemp(arch))
        with conv_state_layout(conv_layout):
            return _gpu_engine_kv_cache(ARCHS[arch], bases[arch], tp)

    return get


def _vllm_config(arch: Arch, folder: Path) -> Any:
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    hf = arch.config()
    hf.dtype = "bfloat16"
    hf.save_pretrained(folder)
    # vLLM's CPU platform turns prefix caching off for an MLA model where the CPU lacks AMX (its
    # reference MLA kernel); a GPU engine keeps it: built as on an AMX CPU
    with mock.patch.object(torch.cpu, "_is_amx_tile_supported", return_value=True):
        return VllmConfig(
            model_config=ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16",
                                     max_model_len=4096),
            cache_config=CacheConfig(enable_prefix_caching=True, mamba_cache_mode="align"),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=16, max_model_len=4096,
                                             is_encoder_decoder=False),
        )  # fmt: skip


def _gpu_engine_kv_cache(arch: Arch, base: Any, tp: int) -> Built:
    import importlib

    from vllm.config import ParallelConfig, set_current_vllm_config
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        MambaSpec,
        MLAAttentionSpec,
        get_kv_quant_mode,
    )

    config = copy.copy(base)
    config.parallel_config = ParallelConfig(tensor_parallel_size=tp)
    cache = config.cache_config = copy.copy(base.cache_config)
    cache.mamba_ssm_cache_dtype = "auto"  # a GPU engine's; vLLM's CPU platform forced float32
    cache.block_size = cache.mamba_block_size = 16  # the GPU attention backends' default block
    cache.mamba_page_size_padded = None
    cache.kv_cache_layout = "LBNHC"  # a GPU engine's default (pages are uniform: no packing)
    model = config.model_config
    backend = TritonMLABackend if model.use_mla else FlashAttentionBackend
    with mock.patch.object(Platform, "_find_non_ssm_backends", classmethod(lambda cls, cfg: [backend])):
        Platform._align_hybrid_block_size(config, backend)

    model_cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
    module, name = arch.state_layer.split(":")
    mamba_type = getattr(importlib.import_module(module), name).mamba_type.fget(None)
    quant = get_kv_quant_mode(cache.cache_dtype)
    specs: dict[str, Any] = {}
    for layer, is_state in arch.layers(model.hf_config):
        if is_state:  # MambaBase.get_kv_cache_spec
            specs[layer] = MambaSpec(
                shapes=tuple(model_cls.get_mamba_state_shape_from_config(config)),
                dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(config)),
                block_size=cache.mamba_block_size, page_size_padded=cache.mamba_page_size_padded,
                mamba_type=mamba_type, mamba_cache_mode=cache.mamba_cache_mode,
            )  # fmt: skip
        elif model.use_mla:  # MLAAttention.get_kv_cache_spec
            specs[layer] = MLAAttentionSpec(
                block_size=cache.block_size, num_kv_heads=1, max_tp_shards=1, head_size=model.get_head_size(),
                dtype=model.dtype, cache_dtype_str=cache.cache_dtype, kv_quant_mode=quant,
            )  # fmt: skip
        else:  # Attention.get_kv_cache_spec
            head = model.get_head_size()
            specs[layer] = FullAttentionSpec(
                block_size=cache.block_size, num_kv_heads=model.get_num_kv_heads(config.parallel_config),
                head_size=head, head_size_v=head, dtype=model.dtype, kv_quant_mode=quant,
            )  # fmt: skip
    with set_current_vllm_config(config):
        groups = get_kv_cache_groups(config, specs)
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    return Built(config, specs, kv_cache_config)


@contextlib.contextmanager
def conv_state_layout(layout: str) -> Iterator[None]:
    """``VLLM_SSM_CONV_STATE_LAYOUT`` set to ``layout`` inside (vLLM caches what it read)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    with mock.patch.dict("os.environ", {"VLLM_SSM_CONV_STATE_LAYOUT": layout}):
        get_conv_state_layout.cache_clear()
        try:
            assert get_conv_state_layout() == layout
            yield
        finally:
            get_conv_state_layout.cache_clear()


def translate(
    built: Built, states_only: bool = False, tp_rank: int = 0, conv_layout: str = "SD"
) -> ModelSpec:
    """Our spec of what vLLM built, as the connector makes it (``tp_rank``: this rank's)."""
    kv_cache_config = built.states_only() if states_only else built.kv_cache_config
    with conv_state_layout(conv_layout):
        spec = model_spec_from_vllm(built.config, kv_cache_config, max_shards=MAX_SHARDS,
                                    model_version="issue44-tiny-shapes")  # fmt: skip
    return dataclasses.replace(spec, tp_rank=tp_rank)


# ---- what translation makes of them --------------------------------------------------------------
#: (arch, TP) -> what translating it gives, for the whole model and for its state groups alone:
#: None (translated) or (the error raised, part of its message)
_MLA = (ValueError, "spec MLAAttentionSpec, which hybrid-offload does not support")
TRANSLATION: dict[tuple[str, int], tuple[tuple[type, str] | None, tuple[type, str] | None]] = {
    **{("jamba", t): (None, None) for t in TP_SIZES},
    **{("olmo_hybrid", t): (None, None) for t in TP_SIZES},
    **{("kimi_linear", t): (_MLA, None) for t in TP_SIZES},
    **{("bailing_moe_linear", t): (_MLA, None) for t in TP_SIZES},
}  # fmt: skip


def _expected_states(arch: str, hf: Any, t: int) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...], str]:
    """(state shapes SD, dtypes, Mamba type) of one state layer at TP=t, from the HF config by
    hand (vLLM 0.32's formulas: a change in vLLM shows here first)."""
    if arch == "jamba":
        inner = hf.mamba_expand * hf.hidden_size // t
        return ((hf.mamba_d_conv - 1, inner), (inner, hf.mamba_d_state)), ("bfloat16", "bfloat16"), "MAMBA1"
    if arch == "olmo_hybrid":
        k, v = (n * d for n, d in ((hf.linear_num_key_heads, hf.linear_key_head_dim),
                                   (hf.linear_num_value_heads, hf.linear_value_head_dim)))  # fmt: skip
        ssm = (hf.linear_num_value_heads // t, hf.linear_value_head_dim, hf.linear_key_head_dim)
        return ((hf.linear_conv_kernel_dim - 1, (2 * k + v) // t), ssm), ("bfloat16", "bfloat16"), "GDN_ATTN"
    if arch == "kimi_linear":
        kda = hf.linear_attn_config
        heads, dim = kda["num_heads"], kda["head_dim"]
        conv = (kda["short_conv_kernel_size"] - 1, 3 * heads * dim // t)  # q | k | v
        return (conv, (heads // t, dim, dim)), ("bfloat16", "float32"), "GDN_ATTN"  # recurrent state float32
    return ((hf.num_attention_heads // t, hf.head_dim, hf.head_dim),), ("bfloat16",), "LINEAR"


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_what_vllm_builds_and_what_translation_makes_of_it(
    arch: str, tp: int, build: Callable[..., Built]
) -> None:
    """vLLM's specs are the arch's published state formulas at a GPU block size; our spec
    holds exactly them (page bytes and block size included), or translation refuses the arch
    with the error :data:`TRANSLATION` names."""
    built = build(arch, tp)
    hf = built.config.model_config.hf_config
    shapes, dtypes, mamba_type = _expected_states(arch, hf, tp)
    groups = built.kv_cache_config.kv_cache_groups
    states = [g for g in groups if type(g.kv_cache_spec).__name__ == "MambaSpec"]
    attention = [g for g in groups if g not in states]
    names = [name for name, _ in ARCHS[arch].layers(hf)]
    assert sorted(n for g in groups for n in g.layer_names) == sorted(names), "every KV layer in a group"
    assert len(attention) == 1 and len(states) == 3, "vLLM's groups: the attention layers, states in 3"
    for g in states:
        spec = g.kv_cache_spec
        assert (spec.shapes, tuple(str(d).removeprefix("torch.") for d in spec.dtypes)) == (shapes, dtypes)
        assert spec.mamba_type.name == mamba_type and spec.mamba_cache_mode == "align"
    page = attention[0].kv_cache_spec.page_size_bytes
    assert all(g.kv_cache_spec.page_size_bytes == page for g in groups), "Mamba pages padded to attention's"
    block = attention[0].kv_cache_spec.block_size
    mla = built.config.model_config.use_mla
    assert block % (128 if mla else 16) == 0, "GPU alignment: 16 tokens, 128 with MLA"
    assert all(g.kv_cache_spec.block_size == block for g in groups)
    if mla:
        latent = attention[0].kv_cache_spec
        assert (type(latent).__name__, latent.num_kv_heads) == ("MLAAttentionSpec", 1)
        assert latent.head_size == hf.kv_lora_rank + hf.qk_rope_head_dim, "the compressed latent KV"

    for states_only, expected in zip((False, True), TRANSLATION[(arch, tp)], strict=True):
        if expected is not None:
            with pytest.raises(expected[0], match=expected[1]):
                translate(built, states_only)
            continue
        spec = translate(built, states_only)
        for ours in spec.groups:
            theirs = built.vllm_group(ours.layer_names)
            assert (ours.block_size, ours.page_bytes) == (theirs.block_size, theirs.page_size_bytes)
            if ours.is_attention:
                assert (ours.num_kv_heads, ours.head_size) == (theirs.num_kv_heads, theirs.head_size)
                continue
            assert (ours.state_shapes, ours.state_dtypes, ours.mamba_type) == (shapes, dtypes, mamba_type)
            assert ours.state_bytes == theirs.real_page_size_bytes


# ---- the data path ------------------------------------------------------------------------------
#: (arch, whether only its state groups translate at TP=1)
ROUND_TRIP_ARCHS = [
    ("jamba", False), ("olmo_hybrid", False), ("kimi_linear", True), ("bailing_moe_linear", True),
]  # fmt: skip
#: tier -> the GPU layout its test runs in (vLLM 0.32's layouts a hybrid can get)
TIER_LAYOUTS = {"cpu": "LBNHC", "disk": "BLNHC", "redis": "BLHNC"}


@pytest.fixture
def worlds() -> Iterator[list[SpecWorld]]:
    made: list[SpecWorld] = []
    yield made
    for w in made:
        w.close()


def tier_config(
    kind: str, root: Path, redis: RedisServer | None = None, name: str | None = None
) -> BackendConfig:
    name = name or kind
    if kind == "cpu":
        return BackendConfig("cpu", name, 1 << 30)
    if kind == "disk":
        return BackendConfig("disk", name, 1 << 30, {"path": str(root / name)})
    assert redis is not None
    return BackendConfig("redis", name, 1 << 30, {"url": redis.url, "prefix": f"t{uuid.uuid4().hex[:12]}"})


def tokens_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tables(world: SpecWorld, n: int, seed: int) -> tuple[list[int], list[int]]:
    """Two disjoint scrambled block tables for ``n`` tokens in blocks 1 .. NUM_BLOCKS - 3 (the
    last two: state blocks, the writer's and the reader's)."""
    need = -(-n // world.block_size)
    assert 2 * need <= NUM_BLOCKS - 3
    order = torch.randperm(NUM_BLOCKS - 3, generator=torch.Generator().manual_seed(seed))[: 2 * need] + 1
    return order[:need].tolist(), order[need:].tolist()


WRITER_STATE, READER_STATE = NUM_BLOCKS - 2, NUM_BLOCKS - 1


def attention_kv(world: SpecWorld, table: list[int], n: int) -> dict[str, torch.Tensor]:
    """Per attention layer: K|V bytes of tokens [0, n) ``(tokens, heads, bytes)``."""
    return {name: kv_bytes_at(world.views[name], table, world.block_size, range(n))
            for g in world.spec.groups if g.is_attention for name in g.layer_names}  # fmt: skip


def states(world: SpecWorld, built: Built, block: int) -> dict[str, list[torch.Tensor]]:
    """Per state layer: its state tensors in ``block`` as vLLM binds them (``MambaSpec`` shapes
    and dtypes, packed in order at the start of the page: ``MambaBase.bind_kv_cache``)."""
    out = {}
    for g in world.spec.groups:
        if g.is_attention:
            continue
        spec = built.vllm_group(g.layer_names)
        for name, raw in zip(g.layer_names, world.state_bytes(g.index, block), strict=True):
            tensors, at = [], 0
            for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
                size = torch.Size(shape).numel() * dtype.itemsize
                tensors.append(raw[at : at + size].view(dtype).view(shape))
                at += size
            out[name] = tensors
    return out


def bits(tensors: Sequence[torch.Tensor]) -> list[bytes]:
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", sorted(TIER_LAYOUTS))
@pytest.mark.parametrize(("arch", "states_only"), ROUND_TRIP_ARCHS)
def test_pages_round_trip_bit_identically_through_every_tier(
    arch: str, states_only: bool, tier: str, device: str, build: Callable[..., Built],
    redis_server: RedisServer, tmp_path: Path, worlds: list[SpecWorld],
) -> None:  # fmt: skip
    """TP=1: a request stored from one block table loads into another bit for bit, attention
    K|V of every loaded token and every state tensor (KDA's bf16 conv and float32 recurrent
    state, Jamba's Mamba1 conv and SSM, Bailing's linear-attention KV state), and nothing but
    those blocks and the state block changes."""
    built = build(arch, 1)
    tiers = [tier_config(tier, tmp_path, redis_server)]
    w = SpecWorld(translate(built, states_only), TIER_LAYOUTS[tier], device, tiers,
                  hybrid_alignment=GPU_HYBRID_ALIGNMENT)  # fmt: skip
    worlds.append(w)
    n = 500 + 7  # not a multiple of a chunk or a block
    fill_random(w.raw, 1)
    tokens = tokens_of(n, 1)
    src, dst = tables(w, n, 1)
    w.store(w.pages(tokens, src, WRITER_STATE), [tier])
    before = w.raw.clone()
    assert w.load(w.pages(tokens, dst, READER_STATE), tier)
    m = n // w.chunk * w.chunk
    want, got = attention_kv(w, src, m), attention_kv(w, dst, m)
    assert all(torch.equal(want[name], got[name]) for name in want) and len(want) == (0 if states_only else 2)
    written, read = states(w, built, WRITER_STATE), states(w, built, READER_STATE)
    assert len(written) == 6
    assert {k: bits(v) for k, v in written.items()} == {k: bits(v) for k, v in read.items()}
    kv_blocks = set() if states_only else set(dst[: -(-m // w.block_size)])
    assert changed_blocks(w, before) == {*kv_blocks, READER_STATE}


@pytest.mark.parametrize(("arch", "states_only"),
                         [("jamba", False), ("olmo_hybrid", False), ("kimi_linear", True)])  # fmt: skip
@pytest.mark.parametrize(("writer", "reader"), [("DS", "SD"), ("SD", "DS")])
def test_conv_states_load_across_conv_state_layouts(
    arch: str, states_only: bool, writer: str, reader: str, build: Callable[..., Built], tmp_path: Path,
    worlds: list[SpecWorld],
) -> None:  # fmt: skip
    """An engine keeping conv states DS ``(dim, state_len)`` and one keeping them SD share
    pages (one fingerprint): what one wrote loads into the other transposed, bit for bit, the
    other state tensors as they are (Jamba's Mamba1 conv, OLMo's GDN and Kimi's KDA q|k|v conv)."""
    tier = [tier_config("disk", tmp_path)]
    built = {layout: build(arch, 1, layout) for layout in ("DS", "SD")}
    specs = {layout: translate(b, states_only, conv_layout=layout) for layout, b in built.items()}
    assert specs["DS"].fingerprint == specs["SD"].fingerprint
    a = SpecWorld(specs[writer], "LBNHC", "cpu", tier, hybrid_alignment=GPU_HYBRID_ALIGNMENT)
    b = SpecWorld(specs[reader], "BLNHC", "cpu", tier, hybrid_alignment=GPU_HYBRID_ALIGNMENT)
    worlds.extend([a, b])
    n = 300 + 1
    fill_random(a.raw, 2)
    tokens = tokens_of(n, 2)
    src, dst = tables(a, n, 2)
    a.store(a.pages(tokens, src, WRITER_STATE), ["disk"])
    assert b.load(b.pages(tokens, dst, READER_STATE), "disk")
    m = n // a.chunk * a.chunk
    want, got = attention_kv(a, src, m), attention_kv(b, dst, m)
    assert all(torch.equal(want[name], got[name]) for name in want)
    written, read = states(a, built[writer], WRITER_STATE), states(b, built[reader], READER_STATE)
    assert written.keys() == read.keys() and len(written) == 6
    for name, (conv, *rest) in written.items():
        assert conv.shape == read[name][0].shape[::-1], "vLLM's conv shapes are each other's transpose"
        assert bits([conv.T, *rest]) == bits(read[name]), name


# ---- across TP sizes: vLLM's own sharding ---------------------------------------------------------
def _conv_channels(arch: str, hf: Any, t: int, r: int) -> torch.Tensor:
    """Full-model conv channels rank ``r`` of ``t`` holds, in its order: the layer's own fused
    conv1d weight loader (q, k, v sections) run on channel indices."""
    if arch == "olmo_hybrid":
        from vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn import _make_fused_conv1d_weight_loader

        k = hf.linear_num_key_heads * hf.linear_key_head_dim
        sections = [k, k, hf.linear_num_value_heads * hf.linear_value_head_dim]
    else:
        from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import _make_fused_conv1d_weight_loader

        sections = [hf.linear_attn_config["num_heads"] * hf.linear_attn_config["head_dim"]] * 3
    param = torch.full((sum(s // t for s in sections),), -1, dtype=torch.int64)
    load, start = _make_fused_conv1d_weight_loader(sections, t, r), 0
    for shard_id, size in enumerate(sections):
        load(param, torch.arange(start, start + size), shard_id)
        start += size
    assert (param >= 0).all()
    return param


def _state_heads(arch: str, hf: Any, t: int, r: int) -> torch.Tensor:
    """Recurrent-state heads rank ``r`` of ``t`` holds: the loader of the layer's per-head
    ``A_log`` (``sharded_weight_loader(0)``; Kimi's ``a_log_weight_loader(0)``)."""
    import vllm_tp_rules as rules

    if arch == "olmo_hybrid":
        return rules.ssm_heads(hf.linear_num_value_heads, t, r)
    from vllm.model_executor.layers.mamba.gdn import kimi_gdn_linear_attn as kimi

    heads = hf.linear_attn_config["num_heads"]
    param = torch.full((heads // t,), -1, dtype=torch.int64)
    with mock.patch.object(kimi, "get_tensor_model_parallel_rank", return_value=r):
        kimi.a_log_weight_loader(0)(param, torch.arange(heads))
    return param


def _kv_heads(hf: Any, t: int, r: int) -> list[int]:
    import vllm_tp_rules as rules

    head_size = hf.hidden_size // hf.num_attention_heads
    return rules.kv_heads(hf.num_attention_heads, hf.num_key_value_heads, head_size, t, r)


def _contiguous(total: int, t: int, r: int) -> torch.Tensor:
    """What a column-parallel layer of ``total`` outputs holds on rank ``r`` of ``t``: one run."""
    return torch.arange(r * total // t, (r + 1) * total // t)


def rank_view(arch: str, hf: Any, full: dict[str, Any], t: int, r: int) -> dict[str, Any]:
    """vLLM's view on rank ``r`` of ``t`` of a TP=1 engine's tensors (attention K|V bytes
    ``(tokens, heads, bytes)`` and the states: ``[conv, ssm]``; Bailing's ``[state]``). Jamba's
    Mamba1 conv and SSM channels and Bailing's linear-attention heads are column-parallel
    outputs (``MergedColumnParallelLinear`` in_proj, ``ColumnParallelLinear`` conv1d, the QKV
    projection's heads): one contiguous run per rank."""
    out: dict[str, Any] = {}
    for name, value in full.items():
        if isinstance(value, torch.Tensor):
            out[name] = value[:, _kv_heads(hf, t, r)]
        elif arch == "jamba":
            channels = _contiguous(hf.mamba_expand * hf.hidden_size, t, r)
            conv, ssm = value
            out[name] = [conv[:, channels], ssm[channels]]
        elif arch == "bailing_moe_linear":
            (state,) = value
            out[name] = [state[_contiguous(hf.num_attention_heads, t, r)]]
        else:
            channels, heads = _conv_channels(arch, hf, t, r), _state_heads(arch, hf, t, r)
            conv, ssm = value
            out[name] = [conv[:, channels], ssm[heads]]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("arch", "states_only"),
    [("olmo_hybrid", False), ("kimi_linear", True), ("jamba", False), ("bailing_moe_linear", True)],
)
def test_pages_written_at_tp1_load_at_tp2_and_tp4_and_back(
    arch: str, states_only: bool, device: str, build: Callable[..., Built], tmp_path: Path,
    worlds: list[SpecWorld],
) -> None:  # fmt: skip
    """A TP=1 engine's pages load at TP=2 and TP=4 into exactly vLLM's rank views (its KV
    heads by ``QKVParallelLinear``, replicated at TP=4; conv channels by the layer's fused
    conv1d loader; state heads by its ``A_log`` loader); what those ranks store back loads at
    TP=1 bit-identical to the original. One fingerprint at every TP size."""
    n = 500 + 3
    tokens = tokens_of(n, 3)
    hf = build(arch, 1).config.model_config.hf_config
    there = tier_config("disk", tmp_path, name="there")
    writer = SpecWorld(translate(build(arch, 1), states_only), "LBNHC", device, [there],
                       hybrid_alignment=GPU_HYBRID_ALIGNMENT)  # fmt: skip
    worlds.append(writer)
    fill_random(writer.raw, 3)
    src, _ = tables(writer, n, 3)
    writer.store(writer.pages(tokens, src, WRITER_STATE), ["there"])
    m = n // writer.chunk * writer.chunk
    full = {**attention_kv(writer, src, m), **states(writer, build(arch, 1), WRITER_STATE)}
    assert len(full) == {"olmo_hybrid": 8, "kimi_linear": 6}.get(arch, len(full)) and full
    for t in (2, 4):
        built, back = build(arch, t), tier_config("disk", tmp_path, name=f"back{t}")
        ranks = [SpecWorld(translate(built, states_only, r), "BLHNC", device, [there, back],
                           hybrid_alignment=GPU_HYBRID_ALIGNMENT) for r in range(t)]  # fmt: skip
        worlds.extend(ranks)
        assert {w.spec.fingerprint for w in ranks} == {writer.spec.fingerprint}
        assert {w.chunk for w in ranks} == {writer.chunk}, "engines at every TP size cut the same chunks"
        for r, w in enumerate(ranks):
            _, dst = tables(w, n, 30 + t)
            assert w.load(w.pages(tokens, dst, READER_STATE), "there")
            got = {**attention_kv(w, dst, m), **states(w, built, READER_STATE)}
            want = rank_view(arch, hf, full, t, r)
            assert got.keys() == want.keys()
            for name in want:
                assert bits(_listed(got[name])) == bits(_listed(want[name])), f"TP={t} rank {r}: {name}"
            w.store(w.pages(tokens, dst, READER_STATE), [back.name])
        reader = SpecWorld(translate(build(arch, 1), states_only), "BLNHC", device, [back],
                           hybrid_alignment=GPU_HYBRID_ALIGNMENT)  # fmt: skip
        worlds.append(reader)
        _, dst = tables(reader, n, 40 + t)
        assert reader.load(reader.pages(tokens, dst, READER_STATE), back.name)
        again = {**attention_kv(reader, dst, m), **states(reader, build(arch, 1), READER_STATE)}
        assert {k: bits(_listed(v)) for k, v in again.items()} == {
            k: bits(_listed(v)) for k, v in full.items()
        }, f"written at TP=1, stored back by TP={t}, read at TP=1"


def _listed(value: Any) -> list[torch.Tensor]:
    return value if isinstance(value, list) else [value]
