"""Builders shared by the composition tests (``test_foreign_connectors``,
``test_composite_connector``): recording child connectors (``tests/foreign_connectors.py``)
loaded by module path through vLLM's factory, on a minimal vllm_config / kv_cache_config
stand-in, and a fixed native side."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from foreign_connectors import NonHmaRecordingConnector, RecordingConnector
from scheduler_world import FakeRequest, prompt
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from hybrid_offload.connector.children import ForeignConnectors
from hybrid_offload.connector.config import ROOT, parse_child_connectors

SCHED, WORKER = KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER
REQ = FakeRequest("r1", prompt(64))


def child(name: str, weight: float = 1.0, hma: bool = True, **extra: Any) -> dict[str, Any]:
    """A vLLM-style child config for a recording connector, plus our ``name``/``load_weight``."""
    return {
        "kv_connector": "RecordingConnector" if hma else "NonHmaRecordingConnector",
        "kv_connector_module_path": "foreign_connectors",
        "kv_connector_extra_config": extra,
        "name": name,
        "load_weight": weight,
    }


def vllm_config(
    extra: dict[str, Any] | None = None, connector: str = "HybridMultiConnector"
) -> SimpleNamespace:
    """What our connectors' constructors read before the model (and the children read at all)."""
    parent = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path="hybrid_offload.connector",
        kv_role="kv_both",
        kv_connector_extra_config=extra or {},
    )
    parallel = SimpleNamespace(pipeline_parallel_size=1)
    return SimpleNamespace(kv_transfer_config=parent, parallel_config=parallel)


def kv_cache_config(groups: int = 2) -> SimpleNamespace:
    ids = tuple(range(groups))
    return SimpleNamespace(kv_cache_groups=list(ids), prefix_cacheable_group_ids=ids, transfer_group_ids=ids)


def build(*children: dict[str, Any], role: KVConnectorRole = SCHED, groups: int = 2) -> ForeignConnectors:
    configs = parse_child_connectors(list(children), f"{ROOT}.connectors")
    return ForeignConnectors(configs, vllm_config(), role, kv_cache_config(groups))


def recorder(fc: ForeignConnectors, index: int) -> RecordingConnector:
    conn = fc.connectors[index]
    assert isinstance(conn, RecordingConnector | NonHmaRecordingConnector)
    return conn


def hooks(conn: Any, name: str) -> list[tuple[Any, ...]]:
    return [args for hook, args in conn.calls if hook == name]


class FakeNative:
    """The native side as choose_source sees it: a fixed answer and score."""

    def __init__(self, tokens: int, score: float) -> None:
        self.tokens, self.score, self.dropped = tokens, score, False

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.tokens, self.tokens > 0

    def load_score(self, req_id: str) -> float:
        return 0.0 if self.dropped else self.score

    def drop_planned_load(self, req_id: str) -> None:
        self.dropped = True
