"""Tiny random-weight Hugging Face models that vLLM can load offline.

`build_model` writes a complete model directory (config.json, bf16 safetensors weights,
generation_config.json, tokenizer.json + tokenizer_config.json) for one of `ARCHS`. The output
is a pure function of the arguments: the same (arch, layers, hidden, seed) gives byte-identical
files, so tests and benchmarks can rebuild a model instead of shipping one.

Shapes respect the vLLM CPU kernels (see shared/PLATFORM.md): attention head size 64 (CPU
attention rejects 16) and GDN linear key/value head dim 128 (the only size the CPU GDN kernel
accepts). ``mtp_layers`` gives a qwen3_next model multi-token-prediction layers (the
``mtp.*`` weights vLLM's ``qwen3_next_mtp`` drafter loads), for speculative decoding.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_ARCH = "qwen3_next"
DEFAULT_HIDDEN = 256
VOCAB_SIZE = 2048
MAX_POSITIONS = 32768
ATTN_HEAD_DIM = 64
MAMBA_HEAD_DIM = 64
MAMBA_STATE = 64
GDN_HEAD_DIM = 128
# Weight init std. HF's default 0.02 makes tiny random models repeat one token forever (the
# output depends only on the last token); 0.1 gives varied, context-dependent greedy output.
INIT_STD = 0.1

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0, 1, 2 as the configs expect
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


@dataclass(frozen=True)
class Dims:
    """Size knobs shared by all architectures."""

    layers: int
    hidden: int
    vocab: int = VOCAB_SIZE

    @property
    def heads(self) -> int:
        """Attention query heads at head size `ATTN_HEAD_DIM`."""
        return self.hidden // ATTN_HEAD_DIM

    @property
    def kv_heads(self) -> int:
        """GQA key/value heads (2 when the query heads split evenly, else 1)."""
        return 2 if self.heads % 2 == 0 else 1

    @property
    def mlp(self) -> int:
        return 2 * self.hidden

    def common(self) -> dict[str, Any]:
        """Fields every config class takes under the same name."""
        return {
            "hidden_size": self.hidden,
            "intermediate_size": self.mlp,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": self.vocab,
            "max_position_embeddings": MAX_POSITIONS,
            "pad_token_id": PAD_ID,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "tie_word_embeddings": False,
        }


def extra_fields(**fields: Any) -> dict[str, Any]:
    """Config fields a config class takes through ``**kwargs``, outside its typed signature
    (transformers' strict configs: legacy names they convert, e.g. NemotronH's
    ``hybrid_override_pattern``, or attributes they keep for vLLM to read, e.g. Falcon-H1's
    ``head_dim``); spread into the call, ``Config(..., **extra_fields(name=value))``."""
    return fields


def _mamba2(dims: Dims) -> dict[str, int]:
    """Mamba2 mixer sizes: expand 2, head dim 64, one group."""
    return {"expand": 2, "heads": 2 * dims.hidden // MAMBA_HEAD_DIM, "head_dim": MAMBA_HEAD_DIM}


def _pattern(layers: int, is_attn: Callable[[int], bool], attn: str, other: str) -> list[str]:
    """Per-layer types; forces the last layer to `attn` when the rule placed none."""
    types = [attn if is_attn(i) else other for i in range(layers)]
    if attn not in types:
        types[-1] = attn
    return types


def _gdn_layers(dims: Dims) -> dict[str, Any]:
    """The Qwen GDN models' layer pattern and linear-attention heads: 3 GDN layers per
    full_attention layer; as in Qwen3-Next-80B, value heads * 128 = 2 * hidden, half as many key
    heads (vLLM's CPU GDN kernel needs key/value head dim 128)."""
    return {
        "head_dim": ATTN_HEAD_DIM,
        "layer_types": _pattern(dims.layers, lambda i: i % 4 == 3, "full_attention", "linear_attention"),
        "linear_key_head_dim": GDN_HEAD_DIM,
        "linear_value_head_dim": GDN_HEAD_DIM,
        "linear_num_key_heads": dims.hidden // (2 * ATTN_HEAD_DIM),
        "linear_num_value_heads": dims.hidden // ATTN_HEAD_DIM,
    }


def _qwen_moe(dims: Dims) -> dict[str, Any]:
    """The Qwen GDN MoE models' experts: 4 routed (top 2) and a shared one."""
    return {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": dims.hidden // 2,
        "shared_expert_intermediate_size": dims.hidden,
    }


def _qwen3_next(dims: Dims) -> Any:
    """Qwen3-Next: 3 GDN (linear_attention) layers per full_attention layer, small MoE.

    vLLM's Qwen3NextForCausalLM requires at least one MoE layer, so every layer gets
    4 routed experts (top 2) plus a shared expert.
    """
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**dims.common(), **_gdn_layers(dims), **_qwen_moe(dims))


def _qwen3_5(dims: Dims) -> Any:
    """Qwen3.5 (text): 3 Gated DeltaNet layers per gated full_attention layer, dense MLP; GDN
    heads as in Qwen3-Next (the CPU kernel needs key/value head dim 128)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**dims.common(), **_gdn_layers(dims))
    config.architectures = ["Qwen3_5ForCausalLM"]
    return config


def _qwen3_5_moe(dims: Dims) -> Any:
    """Qwen3.5-MoE (text): Qwen3.5's layers with 4 routed experts (top 2) and a shared one."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    common = {k: v for k, v in dims.common().items() if k != "intermediate_size"}
    config = Qwen3_5MoeTextConfig(**common, **_gdn_layers(dims), **_qwen_moe(dims))
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    return config


def _falcon_h1(dims: Dims) -> Any:
    """Falcon-H1: every layer runs attention and Mamba2 in parallel."""
    from transformers import FalconH1Config

    m = _mamba2(dims)
    return FalconH1Config(
        **dims.common(),
        **extra_fields(head_dim=ATTN_HEAD_DIM),
        mamba_d_ssm=m["heads"] * m["head_dim"],
        mamba_n_heads=m["heads"],
        mamba_d_head=m["head_dim"],
        mamba_d_state=MAMBA_STATE,
        mamba_n_groups=1,
        mamba_expand=m["expand"],
    )


def _nemotron_h(dims: Dims) -> Any:
    """Nemotron-H with the pattern "M*M-" repeated (Mamba2, attention, Mamba2, MLP)."""
    from transformers import NemotronHConfig

    pattern = ("M*M-" * (dims.layers // 4 + 1))[: dims.layers]
    if "*" not in pattern:
        pattern = pattern[:-1] + "*"
    m = _mamba2(dims)
    return NemotronHConfig(
        **dims.common(),
        head_dim=ATTN_HEAD_DIM,
        **extra_fields(hybrid_override_pattern=pattern),
        mamba_num_heads=m["heads"],
        mamba_head_dim=m["head_dim"],
        ssm_state_size=MAMBA_STATE,
        n_groups=1,
        expand=m["expand"],
        chunk_size=128,
    )


def _granite_hybrid(dims: Dims) -> Any:
    """Granite 4 hybrid, dense shared MLP, attention at layers 1, 5, 9, ... (rest Mamba2)."""
    from transformers import GraniteMoeHybridConfig

    m = _mamba2(dims)
    return GraniteMoeHybridConfig(
        **dims.common(),
        layer_types=_pattern(
            dims.layers, lambda i: i % 4 == 1, "full_attention", "linear_attention"
        ),
        num_local_experts=0,
        shared_intermediate_size=dims.mlp,
        mamba_n_heads=m["heads"],
        mamba_d_head=m["head_dim"],
        mamba_d_state=MAMBA_STATE,
        mamba_n_groups=1,
        mamba_expand=m["expand"],
    )


def _zamba2(dims: Dims) -> Any:
    """Zamba2: Mamba2 layers plus "hybrid" layers (shared attention block + Mamba2)."""
    from transformers import Zamba2Config

    common = dims.common()
    # Zamba2's shared attention runs at width 2*hidden: head size 64 needs twice the heads.
    common["num_attention_heads"] = common["num_key_value_heads"] = 2 * dims.heads
    common["tie_word_embeddings"] = True
    m = _mamba2(dims)
    return Zamba2Config(
        **common,
        layers_block_type=_pattern(dims.layers, lambda i: i % 3 == 1, "hybrid", "linear_attention"),
        n_mamba_heads=m["heads"],
        mamba_d_state=MAMBA_STATE,
        mamba_ngroups=1,
        mamba_expand=m["expand"],
        num_mem_blocks=1,
        use_shared_attention_adapter=False,
        use_mem_rope=True,
    )


def _lfm2(dims: Dims) -> Any:
    """LFM2: gated short-conv layers (a state of ``conv_L_cache - 1`` tokens) with attention at
    layers 1, 3, 5, ..."""
    from transformers import Lfm2Config

    return Lfm2Config(
        **dims.common(),
        layer_types=_pattern(dims.layers, lambda i: i % 2 == 1, "full_attention", "conv"),
        **extra_fields(block_dim=dims.hidden, conv_dim=dims.hidden),
        block_auto_adjust_ff_dim=False,
        conv_L_cache=3,
    )


def _lfm2_moe(dims: Dims) -> Any:
    """LFM2-MoE: LFM2's layers with a sparse MoE MLP after the first (dense) layer: 4 experts,
    2 a token."""
    from transformers import Lfm2MoeConfig

    return Lfm2MoeConfig(
        **dims.common(),
        layer_types=_pattern(dims.layers, lambda i: i % 2 == 1, "full_attention", "conv"),
        conv_L_cache=3,
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=dims.hidden,
    )


def _llama(dims: Dims) -> Any:
    """Plain Llama (attention only), the non-hybrid baseline."""
    from transformers import LlamaConfig

    return LlamaConfig(**dims.common(), head_dim=ATTN_HEAD_DIM)


# arch -> (config factory, default layer count)
_ARCH_TABLE: dict[str, tuple[Callable[[Dims], Any], int]] = {
    "qwen3_next": (_qwen3_next, 4),
    "qwen3_5": (_qwen3_5, 4),
    "qwen3_5_moe": (_qwen3_5_moe, 4),
    "falcon_h1": (_falcon_h1, 2),
    "nemotron_h": (_nemotron_h, 4),
    "granite_hybrid": (_granite_hybrid, 2),
    "zamba2": (_zamba2, 2),
    "lfm2": (_lfm2, 4),
    "lfm2_moe": (_lfm2_moe, 4),
    "llama": (_llama, 2),
}
ARCHS: tuple[str, ...] = tuple(_ARCH_TABLE)
#: archs whose CPU kernels (Gated DeltaNet) run in bfloat16 only
BF16_ONLY_ARCHS: tuple[str, ...] = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def make_config(arch: str, *, layers: int | None = None, hidden: int | None = None,
                init_std: float = INIT_STD) -> Any:
    """The transformers config for `arch`; raises ValueError on unknown arch or bad sizes."""
    if arch not in _ARCH_TABLE:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    factory, default_layers = _ARCH_TABLE[arch]
    dims = Dims(layers=layers or default_layers, hidden=hidden or DEFAULT_HIDDEN)
    if dims.layers < 1:
        raise ValueError(f"layers must be >= 1, got {dims.layers}")
    if dims.hidden < 2 * ATTN_HEAD_DIM or dims.hidden % ATTN_HEAD_DIM:
        raise ValueError(
            f"hidden must be a multiple of {ATTN_HEAD_DIM} and >= "
            f"{2 * ATTN_HEAD_DIM}, got {dims.hidden}"
        )
    config = factory(dims)
    config.dtype = "bfloat16"
    config.initializer_range = init_std
    return config


# ---------------------------------------------------------------------------- tokenizer

_WORDS_TEXT = """
the of and to in is was for on that with as by at from his her it an are were which this
be or has had not but have they one their all been also its new more who after first two
can will would about there other when into time over only some than them these people year
most made many state then city may world such could used where out between through during
under while both before school known those united like because each three any series since
part number war music game team film first area well including later season day national
life family work him being high same government water power north south east west system
hello data model memory cache block token state layer hybrid mamba attention query key
value page store load save offload prefix request engine server client disk redis node
zero one two three four five six seven eight nine ten hundred thousand million
"""
_WORDS = _WORDS_TEXT.split()


def _tokenizer_corpus() -> list[str]:
    """A fixed training corpus: real words plus pseudo-words from a fixed-seed RNG."""
    rng = random.Random(1234)
    syllables = [
        "ka",
        "lo",
        "mi",
        "ne",
        "ru",
        "sa",
        "to",
        "vi",
        "ze",
        "qu",
        "ph",
        "st",
        "an",
        "er",
        "in",
        "on",
        "ar",
        "el",
        "ic",
        "um",
        "tr",
        "ch",
        "sh",
        "bl",
    ]
    lines = [" ".join(_WORDS)] * 20
    for _ in range(3000):
        words = [
            "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(12)
        ]
        lines.append(" ".join(words + rng.sample(_WORDS, 4)) + f" {rng.randint(0, 9999)}.")
    return lines


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` trained on the fixed corpus.

    Special tokens take ids 0 (pad), 1 (bos), 2 (eos). Byte-level, so any text round-trips.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        model_max_length=MAX_POSITIONS,
    )


# ---------------------------------------------------------------------------- weights


#: archs whose vLLM MTP drafter ``build_model(mtp_layers=...)`` can write weights for
MTP_ARCHS = ("qwen3_next",)


def _write_mtp_weights(config: Any, out_dir: Path, seed: int) -> None:
    """``mtp.*`` weights (``mtp.safetensors``) for vLLM's Qwen3-Next MTP drafter: per MTP layer
    a copy of the model's first full-attention decoder layer, and a seeded fc and norms. Its
    drafts are random: nearly all are rejected (the path a cache must get right)."""
    import torch
    from safetensors.torch import load_file, save_file

    main = load_file(str(out_dir / "model.safetensors"))
    first = config.layer_types.index("full_attention")
    prefix = f"model.layers.{first}."
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = config.hidden_size
    mtp = {
        "mtp.fc.weight": (torch.randn(hidden, 2 * hidden, generator=gen) * config.initializer_range)
        .to(torch.bfloat16),
        "mtp.norm.weight": torch.zeros(hidden, dtype=torch.bfloat16),
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(hidden, dtype=torch.bfloat16),
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden, dtype=torch.bfloat16),
    }
    for i in range(config.num_nextn_predict_layers):
        for name, tensor in main.items():
            if name.startswith(prefix):
                mtp[f"mtp.layers.{i}.{name[len(prefix):]}"] = tensor.clone()
    save_file(mtp, str(out_dir / "mtp.safetensors"), metadata={"format": "pt"})


def _write_weights(config: Any, out_dir: Path, seed: int) -> None:
    """Instantiate the HF model from `config` with seeded init and save it as bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    finally:
        torch.set_default_dtype(previous)
    save_quietly(model, out_dir)


def save_quietly(model: Any, out_dir: Path) -> None:
    """``model.save_pretrained(out_dir)`` without transformers' progress bars."""
    from transformers.utils import logging as hf_logging

    bars_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir)
    finally:
        if bars_on:
            hf_logging.enable_progress_bar()


def build_model(
    arch: str,
    out_dir: Path,
    *,
    layers: int | None = None,
    hidden: int | None = None,
    seed: int = 0,
    mtp_layers: int = 0,
    init_std: float = INIT_STD,
) -> Path:
    """Write a random-weight model for `arch` into `out_dir` and return `out_dir`
    (``mtp_layers``: MTP drafter layers, for the archs of :data:`MTP_ARCHS`; ``init_std``: the
    weights' std, lower gives outputs that depend more on the last tokens, that is text an
    n-gram drafter predicts).

    The directory is created if missing; files already there are overwritten. The result
    loads with `vllm.LLM(model=out_dir)` and `AutoTokenizer.from_pretrained(out_dir)` with no
    network. Deterministic: identical arguments give identical bytes.
    """
    out_dir = Path(out_dir)
    config = make_config(arch, layers=layers, hidden=hidden, init_std=init_std)
    if mtp_layers and arch not in MTP_ARCHS:
        raise ValueError(f"mtp_layers: no MTP drafter for {arch!r} (archs with one: {', '.join(MTP_ARCHS)})")
    if mtp_layers:
        config.num_nextn_predict_layers = mtp_layers
    tokenizer = build_tokenizer(config.vocab_size)
    if len(tokenizer) > config.vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens > vocab {config.vocab_size}")
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_weights(config, out_dir, seed)
    if mtp_layers:
        _write_mtp_weights(config, out_dir, seed)
    tokenizer.save_pretrained(out_dir)
    logger.info(
        "built %s model (layers=%d, hidden=%d, seed=%d) in %s",
        arch,
        config.num_hidden_layers,
        config.hidden_size,
        seed,
        out_dir,
    )
    return out_dir
