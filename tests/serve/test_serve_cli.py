"""``hybrid-offload serve`` without starting vLLM: config loading, validation, command, env."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_offload.connector.config import ConfigError
from hybrid_offload.testing.session import kv_transfer_config
from hybrid_offload.tools.cli.serve import API_SERVER_MODULE, load_config_file, serve_command, serve_env

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_command_carries_the_config_as_json(tmp_path: Path) -> None:
    command = serve_command(
        CONFIGS / "cpu_disk.yaml", model=str(tmp_path), port=8123, vllm_args=["--enforce-eager"], base_env={}
    )
    argv = command.argv
    assert argv[:3] == [sys.executable, "-m", API_SERVER_MODULE]
    assert argv[argv.index("--model") + 1] == str(tmp_path)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "8123"
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == json.loads(
        (CONFIGS / "cpu_disk.json").read_text()
    )
    assert argv[-1] == "--enforce-eager"


def test_extra_config_alone_is_wrapped(tmp_path: Path) -> None:
    extra = {"backends": [{"type": "cpu", "capacity_bytes": "1GiB"}]}
    path = _write(tmp_path, "extra.yaml", "backends:\n- type: cpu\n  capacity_bytes: 1GiB\n")
    assert load_config_file(path) == kv_transfer_config(extra)


def test_foreign_connectors_need_the_composing_connector(tmp_path: Path) -> None:
    child = {"kv_connector": "Other", "kv_connector_module_path": "other"}
    extra = {"backends": [{"type": "cpu"}], "connectors": [child]}
    path = _write(tmp_path, "extra.json", json.dumps(extra))
    assert load_config_file(path)["kv_connector"] == "HybridMultiConnector"
    for name, ok in [("HybridMultiConnector", True), ("MultiConnector", True),
                     ("HybridOffloadConnector", False)]:
        path = _write(tmp_path, "full.json", json.dumps({**kv_transfer_config(extra), "kv_connector": name}))
        if ok:
            assert load_config_file(path)["kv_connector"] == name
            continue
        with pytest.raises(ConfigError, match=r"full\.json: kv_connector_extra_config\.connectors: ") as info:
            load_config_file(path)
        assert "'HybridMultiConnector'" in str(info.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"backends": [{"type": "cpu", "load_weight": -1}]}', "backends[0].load_weight"),
        ('{"backends": [{"type": "nope"}]}', "backends[0].type"),
        ('{"backends": [{"type": "disk"}]}', "backends[0]"),
        ('{"kv_connector_extra_config": {"backendz": []}, "kv_connector": "a", '
         '"kv_connector_module_path": "b"}', "backendz"),
        ("[1, 2]", "mapping"),
        ("{nope", "invalid JSON"),
    ],
)  # fmt: skip
def test_bad_config_names_the_key(tmp_path: Path, text: str, needle: str) -> None:
    path = _write(tmp_path, "bad.json", text)
    with pytest.raises(ValueError, match=r"bad\.json") as info:
        serve_command(path, model=str(tmp_path), base_env={})
    assert needle in str(info.value)
    if "backends[" in needle:
        assert isinstance(info.value, ConfigError)


def test_env_defaults_never_override() -> None:
    env = serve_env({"VLLM_CPU_KVCACHE_SPACE": "7"}, [], local_model=True)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "7"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TOKENIZERS_PARALLELISM"] == "false"
    assert "HF_HUB_OFFLINE" not in serve_env({}, [], local_model=False)
    assert "VLLM_CPU_KVCACHE_SPACE" not in serve_env({}, ["--kv-cache-memory-bytes", "1G"], local_model=False)


def test_flags_owned_by_serve_are_refused_after_dashdash(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--port"):
        serve_command(CONFIGS / "cpu.json", model=str(tmp_path), vllm_args=["--port=1"], base_env={})


def test_cli_fails_fast_on_a_bad_key(tmp_path: Path) -> None:
    config = json.loads((CONFIGS / "cpu.json").read_text())
    config["kv_connector_extra_config"]["backends"][0]["load_weigth"] = 1.0
    path = _write(tmp_path, "typo.json", json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_offload", "serve", "--config", str(path), "--model", "m"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "kv_connector_extra_config.backends[0]" in proc.stderr and "load_weigth" in proc.stderr


def test_cli_dry_run_prints_the_command(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_offload", "serve", "--config", str(CONFIGS / "cpu.yaml"),
         "--model", str(tmp_path), "--port", "8999", "--dry-run", "--", "--max-model-len", "1024"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert API_SERVER_MODULE in proc.stdout and "--port 8999" in proc.stdout
    assert proc.stdout.strip().endswith("--max-model-len 1024")
