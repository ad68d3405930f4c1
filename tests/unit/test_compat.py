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


def installed_as(monkeypatch: pytest.MonkeyPatch, **found: str) -> None:
    """Pretend ``package=version`` is installed; the other packages are not."""
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(compat, "installed_version", found.get)


def test_the_connector_refuses_before_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybrid_offload.connector.facade import HybridOffloadConnector

    installed_as(monkeypatch, vllm="0.99.0")
    with pytest.raises(UntestedVersionError, match=r"^HybridOffloadConnector: vllm 0\.99\.0"):
        HybridOffloadConnector(None, None, None)  # type: ignore[arg-type]  (never gets further)


def test_the_metrics_refuse_before_they_register(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybrid_offload.connector.prometheus import HybridOffloadPromMetrics

    installed_as(monkeypatch, prometheus_client="0.1.0")
    with pytest.raises(UntestedVersionError, match=r"prometheus_client 0\.1\.0"):
        HybridOffloadPromMetrics(None, {}, [], {})  # type: ignore[arg-type]


def test_the_cache_peer_refuses_before_it_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybrid_offload.backends.nixl_peer.server import PeerOptions, PeerServer

    server = PeerServer(PeerOptions("127.0.0.1", 0, capacity_bytes=1 << 20, insecure=True))
    installed_as(monkeypatch, nixl="0.1.0")
    with pytest.raises(UntestedVersionError, match=r"^hybrid-offload peer: nixl 0\.1\.0"):
        server.start()


def test_patch_versions_are_compared_by_release_prefix() -> None:
    assert compat.release_in("0.32.1", ("0.31.", "0.32."))
    assert not compat.release_in("0.320.0", ("0.32.",))
    assert not compat.release_in(None, ("0.32.",))
    assert compat.releases_text(("0.31.", "0.32.")) == "0.31.x, 0.32.x"


def test_mamba_rank_dims_inverts_vllms_state_shapes() -> None:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Calc

    conv, ssm = Calc.mamba2_state_shape(2, 2048, 4, 32, 64, 128, 4)  # tp 2, 4 groups, 32 heads
    assert compat.mamba_rank_dims("MAMBA2", (tuple(conv), tuple(ssm))) == compat.MambaRankDims(16, 64, 128, 2)
    conv, ssm = Calc.gated_delta_net_state_shape(1, 4, 8, 32, 64, 4)  # 4 key heads, 8 value heads
    assert compat.mamba_rank_dims("GDN_ATTN", (tuple(conv), tuple(ssm))) == compat.MambaRankDims(8, 64, 32, 4)
    assert compat.mamba_rank_dims("MAMBA1", (tuple(conv), tuple(ssm))) is None
    assert compat.mamba_rank_dims("MAMBA2", ((3, 100), (4, 8, 16))) is None  # does not fit


def test_registered_collectors_lists_each_collectors_names() -> None:
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    counter = Counter("hybrid_offload_probe", "probe", registry=registry)
    assert compat.registered_collectors(registry) == {
        counter: {"hybrid_offload_probe", "hybrid_offload_probe_created", "hybrid_offload_probe_total"}
    }
    assert compat.registered_collectors(object()) == {}


def test_nixl_agent_keeps_the_progress_delay_and_restores_nixls_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import uuid

    api = compat.nixl_api()
    original = api.nixlBind.nixlAgentConfig
    real_agent = api.nixlBind.nixlAgent
    seen: list[tuple[bool, int]] = []

    def agent(name: str, config: object) -> object:
        seen.append((config.useProgThread, config.pthrDelay))  # type: ignore[attr-defined]
        return real_agent(name, config)

    monkeypatch.setattr(api.nixlBind, "nixlAgent", agent)
    compat.nixl_agent(f"compat-{uuid.uuid4().hex}", progress_thread=True, progress_delay_us=250)
    compat.nixl_agent(f"compat-{uuid.uuid4().hex}", progress_thread=False)
    assert seen == [(True, 250), (False, 0)]
    assert api.nixlBind.nixlAgentConfig is original
