"""Every ready-made file in configs/ is a valid connector config, in JSON and YAML alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hybrid_offload.connector.config import (
    SHARED_TYPES,
    _warn_shared_without_secret,
    parse_offload_config,
)
from hybrid_offload.testing.session import CONNECTOR_MODULE, CONNECTOR_NAME
from hybrid_offload.tools.cli.serve import create_secret_files

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FILES = sorted(CONFIGS.glob("*.json")) + sorted(CONFIGS.glob("*.yaml"))


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())


def test_configs_present() -> None:
    names = {p.name for p in FILES}
    for stem in ("cpu", "disk", "cpu_disk"):
        assert {f"{stem}.json", f"{stem}.yaml"} <= names


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the configs' ``~/.config/hybrid-offload`` secrets go."""
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_config_file_is_valid(path: Path) -> None:
    cfg = load(path)
    create_secret_files(cfg["kv_connector_extra_config"])
    assert cfg["kv_connector"] == CONNECTOR_NAME
    assert cfg["kv_connector_module_path"] == CONNECTOR_MODULE
    assert cfg["kv_load_failure_policy"] == "recompute"
    parsed = parse_offload_config(cfg["kv_connector_extra_config"])
    assert parsed.backends


@pytest.mark.parametrize("stem", sorted({p.stem for p in FILES}))
def test_json_and_yaml_agree(stem: str) -> None:
    assert load(CONFIGS / f"{stem}.json") == load(CONFIGS / f"{stem}.yaml")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_shared_tiers_ship_with_a_secret(path: Path, home: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 31 M5: a config with a tier other users can write sets the cache secret (and the
    peer's token); serve creates them 0600 in a 0700 directory of the user's."""
    extra = load(path)["kv_connector_extra_config"]
    kinds = {b["type"] for b in extra["backends"]}
    if not kinds & SHARED_TYPES:
        assert "secret_file" not in extra
        return
    assert extra["secret_file"] == "~/.config/hybrid-offload/cache-secret"
    for backend in extra["backends"]:
        if backend["type"] == "nixl_peer":
            assert backend["token_file"] == "~/.config/hybrid-offload/peer-token"
    created = create_secret_files(extra)
    assert created and create_secret_files(extra) == []  # once
    folder = home / ".config" / "hybrid-offload"
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    for file in folder.iterdir():
        assert oct(file.stat().st_mode & 0o777) == "0o600"
    _warn_shared_without_secret.cache_clear()  # once per process
    with caplog.at_level("WARNING", logger="hybrid_offload.connector.config"):
        parse_offload_config(extra)
        parse_offload_config({k: v for k, v in extra.items() if k != "secret_file"})
    assert caplog.text.count("has no secret") == 1
