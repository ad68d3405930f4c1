"""Pipeline-parallel-portable page sets: how a model's decoder layers split into layer parts.

Pure logic, no vLLM. The plan (docs/design.md, "Pipeline parallelism"; not wired into the
connector yet): every (chunk, group) page set is split, besides TP shards, into *layer parts*
by decoder layer index, so that a pipeline stage writes and reads whole parts of its own
layers and engines at different PP sizes share pages.

* :func:`stage_layers` is vLLM's own partition of ``num_layers`` decoder layers over
  ``pp_size`` stages (``vllm.distributed.utils.get_pp_indices`` without
  ``VLLM_PP_LAYER_PARTITION``; tests compare the two).
* :func:`part_bounds` is the grid: the union of the stage boundaries of every PP size that
  divides ``layer_parts``, so a stage at any of those sizes holds whole parts.
* :func:`stage_parts` gives the parts a stage holds, or raises :class:`LayerPartError` naming
  the partition when its boundaries are off the grid (a custom ``VLLM_PP_LAYER_PARTITION``, a
  PP size the grid was not made for): one clear start-up error rather than a silent miss.
* :func:`group_parts` gives, per part, the layers of one KV cache group in it: a part holding
  none of a group's layers (nemotron_h: a stage without attention) has no page in its sets.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["LayerPartError", "group_parts", "part_bounds", "stage_layers", "stage_parts"]


class LayerPartError(ValueError):
    """A layer partition that does not fall on the layer-part grid."""


def stage_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """``[(start, end))`` of each stage, as vLLM partitions decoder layers by default: an even
    share each, the remainder one layer at a time to the stages before the last, last first."""
    if pp_size < 1 or num_layers < pp_size:
        raise LayerPartError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(pp_size)]
    return [(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def part_bounds(num_layers: int, layer_parts: int) -> list[int]:
    """The grid: sorted layer indices where parts begin, and ``num_layers`` (the union of the
    stage boundaries of every PP size dividing ``layer_parts`` that the model can be split
    into)."""
    if layer_parts < 1:
        raise LayerPartError(f"layer_parts must be >= 1, got {layer_parts}")
    bounds = {0, num_layers}
    for pp in range(1, layer_parts + 1):
        if layer_parts % pp == 0 and pp <= num_layers:
            bounds.update(start for start, _ in stage_layers(num_layers, pp))
    return sorted(bounds)


def stage_parts(bounds: Sequence[int], start: int, end: int, what: str) -> range:
    """The parts a stage holding layers ``[start, end)`` holds; LayerPartError naming ``what``
    (the setting that made this partition) when either boundary is off the grid."""
    if start not in bounds or end not in bounds or start >= end:
        raise LayerPartError(
            f"{what}: layers [{start}, {end}) do not fall on the layer-part grid {list(bounds)}; "
            "pages could not be shared with other pipeline layouts"
        )
    return range(bounds.index(start), bounds.index(end))


def group_parts(bounds: Sequence[int], layer_indices: Sequence[int]) -> list[list[int]]:
    """Per part, the positions in ``layer_indices`` (one KV cache group's decoder layer
    indices) of the layers that fall in it."""
    parts: list[list[int]] = [[] for _ in range(len(bounds) - 1)]
    for position, layer in enumerate(layer_indices):
        if not bounds[0] <= layer < bounds[-1]:
            raise LayerPartError(f"layer {layer} is outside the model's {bounds[-1]} layers")
        part = max(i for i in range(len(bounds) - 1) if bounds[i] <= layer)
        parts[part].append(position)
    return parts
