"""Which cache ``hybrid-offload cache`` works on, and opening it for maintenance.

Target (exactly one): ``--disk PATH`` (with ``--disk-layout``), ``--redis URL`` (with
``--redis-prefix`` and, for a server with AUTH, ``--redis-password-file`` or
``--redis-password-env``), ``--peer HOST:PORT`` (repeatable, with ``--peer-token-file`` or
``--peer-token-env``, or ``--peer-insecure`` for peers that run without a token; a literal token
or password is refused: command lines are visible to every local user), ``--backend-config
FILE`` (one backend entry, YAML or JSON, shaped like an element of
``kv_connector_extra_config.backends``) or ``--config FILE --name NAME`` (a backend of a serve
config such as ``configs/redis.yaml``). Every entry is validated by the connector's own config
parser, so errors name the offending key.

:func:`open_for_maintenance` opens the backend with the largest capacity, so opening never
evicts (the disk backend evicts down to its capacity at start), and a disk cache with
``touch_on_read=False``, so reading pages leaves file mtimes, the disk LRU clock, alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from hybrid_offload.backends import Backend, BackendConfig, backend_class, create_backend
from hybrid_offload.core.secrets import Secret, SecretError, read_secret

__all__ = [
    "OPEN_CAPACITY",
    "CacheCliError",
    "cache_secret",
    "open_for_maintenance",
    "target_arguments",
    "target_config",
]

#: capacity the backend is opened with: never evict on open or on a (healing) read
OPEN_CAPACITY = 1 << 62


class CacheCliError(ValueError):
    """Bad input: the message names what is wrong (exit status 2)."""


def target_arguments() -> argparse.ArgumentParser:
    """A parent parser with the target options (and ``--json``), shared by every action."""
    parent = argparse.ArgumentParser(add_help=False)
    target = parent.add_argument_group("target (exactly one)")
    choice = target.add_mutually_exclusive_group(required=True)
    choice.add_argument("--disk", type=Path, metavar="PATH", help="a disk backend's directory")
    choice.add_argument("--redis", metavar="URL", help="a Redis server, e.g. redis://127.0.0.1:6379/0")
    choice.add_argument(
        "--peer",
        action="append",
        metavar="HOST:PORT",
        help="a nixl_peer cache peer (repeat for several, listed as in the engine's 'peers')",
    )
    choice.add_argument(
        "--backend-config",
        type=Path,
        metavar="FILE",
        help="YAML/JSON file with one backend entry, as in kv_connector_extra_config.backends",
    )
    choice.add_argument(
        "--config", type=Path, metavar="FILE", help="a serve config (configs/*.yaml), with --name"
    )
    target.add_argument("--name", metavar="BACKEND_NAME", help="which backend of --config")
    target.add_argument("--redis-prefix", metavar="PREFIX", help="with --redis: key prefix (default: hop)")
    target.add_argument(
        "--disk-layout",
        choices=("files", "segments"),
        help="with --disk: the directory's layout (default: segments if PATH/segments exists, else files)",
    )
    token = target.add_mutually_exclusive_group()
    token.add_argument("--peer-token-file", metavar="PATH", help="with --peer: file holding the peers' token")
    token.add_argument(
        "--peer-token-env", metavar="VAR", help="with --peer: environment variable holding the peers' token"
    )
    token.add_argument("--peer-token", help=argparse.SUPPRESS)  # refused: visible in ps
    token.add_argument(
        "--peer-insecure", action="store_true", help="with --peer: peers running without a token (--insecure)"
    )
    password = target.add_mutually_exclusive_group()
    password.add_argument(
        "--redis-password-file", metavar="PATH", help="with --redis: file holding the server's password"
    )
    password.add_argument(
        "--redis-password-env", metavar="VAR", help="with --redis: environment variable holding the password"
    )
    signatures = parent.add_argument_group("page signatures (a cache with a secret)")
    signing = signatures.add_mutually_exclusive_group()
    signing.add_argument(
        "--secret-file", metavar="PATH",
        help="the engines' cache secret: signatures of pages and model cards are checked "
        "(an unsigned card names no model)",
    )
    signing.add_argument("--secret-env", metavar="VAR", help="environment variable holding the cache secret")
    parent.add_argument("--json", action="store_true", help="machine-readable output")
    return parent


def _load_mapping(path: Path) -> Any:
    import yaml

    try:
        text = path.read_text()
    except OSError as exc:
        raise CacheCliError(f"cannot read {path}: {exc}") from exc
    is_json = path.suffix.lower() == ".json"
    try:
        return json.loads(text) if is_json else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise CacheCliError(f"{path}: not valid {'JSON' if is_json else 'YAML'}: {exc}") from exc


def _entry_config(entry: Any, source: str) -> BackendConfig:
    """Validate one backend entry the way the connector does."""
    from hybrid_offload.connector.config import ROOT, ConfigError, parse_offload_config

    if not isinstance(entry, dict) or "type" not in entry:
        raise CacheCliError(f"{source}: expected one backend entry (a mapping with a 'type'), got {entry!r}")
    try:
        return parse_offload_config({"backends": [entry]}).backends[0].backend
    except ConfigError as exc:
        raise CacheCliError(f"{source}: {str(exc).replace(f'{ROOT}.backends[0]', 'backend')}") from exc


def _config_backend(path: Path, name: str) -> BackendConfig:
    """Backend ``name`` of a serve config file."""
    from hybrid_offload.connector.config import parse_offload_config
    from hybrid_offload.tools.cli.serve import load_config_file

    config = load_config_file(path)
    backends = [t.backend for t in parse_offload_config(config["kv_connector_extra_config"]).backends]
    for backend in backends:
        if backend.name == name:
            return backend
    names = ", ".join(repr(b.name) for b in backends) or "none"
    raise CacheCliError(f"{path}: no backend named {name!r} (backends: {names})")


def target_config(args: argparse.Namespace) -> BackendConfig:
    """The BackendConfig the target arguments name (see the module docstring)."""
    if args.name is not None and args.config is None:
        raise CacheCliError("--name picks a backend of --config FILE; give --config too")
    if args.redis_prefix is not None and args.redis is None:
        raise CacheCliError("--redis-prefix only goes with --redis")
    if args.disk_layout is not None and args.disk is None:
        raise CacheCliError("--disk-layout only goes with --disk")
    if args.peer_token is not None:
        raise CacheCliError(
            "--peer-token: a literal token is refused (it would be visible to every local user in ps); "
            "give --peer-token-file PATH or --peer-token-env VAR"
        )
    for flag, (target, _) in _SECRET_FLAGS.items():
        if getattr(args, _dest(flag)) is not None and getattr(args, target) is None:
            raise CacheCliError(f"{flag} only goes with --{target}")
    if args.peer_insecure and args.peer is None:
        raise CacheCliError("--peer-insecure only goes with --peer")
    if args.config is not None:
        if args.name is None:
            raise CacheCliError(f"--config {args.config}: give --name BACKEND_NAME to pick its backend")
        return _config_backend(args.config, args.name)
    if args.backend_config is not None:
        return _entry_config(_load_mapping(args.backend_config), str(args.backend_config))
    if args.disk is not None:
        layout = args.disk_layout or ("segments" if (args.disk / "segments").is_dir() else "files")
        entry: dict[str, Any] = {"type": "disk", "name": "disk", "path": str(args.disk), "layout": layout}
        return _entry_config(entry, "--disk")
    if args.redis is not None:
        entry = {"type": "redis", "name": "redis", "url": args.redis}
        if args.redis_prefix is not None:
            entry["prefix"] = args.redis_prefix
        return _entry_config(_with_secrets(entry, args, "redis"), "--redis")
    entry = {"type": "nixl_peer", "name": "peer", "peers": list(args.peer)}
    if args.peer_insecure:
        entry["insecure"] = True
    return _entry_config(_with_secrets(entry, args, "peer"), "--peer")


#: secret options of the target: flag -> (the target flag it goes with, backend option)
_SECRET_FLAGS = {
    "--peer-token-file": ("peer", "token_file"),
    "--peer-token-env": ("peer", "token_env"),
    "--redis-password-file": ("redis", "password_file"),
    "--redis-password-env": ("redis", "password_env"),
}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _with_secrets(entry: dict[str, Any], args: argparse.Namespace, target: str) -> dict[str, Any]:
    """``entry`` plus the secret options given for ``target``; the secret is read here once, so
    that an error names the command-line option rather than the backend key."""
    for flag, (flag_target, option) in _SECRET_FLAGS.items():
        value = getattr(args, _dest(flag))
        if flag_target != target or value is None:
            continue
        try:
            read_secret(**{option.rsplit("_", 1)[1]: value}, what=flag)  # file= or env=
        except SecretError as exc:
            raise CacheCliError(str(exc)) from None
        entry[option] = value
    return entry


def cache_secret(args: argparse.Namespace) -> Secret | None:
    """The cache secret of ``--secret-file`` / ``--secret-env`` (None without them)."""
    flag = "--secret-file" if args.secret_file is not None else "--secret-env"
    try:
        return read_secret(file=args.secret_file, env=args.secret_env, what=flag)
    except SecretError as exc:
        raise CacheCliError(str(exc)) from None


def open_for_maintenance(config: BackendConfig) -> Backend:
    """Open ``config``'s backend so that opening and reading evict nothing and a disk cache's
    mtimes stay as they are (see the module docstring)."""
    from hybrid_offload.backends.disk import DiskBackend

    config = dataclasses.replace(config, capacity_bytes=OPEN_CAPACITY)
    cls = backend_class(config.type)
    if not cls.shared_index:
        raise CacheCliError(
            f"backend {config.name!r} (type {config.type!r}) lives inside the engine's worker process: "
            "another process cannot see its pages"
        )
    if issubclass(cls, DiskBackend):
        options = cls.validate_options(dict(config.options))
        if not os.path.isdir(options["path"]):
            raise CacheCliError(f"disk backend {config.name!r}: {options['path']!r} is not a directory")
        return cls.implementation(options)(config, touch_on_read=False)  # type: ignore[call-arg]
    return create_backend(config)


_FINGERPRINT = re.compile(r"[0-9a-f]{8,64}")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


# -- argument types ---------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """Seconds from ``90s``, ``30m``, ``12h``, ``7d``, ``2w`` or a plain number of seconds."""
    match = _DURATION.match(text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"want a duration like 90s, 30m, 12h or 7d, got {text!r}")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def parse_byte_size(text: str) -> int:
    """Bytes from ``1234``, ``500MB`` or ``10GiB`` (0 allowed)."""
    from hybrid_offload.connector.config import ConfigError, parse_size

    if text.strip() == "0":
        return 0
    try:
        return parse_size(int(text) if text.strip().isdigit() else text, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"want a size like 1234, 500MB or 10GiB, got {text!r}") from exc


def parse_fingerprint(text: str) -> str:
    """A key namespace: 8 to 64 hex digits (case-insensitive)."""
    if _FINGERPRINT.fullmatch(text.lower()) is None:
        raise argparse.ArgumentTypeError(f"want a fingerprint of 8-64 hex digits, got {text!r}")
    return text.lower()
