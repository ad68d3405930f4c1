"""The compat gate: tested versions checked at start-up, private APIs reached through it only.

That no other module reaches a private API is the import contract's check
(``test_import_layers.py``: ``test_only_compat_reaches_private_apis`` and its negative test).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid

import pytest

from hybrid_offload import compat
from hybrid_offload.compat import ALLOW_UNTESTED_ENV, TESTED, UntestedVersionError, check_versions


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(compat, "_warned", set())


def installed_as(monkeypatch: pytest.MonkeyPatch, **versions: str | None) -> None:
    """Make :func:`compat.installed_version` answer ``versions`` (others: the real ones)."""
    real = compat.installed_version
    monkeypatch.setattr(compat, "installed_version", lambda package: versions.get(package, real(package)))


def test_the_installed_versions_are_the_tested_ones() -> None:
    for package in TESTED:
        assert compat.installed_version(package) is not None, package
        assert compat.is_tested(package), (package, compat.installed_version(package))
    check_versions(*TESTED)


def test_an_untested_version_fails_naming_package_versions_and_the_override(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    installed_as(monkeypatch, vllm="0.99.1")
    with pytest.raises(UntestedVersionError) as caught:
        check_versions("prometheus_client", "vllm")
    message = str(caught.value)
    assert "vllm 0.99.1" in message and "tested: 0.32.x" in message
    assert f"{ALLOW_UNTESTED_ENV}=1" in message


def test_a_package_that_is_not_installed_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    installed_as(monkeypatch, nixl=None)
    check_versions("nixl")
    assert compat.is_tested("nixl")


def test_the_override_warns_once_instead(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    installed_as(monkeypatch, nixl="2.0.0")
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger=compat.logger.name):
        check_versions("nixl")
        check_versions("nixl")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "nixl 2.0.0" in warnings[0] and "tested: 1.5.x" in warnings[0]
    assert ALLOW_UNTESTED_ENV in warnings[0]
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "0")  # 0 is no override
    with pytest.raises(UntestedVersionError, match=r"nixl 2\.0\.0"):
        check_versions("nixl")


def test_the_connector_checks_before_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybrid_offload.connector.facade import HybridOffloadConnector

    installed_as(monkeypatch, prometheus_client="0.1.0")
    with pytest.raises(UntestedVersionError, match=r"prometheus_client 0\.1\.0"):
        HybridOffloadConnector(None, None, None)  # type: ignore[arg-type]  (never gets that far)


def test_the_cache_peer_checks_before_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybrid_offload.backends.nixl_peer.server import PeerOptions, run_peer

    installed_as(monkeypatch, nixl="0.1.0")
    with pytest.raises(UntestedVersionError, match=r"nixl 0\.1\.0"):
        run_peer(PeerOptions("127.0.0.1", 0, capacity_bytes=1 << 20))


def test_importing_compat_imports_none_of_the_packages_it_gates() -> None:
    gated = {"vllm", "torch", "nixl", "nixl_cu12", "nixl_cu13", "nixl_meta_utils", "prometheus_client"}
    probe = f"import sys, hybrid_offload.compat; print(sorted({gated!r} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_mamba_rank_dims_inverts_vllms_shape_formula() -> None:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Calc

    conv, ssm = Calc.mamba2_state_shape(2, 2048, 4, 32, 64, 128, 4)  # tp 2, 4 groups, 32 heads
    assert compat.mamba_rank_dims("MAMBA2", (tuple(conv), tuple(ssm))) == compat.MambaRankDims(16, 64, 128, 2)
    conv, ssm = Calc.gated_delta_net_state_shape(1, 4, 8, 32, 64, 4)  # 4 key heads, 8 value heads
    assert compat.mamba_rank_dims("GDN_ATTN", (tuple(conv), tuple(ssm))) == compat.MambaRankDims(8, 64, 32, 4)
    assert compat.mamba_rank_dims("MAMBA1", (tuple(conv), tuple(ssm))) is None
    assert compat.mamba_rank_dims("MAMBA2", ((3, 100), (4, 8, 16))) is None  # does not fit


def test_registered_metric_names_lists_each_collector() -> None:
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    counter = Counter("hybrid_offload_probe", "probe", registry=registry)
    assert compat.registered_metric_names(registry) == {
        counter: ("hybrid_offload_probe", "hybrid_offload_probe_created", "hybrid_offload_probe_total")
    }
    assert compat.registered_metric_names(object()) == {}


def test_cpu_attention_isa_and_write_reach_vllm() -> None:
    import torch

    heads, block, dim = 2, 32, 64
    isa = compat.cpu_attention_isa(torch.bfloat16, block, dim)
    assert isinstance(isa, str) and isa
    cache = torch.zeros(1, heads, block, 2 * dim, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(1, heads, block * 2, dim).chunk(2, dim=2)
    key = torch.ones(block, heads, dim, dtype=torch.bfloat16)
    compat.cpu_attention_write(key, 2 * key, key_cache, value_cache, torch.arange(block), isa)
    assert sorted(cache.unique().tolist()) == [1.0, 2.0]


def test_nixl_agent_keeps_the_progress_delay_and_restores_nixls_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = compat.nixl_api()
    original = api.nixlBind.nixlAgentConfig
    seen: list[tuple[bool, int]] = []
    real_agent = api.nixlBind.nixlAgent

    def agent(name: str, config: object) -> object:
        seen.append((config.useProgThread, config.pthrDelay))  # type: ignore[attr-defined]
        return real_agent(name, config)

    monkeypatch.setattr(api.nixlBind, "nixlAgent", agent)
    compat.nixl_agent(f"compat-{uuid.uuid4().hex}", progress_thread=True, progress_delay_us=250)
    compat.nixl_agent(f"compat-{uuid.uuid4().hex}", progress_thread=False)
    assert seen == [(True, 250), (False, 0)]
    assert api.nixlBind.nixlAgentConfig is original
