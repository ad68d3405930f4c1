"""Issues 7 and 17: page sets written at one PP x TP layout load bit-identically at another.

For each hybrid arch, a real TP=1 engine stores its pages on disk with one shard per page set:
that gives the model's real per-layer KV and Mamba/GDN state tensors (the conv state's x, B, C
or q, k, v parts concatenated back in vLLM's channel order). vLLM's own sharding code
(``vllm_tp_rules``: its QKV, Mamba2/GDN conv1d and head weight loaders, its state shape
calculator) cuts them into the rank views of TP=2 and TP=4, and vLLM's own stage partition
(``get_pp_indices``) gives each pipeline stage its layers. Each worker's view is put into a KV
cache laid out as vLLM's, and the connector's codec writes it as layout (PP, TP) = L1 into a
real disk tier (page sets of two layer parts); every worker of L2 then reads its pieces into an
empty cache. For all pairs of PP in {1, 2} x TP in {1, 2, 4} (PP=1 only for zamba2, which vLLM
does not run pipeline parallel): every worker holds exactly vLLM's view, bit for bit, and the
workers reassemble the original tensors. Engines here run PP=2 with TP=2 at most (four
workers on two cores, test_pp_pages_e2e.py): this is the test of TP=4 with PP=2.
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
from vllm.distributed.utils import get_pp_indices

from hybrid_offload.backends.base import BackendConfig
from hybrid_offload.backends.registry import create_backend
from hybrid_offload.connector.metadata import PageJob
from hybrid_offload.connector.worker.page_codec import PageCodec
from hybrid_offload.core.layer_parts import LayerGrid, ModelLayers, decoder_layer, layout_bounds, stage_layers
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
#: archs vLLM runs pipeline parallel
PP_ARCHS = {"qwen3_next", "falcon_h1", "nemotron_h", "granite_hybrid"}
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


def num_layers(cap: Captured) -> int:
    """The decoder layers (nemotron_h's config.json has only its pattern)."""
    return cap.hf.get("num_hidden_layers") or len(cap.hf["layers_block_type"])


def grid(cap: Captured, pp: int) -> LayerGrid:
    """The layout a PP=``pp`` engine writes: its stages."""
    layers = num_layers(cap)
    return LayerGrid(layers, layout_bounds(layers, stage_layers(layers, pp)) if pp > 1 else ())


def model_layers(cap: Captured) -> ModelLayers:
    return ModelLayers(num_layers(cap), tuple(g.layer_names for g in cap.groups))


def stage_positions(cap: Captured, group: GroupSpec, pp: int, stage: int) -> list[int]:
    """Positions in ``group`` of the layers vLLM puts on pipeline stage ``stage`` of ``pp``."""
    if pp == 1:
        return list(range(len(group.layer_names)))
    start, end = get_pp_indices(num_layers(cap), stage, pp)
    layers = num_layers(cap)
    return [i for i, name in enumerate(group.layer_names) if start <= decoder_layer(name, layers) < end]


def rank_spec(cap: Captured, t: int, r: int, pp: int = 1, stage: int = 0) -> ModelSpec:
    """What the connector builds on rank ``r`` of a TP=``t`` engine, pipeline stage ``stage`` of
    ``pp`` (shapes from vLLM; the stage's layers of each group)."""
    n_groups = next((cap.hf[k] for k in _N_GROUPS_KEYS if k in cap.hf), None)
    groups = []
    for whole in cap.groups:
        names = tuple(whole.layer_names[i] for i in stage_positions(cap, whole, pp, stage))
        g = dataclasses.replace(whole, layer_names=names)
        if g.is_attention:
            groups.append(dataclasses.replace(g, num_kv_heads=max(1, g.num_kv_heads // t),
                                              total_kv_heads=g.num_kv_heads, shards=1))
            continue
        shapes = rules.state_shapes(_dims(g), t)
        assert t > 1 or shapes == g.state_shapes, "vLLM's TP=1 shapes are the captured ones"
        splits = mamba_splits(g.mamba_type, shapes, ModelShape(t, 0, n_groups))
        groups.append(dataclasses.replace(g, state_shapes=shapes, state_splits=splits, shards=1))
    return make_model_spec(tuple(groups), FIELDS, tp_size=t, tp_rank=r, max_shards=MAX_SHARDS,
                           grid=grid(cap, pp), pp_rank=stage, pp_size=pp)  # fmt: skip


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


# ---- write at layout L1, read at L2 --------------------------------------------------------------
def workers(layout: tuple[int, int]) -> list[tuple[int, int]]:
    """(stage, rank) of every worker of a (PP, TP) layout."""
    pp, t = layout
    return [(stage, r) for stage in range(pp) for r in range(t)]


def write(cap: Captured, layout: tuple[int, int], backend: Any) -> dict[int, str]:
    """Every worker of ``layout`` writes its pieces; returns each group's page-set key."""
    set_keys: dict[int, str] = {}
    pp, t = layout
    for stage, r in workers(layout):
        spec = rank_spec(cap, t, r, pp, stage)
        planner = HybridOffloadPlanner(spec, cap.chunk_tokens)
        cache = RankCache(spec, cap.chunk_tokens)
        items = []
        for g, whole in zip(spec.groups, cap.groups, strict=True):
            set_keys[g.index] = planner.page_key(bytes(32), g.index)
            for layer, i in zip(g.layer_names, stage_positions(cap, whole, pp, stage), strict=True):
                cache.put(g, layer, vllm_view(cap, g, cap.tensors[g.index][i], t, r))
            codec = PageCodec(spec, g, cap.chunk_tokens)
            job = cache.job(g, set_keys[g.index])
            for piece in codec.written:
                buf = bytearray(codec.page_lens[piece])
                payload = torch.frombuffer(buf, dtype=torch.uint8)[codec.header_lens[piece] :]
                codec.gather(cache.layouts[g.index], job, piece, payload)
                seal_page(buf, codec.header(job, piece))
                items.append((planner.piece_key(job.key, g.index, piece), buf))
        assert all(backend.put_batch(items))
    return set_keys


def read_and_check(cap: Captured, layout: tuple[int, int], backend: Any, set_keys: dict[int, str],
                   written: tuple[int, ...]) -> None:  # fmt: skip
    """Every worker of ``layout`` reads its pieces of the pages written in layer-part layout
    ``written`` into an empty cache: vLLM's view, bit for bit; the workers together reassemble
    the full tensors."""
    rebuilt: dict[tuple[int, int], Any] = {}
    pp, t = layout
    for stage, r in workers(layout):
        spec = rank_spec(cap, t, r, pp, stage)
        planner = HybridOffloadPlanner(spec, cap.chunk_tokens)
        cache = RankCache(spec, cap.chunk_tokens)
        for g, whole in zip(spec.groups, cap.groups, strict=True):
            codec = PageCodec(spec, g, cap.chunk_tokens)
            job = cache.job(g, set_keys[g.index])
            read = codec.read if written == spec.grid.layout else codec.foreign(written, model_layers(cap))
            pages = backend.get_batch([planner.piece_key(job.key, g.index, p) for p in read])
            for piece, data in zip(read, pages, strict=True):
                assert data is not None, f"group {g.index} piece {piece} missing"
                _, payload = decode_page(data, codec.header(job, piece))
                codec.scatter(cache.layouts[g.index], job, piece,
                              torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            for layer, i in zip(g.layer_names, stage_positions(cap, whole, pp, stage), strict=True):
                full = cap.tensors[g.index][i]
                want = vllm_view(cap, g, full, t, r)
                got = cache.get(g, layer, want)
                assert _bits(got) == _bits(want), f"{layout}: stage {stage} rank {r}, {layer}"
                _reassemble(rebuilt, (g.index, i), cap, g, full, got, t, r)
    assert sorted(rebuilt) == sorted((g.index, i) for g in cap.groups for i in range(len(g.layer_names)))
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
def test_pages_written_at_one_pp_x_tp_layout_load_at_every_other(
    arch: str, model_dir, tmp_path: Path
) -> None:
    pp_sizes = (1, 2) if arch in PP_ARCHS else (1,)
    cap = capture(model_dir(arch, hidden=ARCHS[arch]), tmp_path / "tp1-run")
    layouts = [(pp, t) for pp in pp_sizes for t in TP_SIZES]
    fingerprints = {rank_spec(cap, t, r, pp, stage).fingerprint for pp, t in layouts
                    for stage, r in workers((pp, t))}  # fmt: skip
    assert len(fingerprints) == 1, "neither the TP nor the PP size is part of the fingerprint"
    whole = HybridOffloadPlanner(rank_spec(cap, 1, 0), cap.chunk_tokens)
    assert any(g.shards > 1 for g in whole.spec.groups), [g.shards for g in whole.spec.groups]
    written = {pp: grid(cap, pp).layout for pp in pp_sizes}
    widest = written[max(pp_sizes)]
    parts = {(p.start, p.end) for g in whole.spec.groups for p in whole.pieces(g.index, widest)}
    assert len(parts) == len(pp_sizes), "pages of two layer parts at PP=2 (PP archs)"
    for layout in layouts:
        path = tmp_path / f"pp{layout[0]}-tp{layout[1]}"
        config = BackendConfig("disk", path.name, 1 << 30, options={"path": str(path)})
        with create_backend(config) as backend:
            set_keys = write(cap, layout, backend)
            # a complete set, each piece written once (replicated ranks do not write twice)
            stored = sorted(p.name for p in path.rglob("*.page"))
            pieces = [whole.pieces(g.index, written[layout[0]]) for g in whole.spec.groups]
            assert len(stored) == sum(map(len, pieces))
            for other in layouts:
                read_and_check(cap, other, backend, set_keys, written[layout[0]])
