"""Pipeline-parallel-portable page sets: how a model's decoder layers split into layer parts.

Pure logic, no vLLM. Every (chunk, group) page set is split, besides TP shards, into *layer
parts* by decoder layer index (docs/design.md, "Pipeline parallelism"), so that a pipeline
stage writes and reads whole parts of its own layers and engines at different PP sizes share
pages. A part's pages are keyed by the names of the group's layers in it
(:func:`layers_digest`), so a part is only ever read by an engine that puts the same layers in
it.

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

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "WHOLE_MODEL",
    "LayerGrid",
    "LayerPartError",
    "decoder_index",
    "group_parts",
    "layers_digest",
    "part_bounds",
    "stage_layers",
    "stage_parts",
]

#: bytes of :func:`layers_digest`
LAYERS_DIGEST_LEN = 16


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


def decoder_index(layer_name: str) -> int:
    """The decoder layer index in a vLLM layer name (``model.layers.7.mixer`` -> 7): its one
    integer component, as vLLM's ``extract_layer_index`` reads it."""
    found = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(found) != 1:
        raise LayerPartError(f"layer {layer_name!r}: no single decoder layer index in its name")
    return found[0]


def layers_digest(names: Sequence[str]) -> bytes:
    """A part's layer identity in keys and page headers: sha256 of its layer names, in order."""
    return hashlib.sha256("\x00".join(names).encode()).digest()[:LAYERS_DIGEST_LEN]


@dataclass(frozen=True)
class LayerGrid:
    """The layer-part grid of a model: ``bounds`` from :func:`part_bounds`; ``()``: one part
    holding every layer (``layer_parts`` 1, where layer indices are never needed)."""

    bounds: tuple[int, ...] = ()

    @classmethod
    def of(cls, num_layers: int, layer_parts: int) -> LayerGrid:
        return cls(() if layer_parts == 1 else tuple(part_bounds(num_layers, layer_parts)))

    @property
    def parts(self) -> int:
        return max(1, len(self.bounds) - 1)

    def positions(self, layer_names: Sequence[str]) -> dict[int, tuple[int, ...]]:
        """Per part holding some of ``layer_names`` (one group's layers, in its order), their
        positions in it; parts holding none are left out."""
        if not self.bounds:
            return {0: tuple(range(len(layer_names)))} if layer_names else {}
        per_part = group_parts(self.bounds, [self.decoder_layer(n) for n in layer_names])
        return {part: tuple(p) for part, p in enumerate(per_part) if p}

    def decoder_layer(self, layer_name: str) -> int:
        """The decoder layer holding a KV layer. vLLM names a second KV layer of decoder layer
        ``i`` (Falcon-H1's parallel SSM branch) ``num_layers + i``: layer indices must differ."""
        index, num_layers = decoder_index(layer_name), self.bounds[-1]
        return index - num_layers if num_layers <= index < 2 * num_layers else index

    def digests(self, layer_names: Sequence[str]) -> dict[int, bytes]:
        """Per part holding some of ``layer_names``, the :func:`layers_digest` of those names;
        zeros for the one part of a one-part grid (the fingerprint names every layer then)."""
        if not self.bounds:
            return {0: bytes(LAYERS_DIGEST_LEN)} if layer_names else {}
        return {part: layers_digest([layer_names[i] for i in pos])
                for part, pos in self.positions(layer_names).items()}  # fmt: skip


#: one part holding every layer (``layer_parts`` 1)
WHOLE_MODEL = LayerGrid()
