"""Every ready-made file in configs/ is a valid connector config, in JSON and YAML alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hybrid_offload.connector.config import parse_offload_config
from hybrid_offload.testing.session import CONNECTOR_MODULE, CONNECTOR_NAME

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FILES = sorted(CONFIGS.glob("*.json")) + sorted(CONFIGS.glob("*.yaml"))


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())


def test_configs_present() -> None:
    names = {p.name for p in FILES}
    for stem in ("cpu", "disk", "cpu_disk"):
        assert {f"{stem}.json", f"{stem}.yaml"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_config_file_is_valid(path: Path) -> None:
    cfg = load(path)
    assert cfg["kv_connector"] == CONNECTOR_NAME
    assert cfg["kv_connector_module_path"] == CONNECTOR_MODULE
    assert cfg["kv_load_failure_policy"] == "recompute"
    parsed = parse_offload_config(cfg["kv_connector_extra_config"])
    assert parsed.backends


@pytest.mark.parametrize("stem", sorted({p.stem for p in FILES}))
def test_json_and_yaml_agree(stem: str) -> None:
    assert load(CONFIGS / f"{stem}.json") == load(CONFIGS / f"{stem}.yaml")
