"""End to end: a real vLLM engine writes its model card, and ``hybrid-offload cache ls`` names the
model of its fingerprint from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from engine_runs import CHUNK_TOKENS

from hybrid_offload.core.model_card import card_key
from hybrid_offload.testing.session import run_session_subprocess

pytestmark = pytest.mark.e2e


def test_engine_writes_a_card_that_cache_ls_shows(model_dir, tmp_path: Path) -> None:
    model = model_dir("falcon_h1")
    disk = tmp_path / "disk"
    connector = {"backends": [{"type": "disk", "name": "disk", "path": str(disk)}]}
    result = run_session_subprocess({"model": str(model), "prompts": [[5 + i for i in range(40)]],
                                     "max_tokens": 2, "passes": 1, "connector": connector})  # fmt: skip
    fingerprint = result["fingerprint"]
    ls = subprocess.run([sys.executable, "-m", "hybrid_offload", "cache", "ls", "--disk", str(disk),
                         "--json"], capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    (row,) = json.loads(ls.stdout)["fingerprints"]
    assert row["fingerprint"] == fingerprint
    assert row["model"] == str(model)
    card = row["card"]
    assert card["fingerprint"] == fingerprint and card["name"] == str(model)
    assert card["chunk_tokens"] == result["chunk_tokens"] == CHUNK_TOKENS["falcon_h1"]
    expected = [{k: g[k] for k in ("index", "kind", "layers", "shards")} for g in result["groups"]]
    assert card["groups"] == expected
    assert {g["kind"] for g in card["groups"]} == {"full_attention", "mamba"}
    assert card["architectures"] == json.loads((model / "config.json").read_text())["architectures"]
    assert card["dtype"] == "bfloat16"
    # the card is on disk under its key, and verify checks it apart from the pages
    namespace, digest = card_key(fingerprint).split("-")
    assert (disk / namespace / digest[:2] / f"{digest}.page").is_file()
    verify = subprocess.run([sys.executable, "-m", "hybrid_offload", "cache", "verify", "--disk",
                             str(disk), "--json"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    report = json.loads(verify.stdout)
    assert (report["cards"], report["cards_ok"], report["corrupt"]) == (1, 1, 0)
