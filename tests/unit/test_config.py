"""kv_connector_extra_config parsing: the happy path and one clear error per bad input."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest

from hybrid_offload.backends.base import BackendConfig
from hybrid_offload.connector.config import (
    DEFAULT_CAPACITY_BYTES,
    ConfigError,
    OffloadConfig,
    Tier,
    TierPolicy,
    parse_offload_config,
    parse_size,
)

ROOT = "kv_connector_extra_config"


def good() -> dict[str, Any]:
    return {
        "chunk_tokens": 256,
        "backends": [
            {"type": "cpu", "capacity_bytes": "1GiB"},
            {"type": "disk", "name": "ssd", "path": "/var/cache/kv", "capacity_bytes": "10 GiB",
             "load_weight": 0.5, "io_threads": 8},
        ],
    }


def test_happy_path() -> None:
    cfg = parse_offload_config(good())
    assert isinstance(cfg, OffloadConfig)
    assert cfg.chunk_tokens == 256
    assert cfg.max_pending_store_bytes is None and cfg.max_held_bytes is None  # sized from the model
    cpu, (disk, disk_policy) = cfg.backends[0], (cfg.backends[1].backend, cfg.backends[1].policy)
    assert cpu == Tier(BackendConfig(type="cpu", name="cpu0", capacity_bytes=1 << 30, options={}),
                       TierPolicy(load_weight=1.0))
    assert disk.type == "disk" and disk.name == "ssd"
    assert disk.capacity_bytes == 10 << 30
    assert disk_policy.load_weight == 0.5 and isinstance(disk_policy.load_weight, float)
    assert disk.options == {
        "path": "/var/cache/kv", "fsync": False, "io_threads": 8, "layout": "files", "segment_mb": 64
    }


def test_defaults() -> None:
    cfg = parse_offload_config({"backends": [{"type": "cpu"}, {"type": "cpu"}]})
    assert cfg.chunk_tokens is None  # the planner picks it from the model
    assert [b.name for b in cfg.backends] == ["cpu0", "cpu1"]
    assert all(t.backend.capacity_bytes == DEFAULT_CAPACITY_BYTES for t in cfg.backends)
    assert all(t.policy.load_weight == 1.0 for t in cfg.backends)
    assert cfg.max_pending_store_bytes is None and cfg.max_held_bytes is None
    disk = parse_offload_config({"backends": [{"type": "disk", "path": "/x"}]}).backends[0].backend
    assert disk.name == "disk0"
    want = {"path": "/x", "fsync": False, "io_threads": 4, "layout": "files", "segment_mb": 64}
    assert disk.options == want
    cfg = parse_offload_config({"backends": [{"type": "cpu"}], "chunk_tokens": None,
                                "max_pending_store_bytes": "64MiB", "max_held_bytes": "1GiB"})
    assert cfg.chunk_tokens is None and cfg.max_pending_store_bytes == 64 << 20
    assert cfg.max_held_bytes == 1 << 30
    assert cfg.load_switch_interval_s == 0.0005
    assert cfg.idle_load_wait_s == 0.005
    no_wait = parse_offload_config({"backends": [{"type": "cpu"}], "idle_load_wait_s": 0})
    assert no_wait.idle_load_wait_s == 0.0
    assert cfg.adaptive_forget_s == 30.0
    cfg = parse_offload_config({"backends": [{"type": "cpu"}], "adaptive_forget_s": 600})
    assert cfg.adaptive_forget_s == 600.0
    cfg = parse_offload_config({"backends": [{"type": "cpu"}], "load_switch_interval_s": 0})
    assert cfg.load_switch_interval_s == 0.0
    assert cfg.tp_shards == 8
    assert parse_offload_config({"backends": [{"type": "cpu"}], "tp_shards": 1}).tp_shards == 1


def test_input_is_not_mutated() -> None:
    raw = good()
    before = copy.deepcopy(raw)
    parse_offload_config(raw)
    assert raw == before


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("1GiB", 1 << 30),
        ("1gib", 1 << 30),
        ("1 GiB", 1 << 30),
        (" 512MiB ", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("2KiB", 2048),
        ("1TiB", 1 << 40),
        ("2GB", 2 * 10**9),
        ("3MB", 3 * 10**6),
        ("7KB", 7000),
        ("100B", 100),
    ],
)
def test_sizes(value: object, expected: int) -> None:
    assert parse_size(value, "k") == expected
    cfg = parse_offload_config({"backends": [{"type": "cpu", "capacity_bytes": value}]})
    assert cfg.backends[0].backend.capacity_bytes == expected


def _with(path: str, value: object) -> dict[str, Any]:
    """good() with one backend key set (``backends[i].key``) or a top-level key."""
    raw = good()
    if path.startswith("backends["):
        index, key = int(path[9]), path.split(".", 1)[1]
        raw["backends"][index][key] = value
    else:
        raw[path] = value
    return raw


def _without(index: int, key: str) -> dict[str, Any]:
    raw = good()
    del raw["backends"][index][key]
    return raw


BAD: dict[str, tuple[dict[str, Any] | None, str, tuple[str, ...]]] = {
    # id: (extra config, key path the message must contain, other words it must contain)
    "unknown-top-level-key": (_with("chunk_size", 256), ROOT, ("'chunk_size'", "backends")),
    "none": (None, f"{ROOT}.backends", ()),
    "missing-backends": ({"chunk_tokens": 256}, f"{ROOT}.backends", ()),
    "empty-backends": ({"backends": []}, f"{ROOT}.backends", ("non-empty",)),
    "backends-not-a-list": ({"backends": {"type": "cpu"}}, f"{ROOT}.backends", ()),
    "backend-not-a-mapping": ({"backends": [{"type": "cpu"}, "disk"]}, f"{ROOT}.backends[1]",
                              ("'disk'",)),
    "backend-none": ({"backends": [None]}, f"{ROOT}.backends[0]", ()),
    "missing-type": (_without(1, "type"), f"{ROOT}.backends[1].type", ("missing",)),
    "type-not-a-string": (_with("backends[0].type", 3), f"{ROOT}.backends[0].type", ()),
    "unknown-type": (_with("backends[1].type", "tape"), f"{ROOT}.backends[1].type",
                     ("'tape'", "cpu", "disk")),
    "load-weight-zero": (_with("backends[1].load_weight", 0), f"{ROOT}.backends[1].load_weight",
                         ("0",)),
    "load-weight-negative": (_with("backends[1].load_weight", -1.5),
                             f"{ROOT}.backends[1].load_weight", ("-1.5",)),
    "load-weight-bool": (_with("backends[1].load_weight", True),
                         f"{ROOT}.backends[1].load_weight", ("True",)),
    "load-weight-string": (_with("backends[0].load_weight", "1"),
                           f"{ROOT}.backends[0].load_weight", ("'1'",)),
    "load-weight-nan": (_with("backends[0].load_weight", float("nan")),
                        f"{ROOT}.backends[0].load_weight", ()),
    "load-weight-none": (_with("backends[0].load_weight", None),
                         f"{ROOT}.backends[0].load_weight", ()),
    "retry-after-zero": (_with("backends[1].retry_after_s", 0), f"{ROOT}.backends[1].retry_after_s",
                         ("> 0",)),
    "retry-after-string": (_with("backends[0].retry_after_s", "1s"), f"{ROOT}.backends[0].retry_after_s",
                           ("'1s'",)),
    "retry-after-max-below-initial": (
        _with("backends[1].retry_after_max_s", 0.5) | {"backends": [
            {"type": "cpu"}, {"type": "cpu", "name": "b", "retry_after_s": 2, "retry_after_max_s": 0.5}]},
        f"{ROOT}.backends[1].retry_after_max_s", (">= retry_after_s",)),
    "capacity-negative": (_with("backends[1].capacity_bytes", -1),
                          f"{ROOT}.backends[1].capacity_bytes", ("-1",)),
    "capacity-zero": (_with("backends[0].capacity_bytes", 0),
                      f"{ROOT}.backends[0].capacity_bytes", ("positive",)),
    "capacity-zero-string": (_with("backends[0].capacity_bytes", "0GiB"),
                             f"{ROOT}.backends[0].capacity_bytes", ()),
    "capacity-negative-string": (_with("backends[0].capacity_bytes", "-1GiB"),
                                 f"{ROOT}.backends[0].capacity_bytes", ("'-1GiB'",)),
    "capacity-garbage": (_with("backends[1].capacity_bytes", "lots"),
                         f"{ROOT}.backends[1].capacity_bytes", ("'lots'", "1GiB")),
    "capacity-bad-unit": (_with("backends[1].capacity_bytes", "10 GiBs"),
                          f"{ROOT}.backends[1].capacity_bytes", ()),
    "capacity-float": (_with("backends[1].capacity_bytes", 1.5e9),
                       f"{ROOT}.backends[1].capacity_bytes", ()),
    "capacity-bool": (_with("backends[1].capacity_bytes", True),
                      f"{ROOT}.backends[1].capacity_bytes", ()),
    "capacity-rounds-to-zero": (_with("backends[1].capacity_bytes", "0.1B"),
                                f"{ROOT}.backends[1].capacity_bytes", ()),
    "unknown-option": (_with("backends[1].pathh", "/x"), f"{ROOT}.backends[1]",
                       ("'pathh'", "path")),
    "cpu-has-no-options": (_with("backends[0].path", "/x"), f"{ROOT}.backends[0]", ("'path'",)),
    "disk-without-path": (_without(1, "path"), f"{ROOT}.backends[1]", ("'path'", "required")),
    "disk-empty-path": (_with("backends[1].path", ""), f"{ROOT}.backends[1]", ("'path'",)),
    "disk-bad-io-threads": (_with("backends[1].io_threads", 0), f"{ROOT}.backends[1]",
                            ("io_threads",)),
    "empty-name": (_with("backends[1].name", ""), f"{ROOT}.backends[1].name", ()),
    "name-not-a-string": (_with("backends[1].name", 7), f"{ROOT}.backends[1].name", ()),
    "chunk-zero": (_with("chunk_tokens", 0), f"{ROOT}.chunk_tokens", ("0",)),
    "chunk-negative": (_with("chunk_tokens", -256), f"{ROOT}.chunk_tokens", ("-256",)),
    "chunk-float": (_with("chunk_tokens", 256.0), f"{ROOT}.chunk_tokens", ("256.0",)),
    "chunk-bool": (_with("chunk_tokens", True), f"{ROOT}.chunk_tokens", ("True",)),
    "chunk-string": (_with("chunk_tokens", "256"), f"{ROOT}.chunk_tokens", ("'256'",)),
    "duplicate-names": ({"backends": [{"type": "cpu", "name": "a"},
                                      {"type": "disk", "name": "a", "path": "/x"}]},
                        f"{ROOT}.backends", ("duplicate", "'a'")),
    "duplicate-default-names": ({"backends": [{"type": "cpu", "name": "cpu1"}, {"type": "cpu"}]},
                                f"{ROOT}.backends", ("duplicate", "cpu1")),
    "pending-zero": (_with("max_pending_store_bytes", 0), f"{ROOT}.max_pending_store_bytes", ()),
    "pending-garbage": (_with("max_pending_store_bytes", "x"),
                        f"{ROOT}.max_pending_store_bytes", ()),
    "switch-negative": (_with("load_switch_interval_s", -0.001), f"{ROOT}.load_switch_interval_s",
                        ("-0.001",)),
    "switch-string": (_with("load_switch_interval_s", "fast"), f"{ROOT}.load_switch_interval_s", ()),
    "idle-wait-too-long": (_with("idle_load_wait_s", 1), f"{ROOT}.idle_load_wait_s", ("[0, 0.1]",)),
    "forget-zero": (_with("adaptive_forget_s", 0), f"{ROOT}.adaptive_forget_s", ("(0, 86400]",)),
    "forget-string": (_with("adaptive_forget_s", "1m"), f"{ROOT}.adaptive_forget_s", ("'1m'",)),
    "tp-shards-zero": (_with("tp_shards", 0), f"{ROOT}.tp_shards", ()),
    "tp-shards-huge": (_with("tp_shards", 65), f"{ROOT}.tp_shards", ("64", "65")),
    "tp-shards-string": (_with("tp_shards", "8"), f"{ROOT}.tp_shards", ()),
    "unknown-load-policy": (_with("load_policy", "fastest"), f"{ROOT}.load_policy",
                            ("'fastest'", "weighted", "ranged", "adaptive")),
    "store-threshold-zero": (_with("backends[1].store_threshold", 0),
                             f"{ROOT}.backends[1].store_threshold", ("0",)),
    "store-threshold-float": (_with("backends[0].store_threshold", 1.5),
                              f"{ROOT}.backends[0].store_threshold", ()),
    "store-output-string": (_with("backends[0].store_output", "yes"),
                            f"{ROOT}.backends[0].store_output", ("'yes'",)),
    "read-only-int": (_with("backends[1].read_only", 1), f"{ROOT}.backends[1].read_only", ()),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_names_the_key(case: str) -> None:
    extra, key_path, words = BAD[case]
    with pytest.raises(ConfigError) as info:
        parse_offload_config(extra)
    message = str(info.value)
    assert key_path in message, message
    for word in words:
        assert word in message, (word, message)
    assert isinstance(info.value, ValueError)


def test_backend_index_is_the_failing_one() -> None:
    """An error in backend 2 names backends[2], not another index."""
    raw = {"backends": [{"type": "cpu"}, {"type": "cpu"}, {"type": "cpu", "load_weight": -1}]}
    with pytest.raises(ConfigError) as info:
        parse_offload_config(raw)
    message = str(info.value)
    assert f"{ROOT}.backends[2].load_weight" in message
    assert "backends[0]" not in message and "backends[1]" not in message


def test_errors_chain_the_backend_error() -> None:
    with pytest.raises(ConfigError) as info:
        parse_offload_config(_with("backends[1].type", "tape"))
    assert info.value.__cause__ is not None


def test_retry_after_keys_reach_the_tier_policy() -> None:
    cfg = parse_offload_config({"backends": [{"type": "cpu", "retry_after_s": 0.25}, {"type": "cpu",
                                "name": "b", "retry_after_s": 2, "retry_after_max_s": 4}]})
    first, second = cfg.backends[0].policy, cfg.backends[1].policy
    assert (first.retry_after_s, first.retry_after_max_s) == (0.25, 30.0)
    assert (second.retry_after_s, second.retry_after_max_s) == (2.0, 4.0)
    assert "retry_after_s" not in cfg.backends[0].backend.options


def test_load_and_store_policy_keys() -> None:
    cfg = parse_offload_config(
        {
            "load_policy": "ranged",
            "backends": [
                {"type": "cpu"},
                {"type": "cpu", "name": "b", "store_threshold": 3, "store_output": False, "read_only": True},
            ],
        }
    )
    assert cfg.load_policy == "ranged"
    # generated tokens are stored by default
    first, second = cfg.backends[0].policy, cfg.backends[1].policy
    assert (first.store_threshold, first.store_output, first.read_only) == (
        1,
        True,
        False,
    )
    assert (second.store_threshold, second.store_output, second.read_only) == (
        3,
        False,
        True,
    )
    assert not {"store_threshold", "store_output", "read_only"} & set(cfg.backends[1].backend.options)
    assert parse_offload_config({"backends": [{"type": "cpu"}]}).load_policy == "weighted"


def test_model_version_and_secret(tmp_path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """issue 14: an operator's weights name; the cache secret from a file or the environment,
    never a literal (the config is a command-line argument)."""
    assert parse_offload_config({**good(), "model_version": "llama-ft-7"}).model_version == "llama-ft-7"
    assert parse_offload_config(good()).accept_weights_version is False
    assert parse_offload_config({**good(), "accept_weights_version": True}).accept_weights_version is True
    with pytest.raises(ConfigError, match="accept_weights_version"):
        parse_offload_config({**good(), "accept_weights_version": "yes"})
    for bad in ("", 7, "x" * 257):
        with pytest.raises(ConfigError, match="model_version"):
            parse_offload_config({**good(), "model_version": bad})
    with pytest.raises(ConfigError, match="'secret_file'"):
        parse_offload_config({**good(), "secret": "hunter2"})
    path = tmp_path / "secret"
    path.write_text("hunter2\n")
    config = parse_offload_config({**good(), "secret_file": str(path)})
    assert config.secret is not None and config.secret.value == b"hunter2" and "hunter2" not in repr(config)
    assert None not in (config.chain_key, config.page_key) and config.chain_key != config.page_key
    monkeypatch.setenv("HO_TEST_SECRET", "s3")
    from_env = parse_offload_config({**good(), "secret_env": "HO_TEST_SECRET"}).secret
    assert from_env is not None and from_env.value == b"s3"
    for extra, why in (({"secret_env": "HO_TEST_UNSET"}, "unset"),
                       ({"secret_file": str(tmp_path / "absent")}, "cannot read"),
                       ({"secret_file": str(path), "secret_env": "HO_TEST_SECRET"}, "not both")):
        with pytest.raises(ConfigError, match=why):
            parse_offload_config({**good(), **extra})
    path.chmod(0o644)  # readable by all (a Kubernetes secret's default mode): a warning
    with caplog.at_level("WARNING", logger="hybrid_offload.core.secrets"):
        parse_offload_config({**good(), "secret_file": str(path)})
    assert "readable by every user" in caplog.text and "hunter2" not in caplog.text
    path.chmod(0o666)
    with pytest.raises(ConfigError, match="writable by group or others"):
        parse_offload_config({**good(), "secret_file": str(path)})


def test_secret_files_only_their_owner_can_choose(tmp_path: Path) -> None:
    """Issue 31 L6: whoever can write a secret file chooses the secret. Refused: group-writable,
    another user's, not a regular file (a FIFO would block the reader), oversized. Accepted: a
    symlink to a good file (Kubernetes mounts secrets as symlinks), ``~`` expanded."""
    from hybrid_offload.core.secrets import SecretError, create_secret_file, read_secret

    path = tmp_path / "secret"
    path.write_text("hunter2\n")
    path.chmod(0o620)
    with pytest.raises(SecretError, match="writable by group or others"):
        read_secret(file=str(path), what="t")
    path.chmod(0o600)
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(path, 65534, 65534)
        with pytest.raises(SecretError, match="belongs to uid 65534"):
            read_secret(file=str(path), what="t")
        os.chown(path, 0, 0)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(SecretError, match="not a regular file"):
        read_secret(file=str(fifo), what="t")
    (tmp_path / "..data").mkdir()
    (tmp_path / "..data" / "token").write_text("k8s")
    (tmp_path / "..data" / "token").chmod(0o400)
    (tmp_path / "token").symlink_to(tmp_path / "..data" / "token")
    assert read_secret(file=str(tmp_path / "token"), what="t").value == b"k8s"  # type: ignore[union-attr]
    (tmp_path / "big").write_bytes(b"x" * 5000)
    (tmp_path / "big").chmod(0o600)
    with pytest.raises(SecretError, match="larger than"):
        read_secret(file=str(tmp_path / "big"), what="t")
    home = tmp_path / "home"
    home.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        assert create_secret_file("~/.config/hybrid-offload/cache-secret")
        assert not create_secret_file("~/.config/hybrid-offload/cache-secret")  # kept as it is
        created = home / ".config" / "hybrid-offload" / "cache-secret"
        assert oct(created.stat().st_mode & 0o777) == "0o600"
        assert oct(created.parent.stat().st_mode & 0o777) == "0o700"
        secret = read_secret(file="~/.config/hybrid-offload/cache-secret", what="t")
        assert secret is not None and len(secret.value) == 64


def test_secret_files_in_directories_others_can_write_are_refused(tmp_path: Path) -> None:
    """Issue 45 N9: in a directory others can write (``/tmp``-like, sticky), another user puts a
    link where the secret file will be, to a root-owned file whose content they know; it was
    read with only a warning. Now refused; a link from a safe directory into a sticky one is
    fine (only the file's owner can replace a file there), into a non-sticky one refused."""
    from hybrid_offload.core.secrets import SecretError, read_secret

    known = tmp_path / "known"
    known.write_text("everyone-knows-this\n")
    known.chmod(0o644)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "cache-secret").symlink_to(known)  # planted before the engine created its file
    with pytest.raises(SecretError, match="a directory other users can write"):
        read_secret(file=str(shared / "cache-secret"), what="t")
    group = tmp_path / "group"
    group.mkdir()
    (group / "secret").write_text("s")
    (group / "secret").chmod(0o600)
    group.chmod(0o770)
    with pytest.raises(SecretError, match="a directory other users can write"):
        read_secret(file=str(group / "secret"), what="t")
    (shared / "mine").write_text("fine")
    (shared / "mine").chmod(0o600)
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o700)
    (safe / "secret").symlink_to(shared / "mine")
    assert read_secret(file=str(safe / "secret"), what="t").value == b"fine"  # type: ignore[union-attr]
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    (open_dir / "theirs").write_text("x")
    (open_dir / "theirs").chmod(0o600)
    open_dir.chmod(0o777)
    (safe / "other").symlink_to(open_dir / "theirs")
    with pytest.raises(SecretError, match="a directory other users can write"):
        read_secret(file=str(safe / "other"), what="t")


def test_a_secret_file_appears_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 45 N10: a crash while writing a new secret file left it empty for good (and a
    racing process read it empty). Now it is written under another name and linked into place:
    a failure leaves nothing, and the next start creates it."""
    from hybrid_offload.core import secrets
    from hybrid_offload.core.secrets import SecretError, create_secret_file, read_secret

    path = tmp_path / "cfg" / "cache-secret"

    def crash(fd: int) -> None:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as mp:
        mp.setattr(secrets.os, "fsync", crash)
        with pytest.raises(SecretError, match="Input/output error"):
            create_secret_file(str(path))
    assert not path.exists() and list(path.parent.iterdir()) == []
    assert create_secret_file(str(path)) and not create_secret_file(str(path))
    secret = read_secret(file=str(path), what="t")
    assert secret is not None and len(secret.value) == 64
    assert [p.name for p in path.parent.iterdir()] == ["cache-secret"]
