"""The scheduler-side unit tests' world: fake vLLM requests and scheduler outputs
(``FakeRequest``, ``step``), ``World`` (a planner plus an OffloadScheduler over real backends)
and ``flaky_disk`` (a disk tier in the test kit's ``FaultyBackend``: ``World.faulty``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hybrid_offload.backends import BackendConfig, create_backend
from hybrid_offload.connector.config import Tier, TierPolicy
from hybrid_offload.connector.metadata import LoadJob, OffloadMetadata, OffloadWorkerMetadata
from hybrid_offload.connector.scheduler.offload_scheduler import OffloadScheduler
from hybrid_offload.core.planner import HybridOffloadPlanner
from hybrid_offload.core.spec import GroupKind, GroupSpec, ModelSpec, make_model_spec
from hybrid_offload.testing.faulty import FaultyBackend, faulty_config, faulty_in

ATTN, MAMBA = 0, 1


def make_spec(attn_block: int, mamba_block: int, mamba_cache_mode: str = "align") -> ModelSpec:
    attn = GroupSpec(
        ATTN,
        GroupKind.FULL_ATTENTION,
        attn_block,
        ("model.layers.0.attn",),
        page_bytes=attn_block * 2 * 2 * 32 * 2,
        num_kv_heads=2,
        head_size=32,
        head_size_v=32,
    )
    mamba = GroupSpec(
        MAMBA,
        GroupKind.MAMBA,
        mamba_block,
        ("model.layers.1.mixer",),
        page_bytes=128,
        state_shapes=((3, 8), (4, 4)),
        state_dtypes=("bfloat16", "float32"),
        mamba_cache_mode=mamba_cache_mode,
        mamba_type="mamba2",
    )
    return make_model_spec((attn, mamba), {"name": "fake-hybrid"}, max_model_len=4096, num_blocks=64)


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    mm_features: list[Any] | None = None
    prompt_embeds: Any = None
    lora_request: Any = None
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [1000 + offset + i for i in range(n)]


def new_req(req_id: str, block_ids: tuple[list[int], ...], computed: int) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, block_ids=block_ids, num_computed_tokens=computed)


def step(
    new: list[SimpleNamespace] | None = None,
    cached: list[tuple[str, tuple[list[int], ...] | None, int]] | None = None,
    scheduled: dict[str, int] | None = None,
    resumed: set[str] | None = None,
    preempted: set[str] | None = None,
) -> SimpleNamespace:
    """A SchedulerOutput; ``cached`` holds (req_id, new_block_ids or None, num_computed_tokens)."""
    cached = cached or []
    return SimpleNamespace(
        scheduled_new_reqs=new or [],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            resumed_req_ids=resumed or set(),
            new_block_ids=[c[1] for c in cached],
            num_computed_tokens=[c[2] for c in cached],
        ),
        num_scheduled_tokens=scheduled or {},
        preempted_req_ids=preempted or set(),
    )


def tier(config: BackendConfig, **policy: Any) -> Tier:
    """``config`` as a tier of the connector, with ``policy`` (:class:`TierPolicy` fields)."""
    return Tier(config, TierPolicy(**policy))


def as_tiers(backends: Sequence[BackendConfig | Tier]) -> tuple[Tier, ...]:
    """Tiers for the connector: a bare BackendConfig gets the default policy."""
    return tuple(b if isinstance(b, Tier) else tier(b) for b in backends)


def cpu_config(name: str = "cpu", weight: float = 1.0, **policy: Any) -> Tier:
    return tier(BackendConfig("cpu", name, 1 << 30), load_weight=weight, **policy)


class World:
    """A planner plus a scheduler; keys of prompts; ways to make backends hold pages."""

    def __init__(
        self, spec: ModelSpec, chunk: int, backends: Sequence[BackendConfig | Tier], policy: str = "weighted",
        **scheduler_kw: Any,
    ) -> None:
        self.planner = HybridOffloadPlanner(spec, chunk)
        self._sets: dict[str, int] = {}
        self.clock = [0.0]
        tiers = as_tiers(backends)
        self.sched = OffloadScheduler(
            self.planner, tiers, policy, clock=lambda: self.clock[0], **scheduler_kw
        )
        self.configs = {t.name: t.backend for t in tiers}
        self._writers: dict[str, Any] = {}

    def faulty(self, name: str) -> FaultyBackend:
        """The fault-injecting wrapper of the scheduler's tier ``name`` (see :func:`flaky_disk`)."""
        (view,) = (v for v in self.sched.views if v.name == name)
        assert view.opened is not None, f"tier {name!r} is not opened in the scheduler (not shared)"
        return faulty_in(view.opened.backend)

    def complete(self, meta: OffloadMetadata) -> None:
        """Report what a worker would after ``meta``: stores and commits done (cpu pages
        visible in the mirror)."""
        pages = [s.page for s in meta.stores if not s.hold] + [c.page for c in meta.commits]
        pieces = [k for p in pages for k in self.planner.piece_keys(p.key, p.group)]
        stored = {name: pieces for name in self.configs if self.configs[name].type == "cpu"}
        report = OffloadWorkerMetadata(stored=stored, settled=[p.key for p in pages])
        self.sched.update_connector_output(report, None, None)

    def keys(self, tokens: list[int], scope: bytes = b"") -> list[list[str]]:
        """Page-set keys per group per chunk (:meth:`hold` stores their pieces)."""
        keys = self.planner.group_keys(self.planner.chunk_hashes(tokens, scope))
        self._sets.update((k, g) for g, group_keys in enumerate(keys) for k in group_keys)
        return keys

    def chunk_keys(
        self, tokens: list[int], chunks: range, groups: tuple[int, ...] = (ATTN, MAMBA)
    ) -> list[str]:
        keys = self.keys(tokens)
        return [keys[g][c] for g in groups for c in chunks]

    def pieces(self, keys: list[str]) -> list[str]:
        """The backend keys of page sets ``keys`` (from :meth:`keys`)."""
        return [p for k in keys for p in self.planner.piece_keys(k, self._sets[k])]

    def hold(self, name: str, keys: list[str]) -> None:
        """Make backend ``name`` hold ``keys`` (of page sets from :meth:`keys`: every piece of
        the set): a worker report for cpu, real pages for disk."""
        keys = [p for k in keys
                for p in (self.planner.piece_keys(k, self._sets[k]) if k in self._sets else [k])]  # fmt: skip
        config = self.configs[name]
        if config.type == "cpu":
            self.sched.update_connector_output(OffloadWorkerMetadata(stored={name: keys}), None, None)
        else:
            if name not in self._writers:
                self._writers[name] = create_backend(config)
            assert all(self._writers[name].put_batch([(k, b"page") for k in keys]))

    def close(self) -> None:
        self.sched.shutdown()
        for backend in self._writers.values():
            backend.close()


def start_load(w: World, req: FakeRequest, computed: int, tables: tuple[list[int], ...]) -> LoadJob:
    n, is_async = w.sched.get_num_new_matched_tokens(req, computed)
    assert is_async and n > 0
    w.sched.update_state_after_alloc(req, tables, n)
    meta = w.sched.build_connector_meta(step())
    assert len(meta.loads) == 1 and not meta.stores
    return meta.loads[0]


def flaky_disk(root: Path, name: str = "redis") -> BackendConfig:
    """A disk backend (a shared index, as Redis's) whose calls a test makes fail
    (``World.faulty(name).fail(...)``)."""
    return faulty_config(BackendConfig("disk", name, 1 << 30, options={"path": str(root)}))
