"""Layer parts (issue 17's plan for pipeline-parallel page sets), against vLLM's own partition."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybrid_offload.core.layer_parts import (
    WHOLE_MODEL,
    LayerGrid,
    LayerPartError,
    decoder_index,
    group_parts,
    layers_digest,
    part_bounds,
    stage_layers,
    stage_parts,
)
from hybrid_offload.core.planner import HybridOffloadPlanner, LayerMapError
from hybrid_offload.core.spec import GroupKind, GroupSpec, make_model_spec
from hybrid_offload.engine.translate import layer_grid


def test_stage_layers_are_vllms_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.utils import get_pp_indices

    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    for layers in range(1, 65):
        for pp in range(1, min(layers, 8) + 1):
            ours = stage_layers(layers, pp)
            assert ours == [get_pp_indices(layers, rank, pp) for rank in range(pp)], (layers, pp)


@pytest.mark.parametrize("layer_parts", [1, 2, 4, 8])
def test_every_stage_at_every_pp_size_dividing_the_parts_holds_whole_parts(layer_parts: int) -> None:
    for layers in range(1, 97):
        bounds = part_bounds(layers, layer_parts)
        assert bounds[0] == 0 and bounds[-1] == layers and bounds == sorted(set(bounds))
        for pp in (p for p in range(1, layer_parts + 1) if layer_parts % p == 0 and p <= layers):
            held = [stage_parts(bounds, start, end, f"PP={pp}") for start, end in stage_layers(layers, pp)]
            assert [i for r in held for i in r] == list(range(len(bounds) - 1))  # each part once


def test_the_default_grid_of_an_even_model_is_four_equal_parts() -> None:
    assert part_bounds(48, 4) == [0, 12, 24, 36, 48]
    assert part_bounds(8, 4) == [0, 2, 4, 6, 8]
    assert part_bounds(2, 4) == [0, 1, 2]  # PP=4 cannot split 2 layers: the grid of PP 1 and 2


def test_a_partition_off_the_grid_is_refused_naming_the_setting() -> None:
    bounds = part_bounds(8, 4)
    with pytest.raises(LayerPartError, match=r"VLLM_PP_LAYER_PARTITION=3,5: layers \[0, 3\)"):
        stage_parts(bounds, 0, 3, "VLLM_PP_LAYER_PARTITION=3,5")
    with pytest.raises(LayerPartError, match="pipeline_parallel_size=3"):
        [stage_parts(bounds, s, e, "pipeline_parallel_size=3") for s, e in stage_layers(8, 3)]
    with pytest.raises(LayerPartError, match="cannot be split"):
        stage_layers(2, 3)


def test_a_group_without_layers_in_a_part_has_nothing_there() -> None:
    """nemotron_h-like: attention only in the last layers; Mamba everywhere else."""
    bounds = part_bounds(8, 2)  # [0, 4, 8]
    attention = [6, 7]
    mamba = [0, 1, 2, 3, 4, 5]
    assert group_parts(bounds, attention) == [[], [0, 1]]
    assert group_parts(bounds, mamba) == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(LayerPartError, match="outside"):
        group_parts(bounds, [8])


# ---- keys of page sets split into layer parts (core/planner.py) -----------------------------
def _attention(names: list[str], heads: int = 2) -> GroupSpec:
    return GroupSpec(index=0, kind=GroupKind.FULL_ATTENTION, block_size=16, layer_names=tuple(names),
                     page_bytes=4096, num_kv_heads=heads, head_size=8, head_size_v=8, shards=2)  # fmt: skip


def _mamba(names: list[str]) -> GroupSpec:
    return GroupSpec(index=1, kind=GroupKind.MAMBA, block_size=16, layer_names=tuple(names), page_bytes=4096,
                     state_shapes=((3, 8),), state_dtypes=("float32",), mamba_cache_mode="align")  # fmt: skip


#: 8 decoder layers: attention at 3 and 7, Mamba at the others; layer_parts 2 -> parts [0, 4), [4, 8)
ATTENTION = [f"model.layers.{i}.attn" for i in (3, 7)]
MAMBA = [f"model.layers.{i}.mixer" for i in (0, 1, 2, 4, 5, 6)]
GRID = LayerGrid.of(8, 2)


def _planner(attention: list[str], mamba: list[str], pp_rank: int = 0, pp_size: int = 1,
             grid: LayerGrid = GRID) -> HybridOffloadPlanner:  # fmt: skip
    spec = make_model_spec((_attention(attention), _mamba(mamba)), {"name": "m"}, grid=grid,
                           pp_rank=pp_rank, pp_size=pp_size)  # fmt: skip
    return HybridOffloadPlanner(spec, 16)


def test_decoder_index_and_the_parts_a_groups_layers_fall_in() -> None:
    assert decoder_index("model.layers.17.self_attn.attn") == 17
    for bad in ("model.embed", "model.layers.1.experts.3"):
        with pytest.raises(LayerPartError, match="decoder layer index"):
            decoder_index(bad)
    assert GRID.parts == 2 and WHOLE_MODEL.parts == 1
    assert GRID.positions(MAMBA) == {0: (0, 1, 2), 1: (3, 4, 5)}
    assert GRID.positions(ATTENTION[1:]) == {1: (0,)}
    assert GRID.positions([]) == {} and WHOLE_MODEL.positions([]) == {}
    assert WHOLE_MODEL.positions(["any.name", "other"]) == {0: (0, 1)}  # no index needed
    assert WHOLE_MODEL.digests(MAMBA) == {0: bytes(16)}  # the fingerprint names the layers
    digests = GRID.digests(MAMBA)
    assert digests[0] == layers_digest(MAMBA[:3]) != digests[1] == layers_digest(MAMBA[3:])


def test_a_pp2_scheduler_keys_every_stages_parts_once_their_layers_arrive() -> None:
    whole = _planner(ATTENTION, MAMBA)
    scheduler = _planner(ATTENTION[:1], MAMBA[:3], pp_size=2)  # sees the first stage only
    stages = [_planner(ATTENTION[:1], MAMBA[:3], 0, 2), _planner(ATTENTION[1:], MAMBA[3:], 1, 2)]
    assert whole.namespace == scheduler.namespace == stages[0].namespace == stages[1].namespace
    assert whole.whole_model and not scheduler.whole_model
    set_key = whole.page_key(bytes(32), 0)
    scheduler.set_stage_layers({0: (ATTENTION[:1], MAMBA[:3]), 1: (ATTENTION[1:], MAMBA[3:])})
    assert scheduler.whole_model
    for g, pieces in ((0, [0, 1, 2, 3]), (1, [0, 1])):  # 2 parts x 2 (attention) or 1 shards
        assert scheduler.pieces(g) == whole.pieces(g) == pieces
        assert scheduler.piece_keys(set_key, g) == whole.piece_keys(set_key, g)
        assert len(set(whole.piece_keys(set_key, g))) == len(pieces)
        # each stage keys its own part's pieces as the whole model does
        for stage in stages:
            for piece in stage.pieces(g):
                assert stage.piece_key(set_key, g, piece) in whole.piece_keys(set_key, g)
    assert [scheduler.writers(g) for g in (0, 1)] == [2, 2]  # the one TP rank of each stage
    # a PP=1 engine without the grid keys its sets differently (and names layers in its fingerprint)
    assert _planner(ATTENTION, MAMBA, grid=WHOLE_MODEL).namespace != whole.namespace


def test_stage_layers_that_do_not_make_up_the_model_are_refused() -> None:
    scheduler = _planner(ATTENTION[:1], MAMBA[:3], pp_size=2)
    for stages, error in [
        ({0: (ATTENTION[:1], MAMBA[:3])}, "stages"),
        ({0: (ATTENTION[:1], MAMBA[:3]), 1: (ATTENTION[1:],)}, "groups"),
        ({0: (ATTENTION[:1], MAMBA[:3]), 1: (ATTENTION[1:], MAMBA[2:])}, "span stages"),
    ]:
        with pytest.raises(LayerMapError, match=error):
            scheduler.set_stage_layers(stages)
        assert not scheduler.whole_model


def test_a_set_is_present_only_with_every_part() -> None:
    whole = _planner(ATTENTION, MAMBA)
    keys = [[whole.page_key(bytes(32), g)] for g in (0, 1)]
    stored = set(whole.piece_keys(keys[0][0], 0)) | set(whole.piece_keys(keys[1][0], 1)[:1])  # part 0 only
    answers = whole.sets_contain(keys, lambda batch: [k in stored for k in batch])
    assert answers([keys[0][0], keys[1][0]]) == [True, False]


def test_falcon_h1s_ssm_branch_counts_as_its_decoder_layer() -> None:
    """vLLM names Falcon-H1's SSM layer of decoder layer i ``model.<num_layers + i>.mixer``."""
    grid = LayerGrid.of(4, 2)
    ssm = [f"model.{4 + i}.mixer" for i in range(4)]
    assert grid.positions(ssm) == {0: (0, 1), 1: (2, 3)}
    with pytest.raises(LayerPartError, match="outside"):
        grid.positions(["model.8.mixer"])


def _engine(pp_size: int, layers: int = 8) -> SimpleNamespace:
    model = SimpleNamespace(get_total_num_hidden_layers=lambda: layers)
    parallel = SimpleNamespace(pipeline_parallel_size=pp_size)
    return SimpleNamespace(parallel_config=parallel, model_config=model)


def test_an_engine_whose_stages_would_split_a_part_is_refused_naming_the_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    assert layer_grid(_engine(1), None) is WHOLE_MODEL
    assert layer_grid(_engine(2), None).bounds == (0, 4, 8)  # layer_parts: the PP size
    assert layer_grid(_engine(1), 4).bounds == (0, 2, 4, 6, 8)
    for pp, parts, match in [(2, 1, "layer_parts=1 with pipeline_parallel_size=2"),
                             (4, 2, "layer_parts=2 with pipeline_parallel_size=4")]:  # fmt: skip
        with pytest.raises(LayerPartError, match=match):
            layer_grid(_engine(pp), parts)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,5")
    with pytest.raises(LayerPartError, match="VLLM_PP_LAYER_PARTITION=3,5"):
        layer_grid(_engine(2), 2)
