"""Issue 7: page sets written at one tensor-parallel size load bit-identically at another.

For each hybrid arch, a real TP=1 engine stores its pages on disk with one shard per page set:
that gives the model's real per-layer KV and Mamba/GDN state tensors (the conv state's x, B, C
or q, k, v parts concatenated back in vLLM's channel order). vLLM's own sharding code
(``vllm_tp_rules``: its QKV, Mamba2/GDN conv1d and head weight loaders, its state shape
calculator) cuts them into the rank views of TP=2 and TP=4. Each rank's view is put into a KV
cache laid out as vLLM's, and the connector's codec writes it as TP=t1 into a real disk tier;
every rank of TP=t2 then reads its shards into an empty cache. For all pairs t1, t2 in
{1, 2, 4}: every rank holds exactly vLLM's view, bit for bit, and the ranks reassemble the
original tensors.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm_tp_rules as rules

from hybrid_offload.backends.base import BackendConfig
from hybrid_offload.backends.registry import create_backend
from hybrid_offload.connector.metadata import PageJob
from hybrid_offload.connector.page_codec import PageCodec
from hybrid_offload.core.model_card import is_card_key
from hybrid_offload.core.page_format import decode_page, seal_page
from hybrid_offload.core.planner import HybridOffloadPlanner
from hybrid_offload.core.spec import GroupSpec, ModelSpec, make_model_spec
from hybrid_offload.engine.kv_layout import build_layouts
from hybrid_offload.engine.translate import ModelShape, mamba_splits
from hybrid_offload.testing.session import run_session_subprocess

pytestmark = pytest.mark.e2e

#: arch -> hidden size (qwen3_next needs 4 GDN key heads to run at TP=4 in vLLM)
ARCHS = {"qwen3_next": 512, "falcon_h1": None, "nemotron_h": None, "granite_hybrid": None, "zamba2": None}
TP_SIZES = (1, 2, 4)
MAX_SHARDS = 8
FIELDS = {"name": "tp-portability", "dtype": "bfloat16"}
_N_GROUPS_KEYS = ("mamba_n_groups", "n_groups", "mamba_ngroups")


@dataclasses.dataclass
class Captured:
    """Per KV cache group of a TP=1 run: its spec and one page set's full tensors per layer
    (attention: ``(2, tokens, heads, dim)``; Mamba/GDN: ``[conv, ssm]``)."""

    groups: tuple[GroupSpec, ...]
    tensors: dict[int, list[Any]]
    chunk_tokens: int
    hf: dict[str, Any]


def _full_tensors(group: GroupSpec, payload: memoryview, tokens: int) -> list[Any]:
    parts, offset = [], 0
    for t in group.page_tensors(tokens):
        raw = torch.frombuffer(bytearray(payload[offset : offset + t.nbytes]), dtype=torch.uint8)
        parts.append(raw.view(getattr(torch, t.dtype)).view(t.shape))
        offset += t.nbytes
    per_layer = len(parts) // len(group.layer_names)
    out = []
    for layer in range(len(group.layer_names)):
        mine = parts[layer * per_layer : (layer + 1) * per_layer]
        if group.is_attention:
            out.append(torch.stack(mine))
        else:  # conv parts (x, B, C or q, k, v) back in vLLM's channel order, then the SSM state
            out.append([torch.cat(mine[:-1], dim=1), mine[-1]])
    return out


def capture(model: Path, disk: Path) -> Captured:
    rng = random.Random(7)
    prompt = [rng.randrange(3, 2000) for _ in range(1800)]
    connector = {"tp_shards": 1, "backends": [{"type": "disk", "name": "disk", "path": str(disk)}]}
    out = run_session_subprocess({"model": str(model), "prompts": [prompt], "max_tokens": 2,
                                  "passes": 1, "connector": connector})
    groups = tuple(GroupSpec.from_dict(g["spec"]) for g in out["groups"])
    chunk = out["chunk_tokens"]
    best: dict[int, tuple[int, memoryview]] = {}
    for path in disk.rglob("*.page"):
        if is_card_key(f"{path.parent.parent.name}-{path.stem}"):
            continue  # the engine's model card, not a page
        header, payload = decode_page(path.read_bytes())
        if header.chunk_index >= best.get(header.group_index, (-1, None))[0]:
            best[header.group_index] = (header.chunk_index, payload)
    assert sorted(best) == [g.index for g in groups], "every group stored a page"
    tensors = {g.index: _full_tensors(g, best[g.index][1], chunk) for g in groups}
    hf = json.loads((model / "config.json").read_text())
    return Captured(groups, tensors, chunk, hf)


# ---- vLLM's rank views ---------------------------------------------------------------------
def _dims(group: GroupSpec) -> rules.Mamba2Dims | rules.GdnDims:
    conv, _ = group.state_splits
    kernel = group.state_shapes[0][0] + 1
    if group.mamba_type == "MAMBA2":
        x, b, _ = conv.components
        return rules.Mamba2Dims(x.units, x.unit_size, b.units, b.unit_size, kernel)
    q, _, v = conv.components
    return rules.GdnDims(q.units, v.units, q.unit_size, v.unit_size, kernel)


def _kv_heads(cap: Captured, group: GroupSpec, t: int, r: int) -> list[int]:
    total = group.total_kv_heads or group.num_kv_heads
    return rules.kv_heads(cap.hf["num_attention_heads"], total, group.head_size, t, r)


def vllm_view(cap: Captured, group: GroupSpec, full: Any, t: int, r: int) -> Any:
    """Rank ``r`` of ``t``'s part of one layer's full tensors, as vLLM shards them."""
    if group.is_attention:
        return full[:, :, _kv_heads(cap, group, t, r)]
    conv, ssm = full
    dims = _dims(group)
    return [conv[:, rules.conv_channels(dims, t, r)], ssm[rules.ssm_heads(ssm.shape[0], t, r)]]


def rank_spec(cap: Captured, t: int, r: int) -> ModelSpec:
    """What the connector builds on rank ``r`` of a TP=``t`` engine (shapes from vLLM)."""
    n_groups = next((cap.hf[k] for k in _N_GROUPS_KEYS if k in cap.hf), None)
    groups = []
    for g in cap.groups:
        if g.is_attention:
            groups.append(dataclasses.replace(g, num_kv_heads=max(1, g.num_kv_heads // t),
                                              total_kv_heads=g.num_kv_heads, shards=1))
            continue
        shapes = rules.state_shapes(_dims(g), t)
        assert t > 1 or shapes == g.state_shapes, "vLLM's TP=1 shapes are the captured ones"
        splits = mamba_splits(g.mamba_type, shapes, ModelShape(t, 0, n_groups))
        groups.append(dataclasses.replace(g, state_shapes=shapes, state_splits=splits, shards=1))
    return make_model_spec(tuple(groups), FIELDS, tp_size=t, tp_rank=r, max_shards=MAX_SHARDS)


# ---- a rank's KV cache, laid out as vLLM's ---------------------------------------------------
class RankCache:
    """One rank's KV cache tensors for every group: attention ``(blocks, 2, block, heads, dim)``,
    Mamba/GDN int8 pages with the state packed at the start of block 0."""

    def __init__(self, spec: ModelSpec, tokens: int) -> None:
        self.spec, self.tokens, self.tensors = spec, tokens, {}
        self.blocks = max(-(-tokens // g.block_size) for g in spec.groups if g.is_attention) + 1
        for g in spec.groups:
            for name in g.layer_names:
                if g.is_attention:
                    self.tensors[name] = torch.zeros(self.blocks, 2, g.block_size, g.num_kv_heads,
                                                     g.head_size, dtype=getattr(torch, g.dtype))
                else:
                    self.tensors[name] = torch.zeros(self.blocks, g.state_bytes + 64, dtype=torch.int8)
        self.layouts = build_layouts(spec.groups, self.tensors, self.blocks)

    def job(self, group: GroupSpec, key: str) -> PageJob:
        if group.is_attention:
            return PageJob(key, group.index, 0, bytes(32), tuple(range(self.blocks - 1)))
        return PageJob(key, group.index, 0, bytes(32), (0,))

    def _attention_tokens(self, cache: torch.Tensor, block: int) -> list[tuple[slice, torch.Tensor]]:
        out = []
        for b in range(-(-self.tokens // block)):
            n = min(block, self.tokens - b * block)
            out.append((slice(b * block, b * block + n), cache[b, :, :n]))
        return out

    def put(self, group: GroupSpec, layer: str, value: Any) -> None:
        cache = self.tensors[layer]
        if group.is_attention:
            for tokens, dst in self._attention_tokens(cache, group.block_size):
                dst.copy_(value[:, tokens])
            return
        raw = torch.cat([v.contiguous().view(torch.uint8).reshape(-1) for v in value])
        cache[0, : raw.numel()].copy_(raw.view(torch.int8))

    def get(self, group: GroupSpec, layer: str, like: Any) -> Any:
        cache = self.tensors[layer]
        if group.is_attention:
            out = torch.empty_like(like)
            for tokens, src in self._attention_tokens(cache, group.block_size):
                out[:, tokens] = src
            return out
        out, offset = [], 0
        raw = cache[0].view(torch.uint8)
        for v in like:
            n = v.numel() * v.element_size()
            out.append(raw[offset : offset + n].view(v.dtype).view(v.shape))
            offset += n
        return out


def _bits(x: Any) -> list[bytes]:
    items = x if isinstance(x, list) else [x]
    return [bytes(i.contiguous().view(torch.uint8).reshape(-1).numpy()) for i in items]


# ---- write at t1, read at t2 -------------------------------------------------------------------
def write(cap: Captured, t: int, backend: Any) -> dict[int, str]:
    """Every rank of TP=t writes its shards; returns each group's page-set key."""
    set_keys: dict[int, str] = {}
    for r in range(t):
        spec = rank_spec(cap, t, r)
        planner = HybridOffloadPlanner(spec, cap.chunk_tokens)
        cache = RankCache(spec, cap.chunk_tokens)
        items = []
        for g in spec.groups:
            set_keys[g.index] = planner.page_key(bytes(32), g.index)
            for layer, full in zip(g.layer_names, cap.tensors[g.index], strict=True):
                cache.put(g, layer, vllm_view(cap, g, full, t, r))
            codec = PageCodec(spec, g, cap.chunk_tokens)
            job = cache.job(g, set_keys[g.index])
            keys = planner.piece_keys(job.key, g.index)
            for shard in codec.written:
                buf = bytearray(codec.page_lens[shard])
                payload = torch.frombuffer(buf, dtype=torch.uint8)[codec.header_lens[shard] :]
                codec.gather(cache.layouts[g.index], job, shard, payload)
                seal_page(buf, codec.header(job, shard))
                items.append((keys[shard], buf))
        assert all(backend.put_batch(items))
    return set_keys


def read_and_check(cap: Captured, t: int, backend: Any, set_keys: dict[int, str]) -> None:
    """Every rank of TP=t reads its shards into an empty cache: vLLM's view, bit for bit; the
    ranks together reassemble the full tensors."""
    rebuilt: dict[tuple[int, int], Any] = {}
    for r in range(t):
        spec = rank_spec(cap, t, r)
        planner = HybridOffloadPlanner(spec, cap.chunk_tokens)
        cache = RankCache(spec, cap.chunk_tokens)
        for g in spec.groups:
            codec = PageCodec(spec, g, cap.chunk_tokens)
            job = cache.job(g, set_keys[g.index])
            keys = planner.piece_keys(job.key, g.index)
            pages = backend.get_batch([keys[p] for p in codec.read])
            for shard, data in zip(codec.read, pages, strict=True):
                assert data is not None, f"group {g.index} shard {shard} missing"
                _, payload = decode_page(data, codec.header(job, shard))
                codec.scatter(cache.layouts[g.index], job, shard,
                              torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            for i, (layer, full) in enumerate(zip(g.layer_names, cap.tensors[g.index], strict=True)):
                want = vllm_view(cap, g, full, t, r)
                got = cache.get(g, layer, want)
                assert _bits(got) == _bits(want), f"TP={t} rank {r} group {g.index} layer {layer}"
                _reassemble(rebuilt, (g.index, i), cap, g, full, got, t, r)
    for (g_index, i), full in rebuilt.items():
        assert _bits(full) == _bits(cap.tensors[g_index][i])


def _reassemble(rebuilt: dict, where: tuple[int, int], cap: Captured, group: GroupSpec,
                full: Any, got: Any, t: int, r: int) -> None:
    if group.is_attention:
        out = rebuilt.setdefault(where, torch.full_like(full, float("nan")))
        out[:, :, _kv_heads(cap, group, t, r)] = got
        return
    conv, ssm = rebuilt.setdefault(where, [torch.full_like(full[0], float("nan")),
                                           torch.full_like(full[1], float("nan"))])
    conv[:, rules.conv_channels(_dims(group), t, r)] = got[0]
    ssm[rules.ssm_heads(ssm.shape[0], t, r)] = got[1]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_pages_written_at_one_tp_size_load_at_every_other(arch: str, model_dir, tmp_path: Path) -> None:
    cap = capture(model_dir(arch, hidden=ARCHS[arch]), tmp_path / "tp1-run")
    fingerprints = {rank_spec(cap, t, r).fingerprint for t in TP_SIZES for r in range(t)}
    assert len(fingerprints) == 1, "the TP size is not part of the fingerprint"
    spec = rank_spec(cap, 1, 0)
    assert any(g.shards > 1 for g in spec.groups), [g.shards for g in spec.groups]
    for t1 in TP_SIZES:
        config = BackendConfig("disk", f"tp{t1}", 1 << 30, options={"path": str(tmp_path / f"tp{t1}")})
        with create_backend(config) as backend:
            set_keys = write(cap, t1, backend)
            # a complete set, each shard written once (replicated ranks do not write twice)
            stored = sorted(p.name for p in (tmp_path / f"tp{t1}").rglob("*.page"))
            assert len(stored) == sum(g.shards for g in spec.groups)
            for t2 in TP_SIZES:
                read_and_check(cap, t2, backend, set_keys)
