"""Parse and validate ``kv_connector_extra_config`` into frozen dataclasses.

Every problem raises one :class:`ConfigError` whose message names the offending key path
(``kv_connector_extra_config.backends[1].load_weight``), at connector construction, before
anything is stored or loaded.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from hybrid_offload.backends.base import Backend, BackendConfig, BackendConfigError
from hybrid_offload.backends.registry import backend_class, create_backend
from hybrid_offload.core.secrets import Secret, SecretError, secret_from_options

ROOT = "kv_connector_extra_config"
#: backend types other users or hosts can write: without a cache secret, they can forge pages
SHARED_TYPES = frozenset({"redis", "redis-cluster", "nixl_peer", "lmcache"})
logger = logging.getLogger(__name__)
DEFAULT_CAPACITY_BYTES = 1 << 30
#: the worker process's GIL switch interval while a load is in flight (Python's default: 5 ms)
DEFAULT_LOAD_SWITCH_INTERVAL_S = 0.0005
#: in an engine step that schedules no token, the worker waits up to this long for a load
DEFAULT_IDLE_LOAD_WAIT_S = 0.005
#: each (chunk, group) page set splits into up to this many TP-portable shards (see tp_shards.py)
DEFAULT_TP_SHARDS = 8
MAX_TP_SHARDS = 64
#: most layer parts a page set splits into (see core/layer_parts.py)
MAX_LAYER_PARTS = 64
#: models with recurrent state: a prefill also stores its state every this many tokens
DEFAULT_CHECKPOINT_INTERVAL_TOKENS = 1024
#: a lookup waits at most this long for stores of its prefix that are in flight
DEFAULT_PENDING_STORE_WAIT_S = 2.0
#: load_policy adaptive: a tier's measured speed counts this long; then the tier is probed again
DEFAULT_ADAPTIVE_FORGET_S = 30.0
_TOP_KEYS = frozenset(
    {
        "chunk_tokens",
        "backends",
        "max_pending_store_bytes",
        "max_held_bytes",
        "load_policy",
        "adaptive_forget_s",
        "connectors",
        "load_switch_interval_s",
        "idle_load_wait_s",
        "tp_shards",
        "layer_parts",
        "checkpoint_interval_tokens",
        "pending_store_wait_s",
        "model_version",
        "accept_weights_version",
        "kv_events_token_ids",
        "multimodal_keys",
        "secret",
        "secret_file",
        "secret_env",
    }
)
#: longest model_version or weights_version (names, not data)
MAX_VERSION_LEN = 256
_COMMON_BACKEND_KEYS = frozenset(
    {
        "type",
        "name",
        "load_weight",
        "capacity_bytes",
        "retry_after_s",
        "retry_after_max_s",
        "store_threshold",
        "store_output",
        "read_only",
    }
)
LOAD_POLICIES = ("weighted", "ranged", "adaptive")
#: how images key pages (see connector/scheduler/extras.py)
MULTIMODAL_KEYS = ("content", "identifier", "off")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


class ConfigError(ValueError):
    """Invalid connector configuration; the message names the key."""


@dataclass(frozen=True)
class TierPolicy:
    """How the connector uses one backend (the storage itself is its :class:`BackendConfig`).

    Loads: a hit scores matched tokens x ``load_weight``. Health: after a failure the backend is
    skipped for ``retry_after_s``, doubling up to ``retry_after_max_s`` (see
    ``hybrid_offload.backends.health``). Stores: a page is stored once its chunk was seen in
    ``store_threshold`` requests, output chunks only with ``store_output``, never when
    ``read_only``.
    """

    load_weight: float = 1.0
    retry_after_s: float = 1.0
    retry_after_max_s: float = 30.0
    store_threshold: int = 1
    store_output: bool = True
    read_only: bool = False


@dataclass(frozen=True)
class Tier:
    """One element of ``backends``: a storage backend and the connector's policy for it."""

    backend: BackendConfig
    policy: TierPolicy = TierPolicy()

    @property
    def name(self) -> str:
        return self.backend.name


@dataclass(frozen=True)
class OffloadConfig:
    """The connector's validated configuration."""

    backends: tuple[Tier, ...]
    chunk_tokens: int | None = None
    #: None: sized from the model's pages (:func:`hybrid_offload.core.budgets.store_budgets`)
    max_pending_store_bytes: int | None = None
    max_held_bytes: int | None = None
    load_policy: str = "weighted"
    adaptive_forget_s: float = DEFAULT_ADAPTIVE_FORGET_S
    connectors: tuple[ChildConnectorConfig, ...] = ()
    load_switch_interval_s: float = DEFAULT_LOAD_SWITCH_INTERVAL_S
    idle_load_wait_s: float = DEFAULT_IDLE_LOAD_WAIT_S
    tp_shards: int = DEFAULT_TP_SHARDS
    #: None: the engine's pipeline_parallel_size
    layer_parts: int | None = None
    checkpoint_interval_tokens: int = DEFAULT_CHECKPOINT_INTERVAL_TOKENS
    pending_store_wait_s: float = DEFAULT_PENDING_STORE_WAIT_S
    model_version: str | None = None
    accept_weights_version: bool = False
    #: our KV events carry each block's token ids (false: hashes only; see docs/operations.md)
    kv_events_token_ids: bool = True
    #: what names an image in page keys: its processed content, vLLM's identifier, or none (skip)
    multimodal_keys: str = "content"
    secret: Secret | None = None

    @property
    def chain_key(self) -> bytes | None:
        """Key of the page-key chain (:class:`HybridOffloadPlanner`), None without a secret."""
        return None if self.secret is None else self.secret.subkey("chain")

    @property
    def page_key(self) -> bytes | None:
        """Key of page signatures (:mod:`hybrid_offload.core.page_format`), None without a secret."""
        return None if self.secret is None else self.secret.subkey("page")


def open_backend(config: BackendConfig, index: int) -> Backend:
    """Create ``backends[index]`` at connector start-up (may block on I/O).

    A problem with its configuration that only shows now (a disk path that cannot be created
    or written) raises :class:`ConfigError` naming the key; network backends do not connect
    here, so an unreachable server is not an error (the worker warns at start-up).
    """
    try:
        return create_backend(config)
    except BackendConfigError as exc:
        raise ConfigError(f"{ROOT}.backends[{index}]: {exc}") from exc


def parse_size(value: Any, key: str) -> int:
    """Bytes from an int or a string like ``"512MiB"``; must be positive."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a byte count, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        size = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    else:
        raise ConfigError(f"{key}: expected a byte count like 1073741824 or '1GiB', got {value!r}")
    if size <= 0:
        raise ConfigError(f"{key}: must be positive, got {value!r}")
    return size


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key}: expected a positive integer, got {value!r}")
    return value


def _choice(extra: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> str:
    """``extra[key]``, one of ``choices`` (default: the first)."""
    value = extra.get(key, choices[0])
    if value not in choices:
        raise ConfigError(f"{ROOT}.{key}: expected one of {list(choices)}, got {value!r}")
    return str(value)


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    return value


def _positive_float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(f"{key}: must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def _parse_backend(raw: Any, index: int) -> Tier:
    key = f"{ROOT}.backends[{index}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key}: expected a mapping with a 'type', got {raw!r}")
    type_name = raw.get("type")
    if not isinstance(type_name, str):
        raise ConfigError(f"{key}.type: missing or not a string")
    try:
        cls = backend_class(type_name)
    except BackendConfigError as exc:
        raise ConfigError(f"{key}.type: {exc}") from exc
    weight = raw.get("load_weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
        raise ConfigError(f"{key}.load_weight: must be a finite number > 0, got {weight!r}")
    name = raw.get("name", f"{type_name}{index}" if ":" not in type_name else f"backend{index}")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{key}.name: expected a non-empty string, got {name!r}")
    capacity = parse_size(raw.get("capacity_bytes", DEFAULT_CAPACITY_BYTES), f"{key}.capacity_bytes")
    retry = _positive_float(raw.get("retry_after_s", 1.0), f"{key}.retry_after_s")
    retry_max = _positive_float(raw.get("retry_after_max_s", max(30.0, retry)), f"{key}.retry_after_max_s")
    if retry_max < retry:
        raise ConfigError(f"{key}.retry_after_max_s: must be >= retry_after_s ({retry}), got {retry_max}")
    threshold = _positive_int(raw.get("store_threshold", 1), f"{key}.store_threshold")
    store_output = _flag(raw.get("store_output", True), f"{key}.store_output")
    read_only = _flag(raw.get("read_only", False), f"{key}.read_only")
    options = {k: v for k, v in raw.items() if k not in _COMMON_BACKEND_KEYS}
    try:
        options = cls.validate_options(options)
    except BackendConfigError as exc:
        raise ConfigError(f"{key}: {exc}") from exc
    policy = TierPolicy(
        load_weight=float(weight),
        retry_after_s=retry,
        retry_after_max_s=retry_max,
        store_threshold=threshold,
        store_output=store_output,
        read_only=read_only,
    )
    return Tier(BackendConfig(type=type_name, name=name, capacity_bytes=capacity, options=options), policy)


def parse_offload_config(extra: Mapping[str, Any] | None) -> OffloadConfig:
    """Validate ``kv_connector_extra_config``; raise ConfigError naming the first bad key."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"{ROOT}: unknown key(s) {unknown} (allowed: {sorted(_TOP_KEYS)})")
    raw_backends = extra.get("backends", [])
    if not isinstance(raw_backends, list) or not (raw_backends or extra.get("connectors")):
        raise ConfigError(
            f"{ROOT}.backends: expected a non-empty list of backends (or, with kv_connector "
            f"{COMPOSITE_CONNECTOR!r}, a non-empty {ROOT}.connectors)"
        )
    backends = tuple(_parse_backend(raw, i) for i, raw in enumerate(raw_backends))
    names = [b.name for b in backends]
    if len(set(names)) != len(names):
        raise ConfigError(f"{ROOT}.backends: duplicate backend names {names}")
    connectors = parse_child_connectors(extra.get("connectors"), f"{ROOT}.connectors", taken=names)
    chunk = extra.get("chunk_tokens")
    if chunk is not None:
        chunk = _positive_int(chunk, f"{ROOT}.chunk_tokens")
    pending, held = (
        None if extra.get(key) is None else parse_size(extra[key], f"{ROOT}.{key}")
        for key in ("max_pending_store_bytes", "max_held_bytes")
    )
    policy = _choice(extra, "load_policy", LOAD_POLICIES)
    forget = _seconds(extra, "adaptive_forget_s", DEFAULT_ADAPTIVE_FORGET_S, 86400, zero_ok=False)
    switch = _seconds(extra, "load_switch_interval_s", DEFAULT_LOAD_SWITCH_INTERVAL_S, 0.1,
                      " (0: leave Python's switch interval alone)")
    idle_wait = _seconds(extra, "idle_load_wait_s", DEFAULT_IDLE_LOAD_WAIT_S, 0.1,
                         " (0: an idle step never waits for loads)")
    shards = _positive_int(extra.get("tp_shards", DEFAULT_TP_SHARDS), f"{ROOT}.tp_shards")
    if shards > MAX_TP_SHARDS:
        raise ConfigError(f"{ROOT}.tp_shards: at most {MAX_TP_SHARDS}, got {shards}")
    layer_parts = extra.get("layer_parts")
    if layer_parts is not None:
        layer_parts = _positive_int(layer_parts, f"{ROOT}.layer_parts")
        if layer_parts > MAX_LAYER_PARTS:
            raise ConfigError(f"{ROOT}.layer_parts: at most {MAX_LAYER_PARTS}, got {layer_parts}")
    interval = extra.get("checkpoint_interval_tokens", DEFAULT_CHECKPOINT_INTERVAL_TOKENS)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ConfigError(
            f"{ROOT}.checkpoint_interval_tokens: expected a number of tokens >= 0 (0: only the "
            f"prompt's tail and junctions), got {interval!r}"
        )
    wait = _seconds(extra, "pending_store_wait_s", DEFAULT_PENDING_STORE_WAIT_S, 60,
                    " (0: never wait for stores in flight)")
    version = extra.get("model_version")
    if version is not None and (
        not isinstance(version, str) or not 0 < len(version) <= MAX_VERSION_LEN
    ):
        raise ConfigError(
            f"{ROOT}.model_version: expected a non-empty string of at most "
            f"{MAX_VERSION_LEN} characters naming the weights, got {version!r}"
        )
    accept_version = _flag(extra.get("accept_weights_version", False), f"{ROOT}.accept_weights_version")
    token_ids = _flag(extra.get("kv_events_token_ids", True), f"{ROOT}.kv_events_token_ids")
    mm_keys = _choice(extra, "multimodal_keys", MULTIMODAL_KEYS)
    try:
        secret = secret_from_options(extra, "secret", what=ROOT)
    except SecretError as exc:
        raise ConfigError(str(exc)) from None
    if secret is None:
        _warn_shared_without_secret(tuple(sorted(t.name for t in backends if t.backend.type in SHARED_TYPES)))
    return OffloadConfig(
        backends=backends,
        chunk_tokens=chunk,
        max_pending_store_bytes=pending,
        max_held_bytes=held,
        load_policy=policy,
        adaptive_forget_s=forget,
        connectors=connectors,
        load_switch_interval_s=switch,
        idle_load_wait_s=idle_wait,
        tp_shards=shards,
        layer_parts=layer_parts,
        checkpoint_interval_tokens=interval,
        pending_store_wait_s=wait,
        model_version=version,
        accept_weights_version=accept_version,
        kv_events_token_ids=token_ids,
        multimodal_keys=mm_keys,
        secret=secret,
    )


@functools.cache
def _warn_shared_without_secret(names: tuple[str, ...]) -> None:
    """Once per process and set of tiers: what shared ``names`` without a secret allow."""
    if not names:
        return
    logger.warning(
        "tier(s) %s can be shared and %s has no secret (secret_file / secret_env): whoever can "
        "write them (another user of this host, another client of the service) can store pages "
        "this engine will load as its own KV for a prompt they can guess, and can tell which "
        "prompts are cached. Set secret_file (hybrid-offload serve creates it); reading pages "
        "is gated only by the tier's own authentication (Redis AUTH, the peer's token).",
        ", ".join(names), ROOT,
    )


def _seconds(
    extra: Mapping[str, Any], key: str, default: float, most: float, note: str = "", *,
    zero_ok: bool = True,
) -> float:
    """``extra[key]`` (or ``default``): seconds in ``[0, most]`` (``(0, most]`` unless
    ``zero_ok``); ConfigError naming the key otherwise (``note`` says what 0 means)."""
    value = extra.get(key, default)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and (value >= 0 if zero_ok else value > 0) and value <= most):
        interval = f"{'[' if zero_ok else '('}0, {most}]"
        raise ConfigError(f"{ROOT}.{key}: must be a number of seconds in {interval}{note}, got {value!r}")
    return float(value)


_CHILD_OWN_KEYS = frozenset({"name", "load_weight"})
#: the connector class (``kv_connector``) that composes ``connectors`` with our backends
COMPOSITE_CONNECTOR = "HybridMultiConnector"


def refuse_connectors(config: OffloadConfig, connector: str) -> None:
    """Raise ConfigError when ``connector`` (a class that runs our backends only) is given
    ``connectors``: composing foreign connectors is :data:`COMPOSITE_CONNECTOR`'s job."""
    if config.connectors:
        raise ConfigError(
            f"{ROOT}.connectors: kv_connector {connector!r} runs only the backends; to compose "
            f"foreign connectors with them set kv_connector {COMPOSITE_CONNECTOR!r} (same "
            "kv_connector_module_path)"
        )


@dataclass(frozen=True)
class ChildConnectorConfig:
    """One foreign (vLLM-style) child connector: its full ``kv_transfer_config`` (without our own
    keys ``name`` and ``load_weight``), the name it is known by, and its load weight."""

    name: str
    load_weight: float
    kv_transfer_config: Mapping[str, Any]


def parse_child_connectors(
    raw: Any, key: str, taken: Collection[str] = ()
) -> tuple[ChildConnectorConfig, ...]:
    """Validate a ``connectors`` list (None: no children); names must be unique and not in ``taken``.

    Each entry is a ``kv_transfer_config`` of another connector (``kv_connector`` required,
    ``kv_connector_module_path`` and ``kv_connector_extra_config`` optional) plus ``name``
    (default ``<kv_connector><index>``) and ``load_weight`` (default 1.0). Whether the class
    exists and accepts the config is checked when the connector is built.
    """
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"{key}: expected a list of connector configs, got {raw!r}")
    children: list[ChildConnectorConfig] = []
    seen = set(taken)
    for index, entry in enumerate(raw):
        child = _parse_child(entry, f"{key}[{index}]", index)
        if child.name in seen:
            raise ConfigError(
                f"{key}[{index}].name: duplicate name {child.name!r} (names must be unique across "
                "backends and connectors)"
            )
        seen.add(child.name)
        children.append(child)
    return tuple(children)


def _parse_child(raw: Any, key: str, index: int) -> ChildConnectorConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key}: expected a kv_transfer_config mapping with a 'kv_connector', got {raw!r}")
    connector = raw.get("kv_connector")
    if not isinstance(connector, str) or not connector:
        raise ConfigError(f"{key}.kv_connector: missing or not a non-empty string, got {connector!r}")
    module = raw.get("kv_connector_module_path")
    if module is not None and (not isinstance(module, str) or not module):
        raise ConfigError(f"{key}.kv_connector_module_path: expected a non-empty string, got {module!r}")
    child_extra = raw.get("kv_connector_extra_config", {})
    if not isinstance(child_extra, Mapping):
        raise ConfigError(f"{key}.kv_connector_extra_config: expected a mapping, got {child_extra!r}")
    weight = raw.get("load_weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
        raise ConfigError(f"{key}.load_weight: must be a finite number > 0, got {weight!r}")
    name = raw.get("name", f"{connector}{index}")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{key}.name: expected a non-empty string, got {name!r}")
    transfer = {k: v for k, v in raw.items() if k not in _CHILD_OWN_KEYS}
    return ChildConnectorConfig(name=name, load_weight=float(weight), kv_transfer_config=transfer)
