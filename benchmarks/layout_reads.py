"""Bytes each pipeline stage reads when pages were written at another layout (issue 32), and
what a lookup asks for them.

Model: Qwen3-Next-80B's geometry (``hybrid_offload.testing.datapath.QWEN3_NEXT_80B``: 12
attention and 36 GDN layers, bf16, TP=1). For writer layouts PP=1, PP=1 with ``layer_parts:
2``, PP=2 and PP=4, and readers at PP=1, 2 and 4, each reader stage's worker codec
(``PageCodec``: its own pieces, or ``foreign`` for another layout's) gives the pieces it reads
of one chunk's page sets (every group: attention pages of one chunk, the default for this geometry, and one
state page per GDN group, as a load at a boundary reads them) and their page bytes; divided by the
bytes of that stage's own layers, 1.0 means it reads nothing it does not use. Also the keys of
the lookup's second call on a cold miss (per candidate layout, the first piece of the first
set of each group, of four sets of each state group) per reader. Pure geometry through the
connector's own code; no timing. Writes JSON to ``--out``.

Usage: ``.venv/bin/python benchmarks/layout_reads.py [--out benchmarks/results/layout_reads.json]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from hybrid_offload.connector.worker.page_codec import PageCodec
from hybrid_offload.core.layer_parts import LayerGrid, ModelLayers, decoder_layer, layout_bounds, stage_layers
from hybrid_offload.core.planner import HybridOffloadPlanner, default_chunk_tokens
from hybrid_offload.core.spec import GroupKind, ModelSpec, make_model_spec
from hybrid_offload.testing.datapath import QWEN3_NEXT_80B, model_spec

LAYERS = QWEN3_NEXT_80B.attn_layers + QWEN3_NEXT_80B.gdn_layers
WRITERS = {"PP=1": (1, None), "PP=1, layer_parts 2": (1, 2), "PP=2": (2, None), "PP=4": (4, None)}
READERS = (1, 2, 4)


def stage_spec(whole: ModelSpec, pp: int, stage: int, layer_parts: int | None = None) -> ModelSpec:
    """The spec a stage's worker builds: its layers of each group, its engine's layout."""
    start, end = stage_layers(LAYERS, pp)[stage]
    groups = tuple(dataclasses.replace(g, layer_names=tuple(n for n in g.layer_names
                                                            if start <= decoder_layer(n, LAYERS) < end))
                   for g in whole.groups)  # fmt: skip
    bounds = layout_bounds(LAYERS, stage_layers(LAYERS, pp), layer_parts)
    grid = LayerGrid(LAYERS, bounds if len(bounds) > 2 else ())
    return make_model_spec(groups, whole.fingerprint_fields["model"], max_model_len=whole.max_model_len,
                           num_blocks=whole.num_blocks, grid=grid, pp_rank=stage, pp_size=pp)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/layout_reads.json"))
    args = parser.parse_args()
    whole = model_spec(QWEN3_NEXT_80B, num_blocks=64)
    chunk = default_chunk_tokens(whole.groups)
    # vLLM deals a kind's layers out to its groups in turn (``layers[i::num_groups]``)
    gdn = [n for g in whole.groups if g.kind is GroupKind.MAMBA for n in g.layer_names]
    states = sum(g.kind is GroupKind.MAMBA for g in whole.groups)
    groups, k = [], 0
    for g in whole.groups:
        names = g.layer_names
        if g.kind is GroupKind.MAMBA:
            names, k = tuple(sorted(gdn[k::states], key=lambda n: decoder_layer(n, LAYERS))), k + 1
        groups.append(dataclasses.replace(g, layer_names=names, shards=1))
    whole = dataclasses.replace(whole, groups=tuple(groups))
    model = ModelLayers(LAYERS, tuple(g.layer_names for g in whole.groups))
    rows = []
    for writer, (wpp, parts) in WRITERS.items():
        written = layout_bounds(LAYERS, stage_layers(LAYERS, wpp), parts)
        for rpp in READERS:
            for stage in range(rpp):
                spec = stage_spec(whole, rpp, stage)
                read = own = pages = 0
                for g in spec.groups:
                    if not g.layer_names:
                        continue
                    codec = PageCodec(spec, g, chunk)
                    pieces = codec.read if written == spec.grid.layout else codec.foreign(written, model)
                    read += sum(codec.page_lens[p] for p in pieces)
                    own += sum(x.nbytes for p in codec.read for x in codec.tensors[p])
                    pages += len(pieces)
                rows.append({"writer": writer, "reader": f"PP={rpp}", "stage": stage, "pages": pages,
                             "bytes_read": read, "bytes_used": own,
                             "ratio": round(read / own, 3)})  # fmt: skip
    probes = {}
    for rpp in READERS:
        spec = stage_spec(whole, rpp, 0)
        planner = HybridOffloadPlanner(spec, chunk)
        planner.set_model_layers(model)
        others = planner.layouts[1:]
        probes[f"PP={rpp}"] = len(others) * sum(4 if g.kind is GroupKind.MAMBA else 1 for g in spec.groups)
    result = {"model": "Qwen3-Next-80B geometry (12 attention + 36 GDN layers, bf16, TP=1)",
              "chunk": chunk, "reads": rows, "cold_miss_probe_keys": probes}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'writer':<20} {'reader':<6} {'stage':>5} {'pages':>5} {'read MB':>8} {'used MB':>8} "
          f"{'ratio':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['writer']:<20} {r['reader']:<6} {r['stage']:>5} {r['pages']:>5} "
              f"{r['bytes_read'] / 1e6:>8.2f} {r['bytes_used'] / 1e6:>8.2f} {r['ratio']:>6}")  # fmt: skip
    print("cold-miss probe keys (second lookup call):", probes)


if __name__ == "__main__":
    main()
