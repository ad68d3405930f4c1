"""Layer parts: page sets split by decoder layer, readable at any pipeline-parallel layout.

Pure logic, no vLLM. Every (chunk, group) page set is split, besides TP shards, into *layer
parts*: decoder-layer ranges ``[start, end)`` (docs/design.md, "Pipeline parallelism"). An
engine writes the parts of its own *layout* (:class:`LayerGrid`: its pipeline stages'
boundaries, by default; ``layer_parts`` adds vLLM's partition at that PP size), each stage the
parts of its layers. A part's page holds the group's layers in its range, in group order, and is
keyed by the range and a digest of those layers' names (:func:`layers_digest`): any engine that
knows the whole model's layers (:class:`ModelLayers`) can name the pages of any layout, and one
that puts other layers in a range (another vLLM grouping) names other keys.

A reader prefers its own layout and otherwise reads any candidate layout
(:func:`candidate_layouts`) whose parts are all present; a part spanning several of its stages
is read by each, which uses its own layers (a contiguous run of the part's).

* :func:`stage_layers` is vLLM's own partition of ``num_layers`` decoder layers over
  ``pp_size`` stages (``vllm.distributed.utils.get_pp_indices`` without
  ``VLLM_PP_LAYER_PARTITION``; tests compare the two).
* :func:`decoder_layer` reads the decoder layer of a KV layer from its name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "MAX_PROBED_PP",
    "WHOLE_MODEL",
    "LayerGrid",
    "LayerPartError",
    "ModelLayers",
    "candidate_layouts",
    "decoder_index",
    "decoder_layer",
    "layers_digest",
    "layout_bounds",
    "stage_layers",
]

#: bytes of :func:`layers_digest`
LAYERS_DIGEST_LEN = 16
#: readers look for the pages of vLLM's default partition at PP sizes 1 to this
MAX_PROBED_PP = 8

Range = tuple[int, int]


class LayerPartError(ValueError):
    """Layers that cannot be placed in layer parts."""


def stage_layers(num_layers: int, pp_size: int) -> list[Range]:
    """``[(start, end))`` of each stage, as vLLM partitions decoder layers by default: an even
    share each, the remainder one layer at a time to the stages before the last, last first."""
    if pp_size < 1 or num_layers < pp_size:
        raise LayerPartError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(pp_size)]
    return [(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def layout_bounds(
    num_layers: int, stages: Sequence[Range], layer_parts: int | None = None
) -> tuple[int, ...]:
    """The bounds ``(0, ..., num_layers)`` of an engine's layout: its stages' boundaries and,
    with ``layer_parts``, those of vLLM's default partition at PP size ``layer_parts``."""
    bounds = {0, num_layers, *(s for s, _ in stages)}
    if layer_parts is not None and layer_parts > 1:
        bounds.update(s for s, _ in stage_layers(num_layers, min(layer_parts, num_layers)))
    return tuple(sorted(bounds))


def candidate_layouts(num_layers: int, own: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Layouts a reader looks for, in order of preference: its own, the whole model in one
    part, then vLLM's default partition at PP sizes 2 to :data:`MAX_PROBED_PP`."""
    out = [own, (0, num_layers)]
    for pp in range(2, min(MAX_PROBED_PP, num_layers) + 1):
        out.append((*(s for s, _ in stage_layers(num_layers, pp)), num_layers))
    return list(dict.fromkeys(out))


def decoder_index(layer_name: str) -> int:
    """The one integer component of a vLLM layer name (``model.layers.7.mixer`` -> 7), as
    vLLM's ``extract_layer_index`` reads it."""
    found = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(found) != 1:
        raise LayerPartError(f"layer {layer_name!r}: no single decoder layer index in its name")
    return found[0]


def decoder_layer(layer_name: str, num_layers: int) -> int:
    """The decoder layer holding a KV layer. vLLM names a second KV layer of decoder layer
    ``i`` (Falcon-H1's parallel SSM branch) ``num_layers + i``: layer indices must differ."""
    index = decoder_index(layer_name)
    if num_layers <= index < 2 * num_layers:
        index -= num_layers
    if not 0 <= index < num_layers:
        raise LayerPartError(f"layer {layer_name!r} is outside the model's {num_layers} layers")
    return index


def layers_digest(names: Sequence[str]) -> bytes:
    """A part's layer identity in keys and page headers: sha256 of its layer names, in order."""
    return hashlib.sha256("\x00".join(names).encode()).digest()[:LAYERS_DIGEST_LEN]


@dataclass(frozen=True)
class LayerGrid:
    """The layout an engine writes: ``bounds`` ``(0, ..., num_layers)``; ``()`` one part, the
    whole model (``(0, num_layers)``), where layer names need no decoder index. ``indexed``:
    whether the model's layer names carry their decoder layer (Zamba2's do not)."""

    num_layers: int = 0
    bounds: tuple[int, ...] = ()
    indexed: bool = True

    @property
    def layout(self) -> tuple[int, ...]:
        return self.bounds or (0, self.num_layers)

    @property
    def parts(self) -> int:
        return len(self.layout) - 1

    def ranges(self, layer_names: Sequence[str]) -> dict[Range, tuple[int, ...]]:
        """Per range of this layout holding some of ``layer_names`` (one group's layers, in
        its order), their positions in it; ranges holding none are left out."""
        return ranges_of(self.layout, self.num_layers, layer_names)


def ranges_of(
    layout: Sequence[int], num_layers: int, layer_names: Sequence[str]
) -> dict[Range, tuple[int, ...]]:
    """Per range of ``layout`` holding some of ``layer_names``, their positions in it."""
    if not layer_names:
        return {}
    if len(layout) == 2:
        return {(layout[0], layout[1]): tuple(range(len(layer_names)))}
    out: dict[Range, list[int]] = {}
    for position, name in enumerate(layer_names):
        layer = decoder_layer(name, num_layers)
        i = max(i for i in range(len(layout) - 1) if layout[i] <= layer)
        out.setdefault((layout[i], layout[i + 1]), []).append(position)
    return {r: tuple(p) for r, p in sorted(out.items())}


#: one part holding every layer
WHOLE_MODEL = LayerGrid()


@dataclass(frozen=True)
class ModelLayers:
    """The whole model's layers per KV cache group (group order) and its decoder layer count:
    what names the pages of any layout. A pipeline stage knows its own layers only; the
    scheduler learns every stage's at start-up and tells the workers (docs/design.md)."""

    num_layers: int
    groups: tuple[tuple[str, ...], ...]
    indexed: bool = True
    _ranges: dict[tuple[int, tuple[int, ...]], dict[Range, tuple[int, ...]]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def ranges(self, group: int, layout: tuple[int, ...]) -> dict[Range, tuple[int, ...]]:
        """Per range of ``layout`` holding some of ``group``'s layers, their positions in the
        group (cached; a layout other than the whole model needs indexed names)."""
        known = self._ranges.get((group, layout))
        if known is None:
            if len(layout) > 2 and not self.indexed:
                raise LayerPartError("this model's layer names do not carry their decoder layers")
            known = self._ranges[(group, layout)] = ranges_of(layout, self.num_layers, self.groups[group])
        return known

    def names(self, group: int, span: Range) -> tuple[str, ...]:
        """The names of ``group``'s layers in the range ``span`` of a layout."""
        if span == (0, self.num_layers):
            return self.groups[group]
        layout = tuple(sorted({0, *span, self.num_layers}))
        for r, positions in self.ranges(group, layout).items():
            if r == span:
                return tuple(self.groups[group][p] for p in positions)
        return ()

    def layouts(self, own: tuple[int, ...]) -> list[tuple[int, ...]]:
        """:func:`candidate_layouts` this model's names can be placed in."""
        if not self.indexed:
            return [(0, self.num_layers)]
        return candidate_layouts(self.num_layers, own)
