"""make-model: deterministic bytes per seed, valid configs, offline tokenizer round trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_offload.testing.models import ARCHS, EOS_ID, build_model, make_config


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_same_bytes(arch: str, model_dir, tmp_path: Path) -> None:
    first = _files(model_dir(arch))
    second = _files(build_model(arch, tmp_path / arch))
    assert set(first) >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert first == second


def test_other_seed_other_weights(model_dir, tmp_path: Path) -> None:
    base = model_dir("llama")
    other = build_model("llama", tmp_path / "seed1", seed=1)
    assert (base / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert (base / "config.json").read_bytes() == (other / "config.json").read_bytes()


def test_cli_matches_library_in_fresh_process(model_dir, tmp_path: Path) -> None:
    out = tmp_path / "cli-llama"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybrid_offload",
            "make-model",
            "--arch",
            "llama",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert proc.stdout.strip() == str(out)
    assert _files(out) == _files(model_dir("llama"))


def test_layers_and_hidden(tmp_path: Path) -> None:
    config = make_config("qwen3_next", layers=8, hidden=512)
    assert config.num_hidden_layers == 8 and config.hidden_size == 512
    assert config.layer_types.count("full_attention") == 2
    assert config.linear_key_head_dim == config.linear_value_head_dim == 128
    assert config.head_dim == 64
    with pytest.raises(ValueError):
        make_config("qwen3_next", hidden=100)
    with pytest.raises(ValueError):
        make_config("no_such_arch")


@pytest.mark.parametrize("arch", ARCHS)
def test_config_is_hybrid(arch: str) -> None:
    config = make_config(arch)
    text = json.dumps(config.to_dict(), default=str)
    assert config.max_position_embeddings >= 8192
    if arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        assert {"linear_attention", "full_attention"} <= set(config.layer_types)
    elif arch == "nemotron_h":
        assert config.hybrid_override_pattern == "M*M-"
    elif arch == "granite_hybrid":
        assert {"linear_attention", "full_attention"} <= set(config.layer_types)
    elif arch == "zamba2":
        assert {"linear_attention", "hybrid"} <= set(config.layers_block_type)
    assert "bfloat16" in text


def test_tokenizer_round_trip_offline(model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(os.environ, "HF_HUB_OFFLINE", "1")
    monkeypatch.setitem(os.environ, "TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    directory = model_dir("llama")
    tok = AutoTokenizer.from_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    assert 1000 <= len(tok) <= config["vocab_size"]
    assert tok.eos_token_id == EOS_ID == config["eos_token_id"]
    text = "hello world, the KV cache block 42 -- ünïcödé ✓ 漢字\n\tend"
    ids = tok.encode(text, add_special_tokens=False)
    assert max(ids) < config["vocab_size"]
    assert tok.decode(ids) == text
    # BPE merges whole words: ~2 tokens per "hello world ".
    assert len(tok.encode("hello world " * 100, add_special_tokens=False)) <= 250
