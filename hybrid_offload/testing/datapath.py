"""The data path without vLLM: a hybrid model's KV cache in vLLM 0.32's GPU layouts, and an
:class:`~hybrid_offload.connector.worker.offload_worker.OffloadWorker` storing and loading requests into it.

Torch alone (no vLLM), so that the same code runs in ``make test`` on CPU and on a GPU machine
that has no vLLM (``tests/datapath``, ``hybrid-offload bench gpu``). Page jobs are built as the
scheduler side builds them: one page set per (chunk, group), the states of the Mamba/GDN groups
at the request's last chunk boundary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybrid_offload.backends import BackendConfig
from hybrid_offload.connector.config import DEFAULT_LOAD_SWITCH_INTERVAL_S, Tier, TierPolicy
from hybrid_offload.connector.metadata import LoadJob, LoadSegment, PageJob, StoreJob
from hybrid_offload.connector.worker.offload_worker import OffloadWorker
from hybrid_offload.core.planner import GPU_HYBRID_ALIGNMENT, HybridOffloadPlanner
from hybrid_offload.core.spec import GroupKind, GroupSpec, ModelSpec, make_model_spec
from hybrid_offload.core.tp_shards import Component, TensorSplit
from hybrid_offload.testing.vllm_layouts import allocate

__all__ = [
    "QWEN3_NEXT_80B",
    "HybridShape",
    "KVWorld",
    "SpecWorld",
    "changed_blocks",
    "fill_random",
    "kv_bytes_at",
]


@dataclass(frozen=True)
class HybridShape:
    """A hybrid model's KV cache: attention layers (``kv_dtype``: ``"uint8"`` for fp8 KV) and
    GDN layers (conv state ``(kernel - 1, dim)``, SSM state ``(v_heads, head_v, head_k)``), in
    groups of ``group_layers`` layers as vLLM groups them; shapes at TP=1."""

    attn_layers: int
    kv_heads: int
    head_size: int
    gdn_layers: int
    k_heads: int
    v_heads: int
    head_k: int
    head_v: int
    group_layers: int
    conv_kernel: int = 4
    dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"

    def state_shapes(self, tp: int = 1) -> tuple[tuple[int, int], tuple[int, int, int]]:
        conv_dim = (2 * self.k_heads * self.head_k + self.v_heads * self.head_v) // tp
        return (self.conv_kernel - 1, conv_dim), (self.v_heads // tp, self.head_v, self.head_k)

    def state_bytes(self, tp: int = 1) -> int:
        return sum(math.prod(s) for s in self.state_shapes(tp)) * getattr(torch, self.dtype).itemsize

    def block_size(self, tp: int = 1) -> int:
        """vLLM's hybrid block size: the smallest multiple of 16 tokens whose attention page
        holds a GDN state (``_align_hybrid_block_size``)."""
        per_token = (self.kv_heads // tp) * 2 * self.head_size * getattr(torch, self.kv_dtype).itemsize
        return 16 * -(-self.state_bytes(tp) // (16 * per_token))


#: Qwen3-Next-80B-A3B: 12 gated-attention layers (2 KV heads x 256), 36 GDN layers, bf16
QWEN3_NEXT_80B = HybridShape(
    attn_layers=12, kv_heads=2, head_size=256, gdn_layers=36, k_heads=16, v_heads=32,
    head_k=128, head_v=128, group_layers=12,
)  # fmt: skip


def model_spec(shape: HybridShape, num_blocks: int, tp_size: int = 1, tp_rank: int = 0) -> ModelSpec:
    """The ModelSpec an engine of ``shape`` at ``tp_size`` builds (Mamba cache mode align)."""
    bs, t = shape.block_size(tp_size), tp_size
    itemsize = getattr(torch, shape.kv_dtype).itemsize
    page = bs * (shape.kv_heads // t) * 2 * shape.head_size * itemsize
    layers = shape.attn_layers + shape.gdn_layers
    every = layers // shape.attn_layers  # one attention layer in ``every`` (Qwen3-Next: 4)
    attn = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers) if i % every == every - 1)
    gdn = tuple(f"model.layers.{i}.linear_attn" for i in range(layers) if i % every != every - 1)
    n = shape.group_layers
    groups = [GroupSpec(0, GroupKind.FULL_ATTENTION, bs, attn, page_bytes=page, dtype=shape.kv_dtype,
                        num_kv_heads=shape.kv_heads // t, head_size=shape.head_size,
                        head_size_v=shape.head_size, total_kv_heads=shape.kv_heads)]  # fmt: skip
    splits = (
        TensorSplit(1, (Component("q", shape.k_heads, shape.head_k),
                        Component("k", shape.k_heads, shape.head_k),
                        Component("v", shape.v_heads, shape.head_v))),
        TensorSplit(0, (Component("heads", shape.v_heads, 1),)),
    )  # fmt: skip
    for i in range(0, len(gdn), n):
        groups.append(GroupSpec(
            len(groups), GroupKind.MAMBA, bs, gdn[i : i + n], page_bytes=page,
            state_shapes=shape.state_shapes(t), state_dtypes=(shape.dtype, shape.dtype),
            mamba_cache_mode="align", mamba_type="gdn", state_splits=splits,
        ))  # fmt: skip
    return make_model_spec(
        tuple(groups), {"name": "datapath-hybrid", "shape": repr(shape)}, max_model_len=1 << 20,
        num_blocks=num_blocks, tp_rank=tp_rank, tp_size=tp_size, max_shards=8,
    )  # fmt: skip


def fill_random(raw: torch.Tensor, seed: int) -> None:
    """Random bytes in the whole buffer, none of them a NaN or infinity in any float dtype
    (bit 6 of every byte clear), so that typed copies keep every bit."""
    gen = torch.Generator(device=raw.device).manual_seed(seed)
    raw.view(torch.uint8).random_(0, 256, generator=gen).bitwise_and_(0xBF)


def kv_bytes_at(kv: torch.Tensor, table: Sequence[int], block_size: int, tokens: range) -> torch.Tensor:
    """The K|V bytes of ``tokens`` of a request with block table ``table`` in one attention
    layer's logical view: ``(tokens, heads, 2 * head_size * itemsize)`` uint8, on the host."""
    pos = torch.arange(tokens.start, tokens.stop)
    kblock = kv.shape[2]
    per_block = block_size // kblock
    blocks = torch.as_tensor(list(table))[pos // block_size] * per_block + (pos % block_size) // kblock
    return kv.view(torch.uint8)[blocks.to(kv.device), :, (pos % kblock).to(kv.device), :].cpu()


def changed_blocks(world: KVWorld, before: torch.Tensor) -> set[int]:
    """Block ids whose bytes differ from ``before`` (a copy of the raw buffer) in any layer."""
    out: set[int] = set()
    for view in world.views.values():
        now = view.view(torch.int8)
        then = torch.as_strided(before, now.shape, now.stride(), now.storage_offset())
        out |= set((now != then).flatten(1).any(1).nonzero().flatten().tolist())
    return out


class KVWorld:
    """One engine's worker over a KV cache allocated as vLLM 0.32 does (``layout``), on
    ``device``, storing to and loading from ``tiers``."""

    def __init__(
        self, shape: HybridShape, num_blocks: int, layout: str, device: str, tiers: Sequence[BackendConfig],
        *, tp_size: int = 1, tp_rank: int = 0, staging_pool_bytes: int = 512 << 20,
    ) -> None:  # fmt: skip
        """``device``: also ``"cpu+gpu-path"``, the CPU taking the GPU's paths (``DeviceTransfers``)."""
        device, _, path = device.partition("+")
        self.shape, self.device = shape, torch.device(device)
        self.spec = model_spec(shape, num_blocks, tp_size, tp_rank)
        on_gpu = self.device.type == "cuda"  # the default chunk a GPU engine's connector takes
        self.planner = HybridOffloadPlanner(self.spec, hybrid_alignment=GPU_HYBRID_ALIGNMENT if on_gpu else 0)
        self.chunk = self.planner.chunk_tokens
        self.block_size = self.spec.groups[0].block_size
        self.raw, self.views = allocate(self.spec.groups, num_blocks, layout, device)
        self.worker = OffloadWorker(  # as the connector makes it with the shipped defaults
            self.spec, self.planner, tuple(Tier(b, TierPolicy()) for b in tiers), 1 << 40,
            load_switch_interval_s=DEFAULT_LOAD_SWITCH_INTERVAL_S, staging_pool_bytes=staging_pool_bytes,
        )  # fmt: skip
        self.worker.register_kv_caches(self.views, attention_format="logical",
                                       device_path=True if path == "gpu-path" else None)  # fmt: skip

    # ---- page jobs as the scheduler builds them ---------------------------------------------
    def pages(self, tokens: Sequence[int], table: Sequence[int], state_block: int) -> list[PageJob]:
        """The page sets of ``tokens``' whole chunks, in ``table``'s blocks; the GDN groups'
        state of the last whole chunk in block ``state_block``."""
        hashes = self.planner.chunk_hashes(tokens)
        bs, chunk = self.block_size, self.chunk
        jobs = []
        for group in self.spec.groups:
            if group.is_attention:
                for c, h in enumerate(hashes):
                    first, last = c * chunk, (c + 1) * chunk - 1
                    jobs.append(PageJob(self.planner.page_key(h, group.index), group.index, c, h,
                                        tuple(table[first // bs : last // bs + 1]), first % bs))  # fmt: skip
            elif hashes:
                c = len(hashes) - 1
                jobs.append(PageJob(self.planner.page_key(hashes[c], group.index), group.index, c,
                                    hashes[c], (state_block,)))  # fmt: skip
        return jobs

    def store(self, pages: Sequence[PageJob], backends: Sequence[str], timeout: float = 600.0) -> None:
        """Copy ``pages`` out (as ``wait_for_save`` does) and wait until they are stored."""
        self.worker.copy_out([StoreJob(p, tuple(backends)) for p in pages])
        self.worker.flush(timeout)

    def load(
        self, pages: Sequence[PageJob], backend: str, req_id: str = "req", timeout: float = 600.0
    ) -> bool:
        """Load ``pages`` from ``backend`` as the model-runner thread does; whether it worked."""
        self.worker.start_loads([LoadJob(req_id, (LoadSegment(backend, tuple(pages)),))])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            recving, failed = self.worker.write_finished_loads(wait_s=0.05)
            if req_id in recving:
                return req_id not in failed
        raise TimeoutError(f"load of {req_id} did not finish in {timeout} s")

    def state_bytes(self, group: int, block: int) -> torch.Tensor:
        """Every GDN layer of ``group``: the unpadded state bytes of ``block``, on the host."""
        g = self.spec.groups[group]
        return torch.stack([self.views[n].view(torch.uint8)[block].flatten()[: g.state_bytes]
                            for n in g.layer_names]).cpu()  # fmt: skip

    def close(self) -> None:
        self.worker.shutdown()


class SpecWorld(KVWorld):
    """A :class:`KVWorld` over any :class:`~hybrid_offload.core.spec.ModelSpec`, e.g. one that
    ``engine.translate`` made from the KV cache config vLLM builds for a model (groups in vLLM's
    order: Mamba groups may come first), instead of a :class:`HybridShape`. Every group must
    have one block size (vLLM's ``align`` Mamba cache mode); ``spec.num_blocks`` blocks are
    allocated. ``hybrid_alignment``: the planner's (:data:`GPU_HYBRID_ALIGNMENT` for the specs of
    a GPU engine, so that engines at every TP size cut the same chunks); default as
    :class:`KVWorld` (by the device)."""

    def __init__(
        self, spec: ModelSpec, layout: str, device: str, tiers: Sequence[BackendConfig], *,
        hybrid_alignment: int | None = None, staging_pool_bytes: int = 512 << 20,
    ) -> None:  # fmt: skip
        device, _, path = device.partition("+")
        sizes = {g.block_size for g in spec.groups}
        if len(sizes) != 1:
            raise ValueError(f"groups of several block sizes {sorted(sizes)}: not a hybrid in align mode")
        self.device, self.spec = torch.device(device), spec
        if hybrid_alignment is None:
            hybrid_alignment = GPU_HYBRID_ALIGNMENT if self.device.type == "cuda" else 0
        self.planner = HybridOffloadPlanner(spec, hybrid_alignment=hybrid_alignment)
        self.chunk = self.planner.chunk_tokens
        self.block_size = sizes.pop()
        self.raw, self.views = allocate(spec.groups, spec.num_blocks, layout, device)
        self.worker = OffloadWorker(
            spec, self.planner, tuple(Tier(b, TierPolicy()) for b in tiers), 1 << 40,
            load_switch_interval_s=DEFAULT_LOAD_SWITCH_INTERVAL_S, staging_pool_bytes=staging_pool_bytes,
        )  # fmt: skip
        self.worker.register_kv_caches(self.views, attention_format="logical",
                                       device_path=True if path == "gpu-path" else None)  # fmt: skip
