"""Layer parts (issue 32): page sets split by decoder layer, readable at any PP layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybrid_offload.core.layer_parts import (
    MAX_PROBED_PP,
        LayerGrid,
    LayerPartError,
    ModelLayers,
    candidate_layouts,
    decoder_index,
    decoder_layer,
    layers_digest,
    layout_bounds,
    stage_layers,
)
from hybrid_offload.core.planner import HybridOffloadPlanner, LayerMapError, whole_model_layers
from hybrid_offload.core.spec import GroupKind, GroupSpec, make_model_spec
from hybrid_offload.engine.translate import layer_grid


def test_stage_layers_are_vllms_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.utils import get_pp_indices

    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    for layers in range(1, 65):
        for pp in range(1, min(layers, 8) + 1):
            ours = stage_layers(layers, pp)
            assert ours == [get_pp_indices(layers, rank, pp) for rank in range(pp)], (layers, pp)
    with pytest.raises(LayerPartError, match="cannot be split"):
        stage_layers(2, 3)


def test_an_engine_writes_its_stages_and_readers_look_for_every_default_partition() -> None:
    assert layout_bounds(48, stage_layers(48, 1)) == (0, 48)
    assert layout_bounds(48, stage_layers(48, 2)) == (0, 24, 48)
    assert layout_bounds(48, stage_layers(48, 1), 4) == (0, 12, 24, 36, 48)
    assert layout_bounds(10, [(0, 3), (3, 10)]) == (0, 3, 10)  # VLLM_PP_LAYER_PARTITION=3,7
    layouts = candidate_layouts(8, (0, 4, 8))
    assert layouts[:3] == [(0, 4, 8), (0, 8), (0, 3, 6, 8)]  # own first, then whole, PP=3, ...
    assert len(layouts) == len(set(layouts)) == MAX_PROBED_PP  # PP=2's is the own one
    assert candidate_layouts(2, (0, 2)) == [(0, 2), (0, 1, 2)]


# ---- keys of page sets split into layer parts (core/planner.py) -----------------------------
def _attention(names: list[str], heads: int = 2) -> GroupSpec:
    return GroupSpec(index=0, kind=GroupKind.FULL_ATTENTION, block_size=16, layer_names=tuple(names),
                     page_bytes=4096, num_kv_heads=heads, head_size=8, head_size_v=8, shards=2)  # fmt: skip


def _mamba(names: list[str]) -> GroupSpec:
    return GroupSpec(index=1, kind=GroupKind.MAMBA, block_size=16, layer_names=tuple(names), page_bytes=4096,
                     state_shapes=((3, 8),), state_dtypes=("float32",), mamba_cache_mode="align")  # fmt: skip


#: 8 decoder layers: attention at 3 and 7, Mamba at the others
ATTENTION = [f"model.layers.{i}.attn" for i in (3, 7)]
MAMBA = [f"model.layers.{i}.mixer" for i in (0, 1, 2, 4, 5, 6)]
PP1, PP2 = LayerGrid(8), LayerGrid(8, (0, 4, 8))
MODEL = ModelLayers(8, (tuple(ATTENTION), tuple(MAMBA)))


def _planner(attention: list[str], mamba: list[str], pp_rank: int = 0, pp_size: int = 1,
             grid: LayerGrid = PP1) -> HybridOffloadPlanner:  # fmt: skip
    spec = make_model_spec((_attention(attention), _mamba(mamba)), {"name": "m"}, grid=grid,
                           pp_rank=pp_rank, pp_size=pp_size)  # fmt: skip
    return HybridOffloadPlanner(spec, 16)


def test_decoder_layers_and_the_ranges_a_groups_layers_fall_in() -> None:
    assert decoder_index("model.layers.17.self_attn.attn") == 17
    for bad in ("model.embed", "model.layers.1.experts.3"):
        with pytest.raises(LayerPartError, match="decoder layer index"):
            decoder_index(bad)
    assert PP2.parts == 2 and PP1.parts == 1 and PP1.layout == (0, 8)
    assert PP2.ranges(MAMBA) == {(0, 4): (0, 1, 2), (4, 8): (3, 4, 5)}
    assert PP2.ranges(ATTENTION[1:]) == {(4, 8): (0,)}
    assert PP2.ranges([]) == {} and PP1.ranges([]) == {}
    assert PP1.ranges(["any.name", "other"]) == {(0, 8): (0, 1)}  # the whole model: no index needed
    assert MODEL.names(1, (4, 8)) == tuple(MAMBA[3:]) and MODEL.names(0, (0, 3)) == ()
    assert MODEL.ranges(0, (0, 2, 5, 8)) == {(2, 5): (0,), (5, 8): (1,)}
    with pytest.raises(LayerPartError, match="do not carry"):
        ModelLayers(8, MODEL.groups, indexed=False).ranges(0, (0, 4, 8))


def test_falcon_h1s_ssm_branch_counts_as_its_decoder_layer() -> None:
    """vLLM names Falcon-H1's SSM layer of decoder layer i ``model.<num_layers + i>.mixer``."""
    grid = LayerGrid(4, (0, 2, 4))
    ssm = [f"model.{4 + i}.mixer" for i in range(4)]
    assert grid.ranges(ssm) == {(0, 2): (0, 1), (2, 4): (2, 3)}
    assert decoder_layer("model.5.mixer", 4) == 1
    with pytest.raises(LayerPartError, match="outside"):
        grid.ranges(["model.8.mixer"])


def test_every_layout_keys_its_parts_alike_in_every_engine() -> None:
    """A PP=1 engine, a PP=2 scheduler (once the stages' layers arrive) and each PP=2 stage
    share a fingerprint and name every layout's pieces alike."""
    whole = _planner(ATTENTION, MAMBA)
    scheduler = _planner(ATTENTION[:1], MAMBA[:3], pp_size=2, grid=PP2)  # sees the first stage only
    stages = [_planner(ATTENTION[:1], MAMBA[:3], 0, 2, PP2), _planner(ATTENTION[1:], MAMBA[3:], 1, 2, PP2)]
    assert whole.namespace == scheduler.namespace == stages[0].namespace == stages[1].namespace
    assert whole.whole_model and not scheduler.whole_model
    stage_groups = {0: (ATTENTION[:1], MAMBA[:3]), 1: (ATTENTION[1:], MAMBA[3:])}
    scheduler.set_model_layers(whole_model_layers(scheduler.spec, stage_groups), list(stage_groups.values()))
    assert scheduler.whole_model and scheduler.model == MODEL
    set_key = whole.page_key(bytes(32), 0)
    for g, n in ((0, 4), (1, 2)):  # 2 parts x 2 (attention) or 1 shards
        assert len(scheduler.pieces(g)) == n and len(whole.pieces(g)) == n // 2
        assert scheduler.piece_keys(set_key, g) == whole.piece_keys(set_key, g, PP2.layout)
        assert whole.piece_keys(set_key, g) == scheduler.piece_keys(set_key, g, PP1.layout)
        assert not set(whole.piece_keys(set_key, g)) & set(scheduler.piece_keys(set_key, g))
        assert len(set(scheduler.piece_keys(set_key, g))) == n
    assert [scheduler.writers(g) for g in (0, 1)] == [2, 2]  # the one TP rank of each stage
    # other layer names in a part (another vLLM grouping, e.g. a drafter's layer): other keys
    other = _planner(ATTENTION, [m.replace("mixer", "mamba") for m in MAMBA])
    assert other.namespace == whole.namespace
    for layout in (PP1.layout, PP2.layout):
        assert other.piece_keys(set_key, 1, layout) != whole.piece_keys(set_key, 1, layout)


def test_stage_layers_that_do_not_make_up_the_model_are_refused() -> None:
    scheduler = _planner(ATTENTION[:1], MAMBA[:3], pp_size=2, grid=PP2)
    for stages, error in [
        ({0: (ATTENTION[:1], MAMBA[:3])}, "stages"),
        ({0: (ATTENTION[:1], MAMBA[:3]), 1: (ATTENTION[1:],)}, "groups"),
    ]:
        with pytest.raises(LayerMapError, match=error):
            whole_model_layers(scheduler.spec, stages)
    with pytest.raises(LayerMapError, match="outside"):
        scheduler.set_model_layers(ModelLayers(8, (("model.layers.17.attn",), tuple(MAMBA))))
    assert not scheduler.whole_model


def _stores(planner: HybridOffloadPlanner, sets: list[tuple[str, int]], layout: tuple[int, ...],
            drop: int | None = None) -> set[str]:  # fmt: skip
    """The pieces of ``sets`` in ``layout``, but for the last piece of set ``drop``."""
    pieces = [planner.piece_keys(key, g, layout) for key, g in sets]
    return {k for i, p in enumerate(pieces) for k in (p[:-1] if i == drop else p)}


def test_a_set_loads_from_any_layout_whose_parts_are_all_there_and_prefers_its_own() -> None:
    pp2 = _planner(ATTENTION[:1], MAMBA[:3], pp_size=2, grid=PP2)
    pp2.set_model_layers(MODEL)
    keys = [[pp2.page_key(bytes([c]) * 32, g) for c in range(4)] for g in (0, 1)]
    sets = [(k, g) for g in (0, 1) for k in keys[g]]
    calls: list[int] = []
    stored: set[str] = set()

    def contains(batch: list[str]) -> list[bool]:
        calls.append(len(batch))
        return [k in stored for k in batch]

    def ask() -> tuple[list[bool], dict[str, tuple[int, ...]]]:
        chosen: dict[str, tuple[int, ...]] = {}
        calls.clear()
        return pp2.sets_contain(keys, contains, chosen)([k for k, _ in sets]), chosen

    assert ask() == ([False] * 8, {}) and len(calls) == 2  # a cold miss: one small probe more
    # the first piece of the first attention set and of every Mamba set (up to 4) in each layout
    assert calls[1] == (1 + 4) * len(pp2.layouts[1:])
    stored |= _stores(pp2, sets, PP1.layout)  # a PP=1 engine wrote every set
    answers, chosen = ask()
    assert answers == [True] * 8 and set(chosen.values()) == {PP1.layout} and len(calls) == 3
    stored |= _stores(pp2, sets[:4], PP2.layout)  # its own layout wrote the attention sets
    answers, chosen = ask()
    assert answers == [True] * 8 and set(chosen) == {k for k, _ in sets[4:]}
    stored = (_stores(pp2, sets[:5] + sets[6:], PP2.layout, drop=4)
              | _stores(pp2, sets[4:6], (0, 3, 6, 8), drop=0))  # fmt: skip
    answers, chosen = ask()  # set 5: PP=3's parts; set 4 neither layout has whole: a miss
    assert answers == [True] * 4 + [False, True, True, True] and chosen == {sets[5][0]: (0, 3, 6, 8)}


def _engine(pp_size: int, layers: int = 8, arch: str = "NemotronHForCausalLM") -> SimpleNamespace:
    hf = SimpleNamespace(architectures=[arch])
    model = SimpleNamespace(get_total_num_hidden_layers=lambda: layers, hf_config=hf)
    parallel = SimpleNamespace(pipeline_parallel_size=pp_size)
    return SimpleNamespace(parallel_config=parallel, model_config=model)


def test_an_engine_writes_its_own_stages_whatever_their_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    assert layer_grid(_engine(1), None) == LayerGrid(8)
    assert layer_grid(_engine(2), None) == PP2
    assert layer_grid(_engine(1), 4).bounds == (0, 2, 4, 6, 8)
    assert layer_grid(_engine(4), 2).bounds == (0, 2, 4, 6, 8)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,5")
    assert layer_grid(_engine(2), None).bounds == (0, 3, 8)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION")
    assert layer_grid(_engine(1, arch="Zamba2ForCausalLM"), None) == LayerGrid(8, (), indexed=False)
    with pytest.raises(LayerPartError, match="Zamba2ForCausalLM names its KV layers without"):
        layer_grid(_engine(1, arch="Zamba2ForCausalLM"), 2)


# ---- a stage reading another layout's parts (connector/worker/page_codec.py) -----------------
def test_a_stage_reads_its_own_layers_out_of_wider_parts_and_refuses_what_it_cannot_place() -> None:
    from hybrid_offload.connector.worker.page_codec import PageCodec

    stage1 = _planner(ATTENTION[1:], MAMBA[3:], 1, 2, PP2).spec
    codec = PageCodec(stage1, stage1.groups[1], 16)  # Mamba layers 4, 5, 6 of 0-2, 4-6
    (own,) = codec.read
    assert (own.start, own.end, codec.offsets[own]) == (4, 8, 0)
    per_layer = codec.page_lens[own] - codec.header_lens[own]
    (whole,) = codec.foreign((0, 8), MODEL)  # a PP=1 engine's page: all six layers
    assert (whole.start, whole.end, whole.digest) == (0, 8, layers_digest(MAMBA))
    assert codec.held[whole] == (0, 1, 2) and codec.offsets[whole] == per_layer  # after layers 0-2
    assert codec.page_lens[whole] - codec.header_lens[whole] == 2 * per_layer
    pp4 = codec.foreign((0, 2, 4, 6, 8), MODEL)  # layers 4-5 and 6: two pages, each read whole
    assert [(p.start, p.end, codec.held[p], codec.offsets[p]) for p in pp4] == [
        (4, 6, (0, 1), 0), (6, 8, (2,), 0)]  # fmt: skip
    other = ModelLayers(8, (tuple(ATTENTION), tuple(MAMBA[:5])))  # not this stage's layers
    with pytest.raises(LayerPartError, match="every layer of this stage"):
        codec.foreign((0, 8), other)


def test_layer_names_no_layout_can_place_leave_the_engine_its_own_layout() -> None:
    """A PP=1 engine whose names do not tell decoder layers (a drafter's layer past the model)
    keeps its one part and looks for no other layout, rather than failing."""
    planner = _planner([*ATTENTION, "model.layers.20.attn"], MAMBA)
    assert planner.whole_model and planner.layouts == [PP1.layout]
