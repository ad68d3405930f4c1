"""``hybrid-offload serve``: vLLM's OpenAI-compatible server with the connector loaded.

Contract: :func:`serve_command` loads a config file (JSON or YAML: a whole
``kv_transfer_config``, or just its ``kv_connector_extra_config`` with a ``backends`` list),
validates the extra config with :func:`parse_offload_config` (a ``ConfigError`` naming the bad
key, before vLLM starts), resolves the model (``--model DIR|NAME``, or the tiny embedded model
for ``--arch``, built once into a cache directory) and returns the argv and environment of
``python -m vllm.entrypoints.openai.api_server``. :func:`cmd_serve` then replaces this process
with it (``os.execve``): the server keeps this pid, so stopping it is stopping us.

Environment defaults, applied only where the variable is unset: ``VLLM_CPU_KVCACHE_SPACE``
(GiB of KV cache on the CPU backend; skipped when ``--kv-cache-memory-bytes`` is passed, which
it would override), ``TOKENIZERS_PARALLELISM=false``, and ``HF_HUB_OFFLINE=1`` /
``TRANSFORMERS_OFFLINE=1`` when the model is a local directory (no network lookups).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_offload.core.file_digest import cache_home
from hybrid_offload.testing.services.vllm_server import API_SERVER_MODULE

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_CPU_KVCACHE_GIB = "4"
#: vLLM flags added for the embedded tiny model unless given: compiling a toy model costs a
#: minute of startup on CPU, and its 32k positions need not all fit.
EMBEDDED_MODEL_ARGS = {"--enforce-eager": None, "--max-model-len": "4096"}


@dataclass(frozen=True)
class ServeCommand:
    """What :func:`cmd_serve` executes: ``argv`` with ``env`` (the full environment)."""

    argv: list[str]
    env: dict[str, str]

    def shell(self) -> str:
        """The command line, quoted for a POSIX shell."""
        return shlex.join(self.argv)


def load_config_file(path: Path, *, create_secrets: bool = False) -> dict[str, Any]:
    """A ``kv_transfer_config`` dict from a JSON or YAML file, extra config validated; with
    ``create_secrets``, the secret files it names that :func:`create_secret_files` creates are
    created first.

    Raises ValueError (``ConfigError`` for the extra config) with the file and key in the message.
    """
    from hybrid_offload.connector.config import ConfigError, parse_offload_config, refuse_connectors
    from hybrid_offload.testing.session import CONNECTOR_NAME, kv_transfer_config

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc}") from exc
    raw = _parse_text(text, Path(path))
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    if "kv_connector_extra_config" in raw:
        config = dict(raw)
    elif "backends" in raw:
        config = kv_transfer_config(dict(raw))
    else:
        raise ValueError(
            f"{path}: expected a kv_transfer_config (with kv_connector_extra_config) or a "
            "kv_connector_extra_config (with backends)"
        )
    if not config.get("kv_connector") or not config.get("kv_connector_module_path"):
        raise ValueError(f"{path}: kv_connector and kv_connector_module_path must be set")
    if create_secrets:
        create_secret_files(config["kv_connector_extra_config"])
    try:
        parsed = parse_offload_config(config["kv_connector_extra_config"])
        if config["kv_connector"] == CONNECTOR_NAME:
            refuse_connectors(parsed, CONNECTOR_NAME)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return config


def create_secret_files(extra: Mapping[str, Any]) -> list[str]:
    """Create the secrets a config names that a new random value can serve, where absent: the
    cache secret (``secret_file``) and nixl_peer tokens (``token_file``; the peer creates or
    reads the same file). Not Redis passwords: those must match the server's. Returns the files
    created (each logged)."""
    from hybrid_offload.core.secrets import create_secret_file

    files = [extra.get("secret_file")]
    files += [b.get("token_file") for b in extra.get("backends") or [] if isinstance(b, Mapping)
              and b.get("type") == "nixl_peer"]  # fmt: skip
    created = [f for f in files if isinstance(f, str) and f and create_secret_file(f)]
    for file in created:
        logger.warning("created a new secret in %s (mode 0600): every engine and peer sharing "
                       "this tier needs the same file", file)  # fmt: skip
    return created


def _parse_text(text: str, path: Path) -> Any:
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON: {exc}") from exc
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: invalid YAML: {exc}") from exc


def model_cache_dir() -> Path:
    """Where embedded models are cached: :func:`~hybrid_offload.core.file_digest.cache_home`."""
    return cache_home()


def embedded_model(arch: str, cache: Path | None = None) -> Path:
    """The tiny random-weight ``arch`` model, built on first use into the cache.

    The directory name carries a digest of ``models.py``, so a changed builder gives a new
    model. Concurrent callers are safe: each builds into a temp dir and renames it in place.
    """
    from hybrid_offload.testing import models

    if arch not in models.ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(models.ARCHS)}")
    digest = hashlib.sha256(Path(models.__file__).read_bytes()).hexdigest()[:12]
    root = (cache or model_cache_dir()) / "models"
    target = root / f"{arch}-{digest}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-", dir=root))
    try:
        models.build_model(arch, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race: use its copy
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("embedded %s model in %s", arch, target)
    return target


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def serve_env(base: Mapping[str, str], vllm_args: Sequence[str], local_model: bool) -> dict[str, str]:
    """``base`` plus our defaults for the variables it leaves unset (see the module docstring)."""
    env = dict(base)
    defaults = {"TOKENIZERS_PARALLELISM": "false"}
    if not _has_flag(vllm_args, "--kv-cache-memory-bytes"):
        defaults["VLLM_CPU_KVCACHE_SPACE"] = DEFAULT_CPU_KVCACHE_GIB
    if local_model:
        defaults.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    for key, value in defaults.items():
        if not env.get(key):
            env[key] = value
    return env


def serve_command(
    config_path: Path,
    *,
    model: str | None = None,
    arch: str | None = None,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    vllm_args: Sequence[str] = (),
    base_env: Mapping[str, str] | None = None,
) -> ServeCommand:
    """Validate everything and build the api_server command (nothing is started)."""
    from hybrid_offload.testing.models import DEFAULT_ARCH

    if model is not None and arch is not None:
        raise ValueError("give --model or --arch, not both")
    config = load_config_file(config_path, create_secrets=True)
    extra = list(vllm_args)
    for flag in ("--model", "--host", "--port", "--kv-transfer-config"):
        if _has_flag(extra, flag):
            raise ValueError(f"pass {flag} to hybrid-offload serve, not after --")
    if model is None:
        model = str(embedded_model(arch or DEFAULT_ARCH))
        for flag, value in EMBEDDED_MODEL_ARGS.items():
            if not _has_flag(extra, flag):
                extra += [flag] if value is None else [flag, value]
    argv = [sys.executable, "-m", API_SERVER_MODULE, "--model", model, "--host", host, "--port", str(port)]
    argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":")), *extra]
    env = serve_env(os.environ if base_env is None else base_env, extra, Path(model).is_dir())
    return ServeCommand(argv=argv, env=env)


def cmd_serve(args: argparse.Namespace) -> int:
    """Build the command and exec it (never returns on success); ``--dry-run`` prints it."""
    vllm_args = list(args.vllm_args)
    if vllm_args[:1] == ["--"]:
        vllm_args = vllm_args[1:]
    command = serve_command(
        args.config,
        model=args.model,
        arch=args.arch,
        host=args.host,
        port=args.port,
        vllm_args=vllm_args,
    )
    if args.dry_run:
        print(command.shell())
        return 0
    logger.info("starting vLLM: %s", command.shell())
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command.argv[0], command.argv, command.env)
    return 1  # not reached


def add_serve(subparsers: Any) -> None:
    """Register the ``serve`` subcommand."""
    from hybrid_offload.testing.models import ARCHS, DEFAULT_ARCH

    p = subparsers.add_parser(
        "serve",
        help="run vLLM's OpenAI-compatible server with the connector and a config file",
        description="Validate a connector config (configs/*.json|yaml), then exec "
        f"`python -m {API_SERVER_MODULE}` with it as --kv-transfer-config. Without --model, "
        "serves a tiny random-weight model built once into ~/.cache/hybrid-offload "
        "(adds --enforce-eager --max-model-len 4096 unless given). Arguments after `--` go to vLLM.",
    )
    p.add_argument("--config", type=Path, required=True, help="connector config, .json or .yaml")
    p.add_argument("--model", default=None, help="model directory or name (default: the embedded model)")
    p.add_argument(
        "--arch", choices=ARCHS, default=None, help=f"embedded model architecture (default: {DEFAULT_ARCH})"
    )
    p.add_argument("--host", default=DEFAULT_HOST, help=f"listen address (default: {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"listen port (default: {DEFAULT_PORT})")
    p.add_argument("--dry-run", action="store_true", help="print the vLLM command instead of running it")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="extra vLLM arguments, after --")
    p.set_defaults(handler=cmd_serve)
