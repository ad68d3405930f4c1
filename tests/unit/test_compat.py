"""The compat gate: tested releases of the packages whose private APIs we use, checked at start."""

from __future__ import annotations

import logging

import pytest

from hybrid_offload import compat
from hybrid_offload.compat import ALLOW_UNTESTED_ENV, UntestedVersionError, check_versions


def test_the_installed_releases_are_the_tested_ones() -> None:
    for package in compat.TESTED:
        found = compat.installed_version(package)
        assert found is not None and compat.is_tested(package), (package, found)
    check_versions(*compat.TESTED)


def test_an_untested_release_is_refused_naming_package_and_versions(monkeypatch) -> None:
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(compat, "installed_version", lambda package: "0.99.1" if package == "vllm" else None)
    with pytest.raises(UntestedVersionError) as info:
        check_versions("vllm", "nixl", what="HybridOffloadConnector")
    message = str(info.value)
    assert message.startswith("HybridOffloadConnector: vllm 0.99.1 is not a release")
    assert "(0.32.x)" in message and f"{ALLOW_UNTESTED_ENV}=1" in message
    check_versions("nixl")  # not installed: not this check's business


def test_the_override_turns_the_refusal_into_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    monkeypatch.setattr(compat, "installed_version", lambda package: "2.0.0")
    with caplog.at_level(logging.WARNING, logger="hybrid_offload.compat"):
        check_versions("prometheus_client", what="metrics")
    assert "prometheus_client 2.0.0 is not a release" in caplog.text


def test_importing_the_gate_imports_none_of_the_gated_packages() -> None:
    import subprocess
    import sys

    gated = "{'vllm', 'nixl', 'prometheus_client', 'torch'}"
    probe = f"import sys, hybrid_offload.compat; print(sorted({gated} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
