"""Backend registry: lookup, lazy import, and the errors a user sees."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_offload.backends import (
    BackendConfig,
    BackendConfigError,
    backend_class,
    create_backend,
    known_types,
    register_backend,
    registry,
)
from hybrid_offload.backends.cpu import CpuBackend
from hybrid_offload.backends.disk import DiskBackend


@pytest.fixture(autouse=True)
def _private_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test edits its own copy of the registry."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))


def test_builtin_types() -> None:
    assert {"cpu", "disk"} <= set(known_types())
    assert backend_class("cpu") is CpuBackend
    assert backend_class("disk") is DiskBackend


def test_unknown_type_lists_known_types() -> None:
    with pytest.raises(BackendConfigError) as info:
        backend_class("tape")
    message = str(info.value)
    assert "'tape'" in message and "cpu" in message and "disk" in message
    with pytest.raises(BackendConfigError, match="tape"):
        create_backend(BackendConfig("tape", "t", 1000))


@pytest.mark.parametrize(
    ("type_name", "options", "named"),
    [
        ("cpu", {"path": "/x"}, "path"),
        ("disk", {}, "path"),
        ("disk", {"path": "x", "io_threads": -1}, "io_threads"),
        ("disk", {"path": "x", "colour": 1}, "colour"),
    ],
)
def test_bad_option_names_backend_and_key(type_name: str, options: dict, named: str) -> None:
    with pytest.raises(BackendConfigError, match=named) as info:
        create_backend(BackendConfig(type_name, "my-backend", 1000, options=options))
    assert "my-backend" in str(info.value)


@pytest.mark.parametrize("capacity", [-1, 1.5, True, "1000"])
def test_bad_capacity_named(capacity: object) -> None:
    with pytest.raises(BackendConfigError, match="capacity_bytes"):
        create_backend(BackendConfig("cpu", "c", capacity))  # type: ignore[arg-type]


def test_create_fills_option_defaults(tmp_path: Path) -> None:
    with create_backend(BackendConfig("disk", "d", 1000, options={"path": str(tmp_path)})) as b:
        assert isinstance(b, DiskBackend)
        assert b.config.options == {
            "path": str(tmp_path), "fsync": False, "io_threads": 4, "layout": "files", "segment_mb": 64
        }
    with create_backend(BackendConfig("cpu", "c", 1000)) as b:
        assert isinstance(b, CpuBackend) and b.config.options == {}


def test_import_failure_names_type_and_module() -> None:
    register_backend("broken", "hybrid_offload_no_such_module_xyz.sub:Thing")
    assert "broken" in known_types()
    with pytest.raises(ImportError) as info:
        backend_class("broken")
    assert "'broken'" in str(info.value)
    assert "hybrid_offload_no_such_module_xyz.sub" in str(info.value)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_missing_class_and_non_backend_named() -> None:
    register_backend("noclass", "hybrid_offload.backends.cpu:NoSuchBackend")
    with pytest.raises(ImportError, match=r"noclass.*hybrid_offload\.backends\.cpu.*NoSuch"):
        backend_class("noclass")
    register_backend("notabackend", "hybrid_offload.backends.base:BackendStats")
    with pytest.raises(TypeError, match="notabackend"):
        backend_class("notabackend")


def test_register_class_and_clobber() -> None:
    class Fake(CpuBackend):
        type_name = "fake"

    register_backend("fake", Fake)
    register_backend("fake", Fake)  # same target again: fine
    assert backend_class("fake") is Fake
    with pytest.raises(ValueError, match="already registered"):
        register_backend("fake", "hybrid_offload.backends.cpu:CpuBackend")
    register_backend("fake", "hybrid_offload.backends.cpu:CpuBackend", clobber=True)
    assert backend_class("fake") is CpuBackend


@pytest.mark.parametrize(
    ("type_name", "target", "error"),
    [
        ("Bad-Name", "m:C", ValueError),
        ("", "m:C", ValueError),
        ("ok", "no_colon", ValueError),
        ("ok", "m:C:D", ValueError),
        ("ok", int, TypeError),
    ],
)
def test_register_rejects_bad_input(type_name: str, target: object, error: type) -> None:
    with pytest.raises(error):
        register_backend(type_name, target)  # type: ignore[arg-type]
    assert "ok" not in known_types()


def test_importing_package_imports_no_backend() -> None:
    code = (
        "import sys, hybrid_offload.backends as b; "
        "assert b.known_types(); "
        "print(sorted(m for m in sys.modules if m.startswith('hybrid_offload.backends.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "cpu" not in out and "disk" not in out, out


def test_a_type_may_be_a_module_path() -> None:
    assert backend_class("hybrid_offload.backends.cpu:CpuBackend") is CpuBackend
    with pytest.raises(ImportError, match="no_such_module"):
        backend_class("no_such_module:Backend")
    with pytest.raises(ImportError, match="NoSuchClass"):
        backend_class("hybrid_offload.backends.cpu:NoSuchClass")
