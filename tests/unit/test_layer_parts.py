"""Layer parts (issue 17's plan for pipeline-parallel page sets), against vLLM's own partition."""

from __future__ import annotations

import pytest

from hybrid_offload.core.layer_parts import (
    LayerPartError,
    group_parts,
    part_bounds,
    stage_layers,
    stage_parts,
)


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
