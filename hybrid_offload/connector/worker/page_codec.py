"""Page geometry of one KV cache group on this worker, and the copies between the pages of a
page set and vLLM's KV cache.

Worker side; torch work runs on the model-runner thread (see ``worker``). A (chunk, group) page
set is one page per *piece*: per layer part holding some of the group's layers
(:mod:`hybrid_offload.core.layer_parts`) and per shard (:mod:`hybrid_offload.core.tp_shards`),
numbered ``part * shards + shard``. This worker (a TP rank of a pipeline stage) writes, of the
parts its stage holds, the shards inside its part of the model (``written``) and reads the
ones overlapping it (``read``), so a set written at any PP x TP layout loads at any other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid_offload.connector.metadata import PageJob
from hybrid_offload.connector.worker.state_maps import Run, StateMap, byte_map, flat_buffer
from hybrid_offload.core.page_format import CHUNK_HASH_LEN, PageHeader, PageTemplate, header_len, page_len
from hybrid_offload.core.spec import GroupSpec, ModelSpec
from hybrid_offload.core.tp_shards import Transfer, read_plan, shards_read, shards_written, transfers
from hybrid_offload.engine.kv_layout import AttentionGroupLayout, LayoutError, MambaGroupLayout, TokenIndex

Layout = AttentionGroupLayout | MambaGroupLayout


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class PageCodec:
    """Piece geometry of one group for this worker, and the copies into and out of its pages.
    Methods take a piece (``part * shards + shard``) of ``written`` or ``read``."""

    def __init__(self, spec: ModelSpec, group: GroupSpec, chunk_tokens: int) -> None:
        self.spec, self.group, self.chunk_tokens = spec, group, chunk_tokens
        splits, shards, t, r = group.splits, group.shards, spec.tp_size, spec.tp_rank
        #: per layer part this stage holds layers of the group in, their positions in the group
        self.positions = spec.grid.positions(group.layer_names)
        self.layers = spec.grid.digests(group.layer_names)  # as the planner keys them
        write_shards, read_shards = shards_written(splits, shards, t, r), shards_read(splits, shards, t, r)
        self.written = [part * shards + s for part in self.positions for s in write_shards]
        self.read = [part * shards + s for part in self.positions for s in read_shards]
        self.tensors = {p: group.page_tensors(chunk_tokens, p % shards, len(self.positions[p // shards]))
                        for p in {*self.written, *self.read}}  # fmt: skip
        self.header_lens = {p: header_len(ts) for p, ts in self.tensors.items()}
        self.page_lens = {p: page_len(ts) for p, ts in self.tensors.items()}
        #: per piece read, what its pages share (verify_page checks a page against it)
        self.templates = {p: PageTemplate.of(self._header(bytes(CHUNK_HASH_LEN), 0, p)) for p in self.read}
        write_runs = {s: self._runs(s, [transfers(x, (shards, s), (t, r)) for x in splits])
                      for s in write_shards}  # fmt: skip
        self.write_runs = {p: write_runs[p % shards] for p in self.written}
        plans = [read_plan(x, shards, read_shards, t, r) for x in splits]
        read_runs = {s: self._runs(s, [plan[s] for plan in plans]) for s in read_shards}
        self.read_runs = {p: read_runs[p % shards] for p in self.read}
        self._subsets: dict[tuple[int, int], tuple[Layout, Layout]] = {}
        self._maps: dict[tuple[int, int, int], tuple[Layout, list[StateMap]]] = {}

    def _layout(self, layout: Layout, piece: int) -> Layout:
        """``layout`` (the group's layers on this worker) narrowed to ``piece``'s part."""
        positions = self.positions[piece // self.group.shards]
        if len(positions) == len(layout.layers):
            return layout
        key = (id(layout), piece // self.group.shards)
        known = self._subsets.get(key)
        if known is None or known[0] is not layout:
            known = self._subsets[key] = (layout, layout.subset(positions))
        return known[1]

    def _state_maps(self, layout: MambaGroupLayout, piece: int, runs: list[Run]) -> list[StateMap]:
        """The element maps of ``piece`` over ``layout`` (a piece's part) for ``runs``: one per
        buffer its layers live in (vLLM allocates one for all)."""
        key = (id(layout), piece, id(runs))
        known = self._maps.get(key)
        if known is None or known[0] is not layout:
            strides = {raw.stride(0) for raw in layout.layers}
            if len(strides) != 1:
                raise LayoutError(f"group {self.group.index}: Mamba layers' blocks are not equally spaced")
            stride, maps = strides.pop(), []
            buffers = {raw.untyped_storage().data_ptr(): raw for raw in layout.layers}
            for ptr, first in buffers.items():
                bases = [raw.storage_offset() if raw.untyped_storage().data_ptr() == ptr else None
                         for raw in layout.layers]  # fmt: skip
                src, dst = byte_map(self.group, self.tensors[piece], runs, bases)
                maps.append(StateMap(src, dst, flat_buffer(first), stride,
                                     self.page_lens[piece] - self.header_lens[piece]))  # fmt: skip
            known = self._maps[key] = (layout, maps)
        return known[1]

    def _runs(self, shard: int, per_tensor: list[list[Transfer]]) -> list[Run]:
        """Transfers (a = shard, b = rank) as runs over the shard's per-component parts."""
        out, part = [], 0
        for i, (split, runs) in enumerate(zip(self.group.splits, per_tensor, strict=True)):
            offsets = split.offsets(self.group.shards, shard)
            for t in runs:
                out.append(Run(i, split.axis, part + t.component, t.a_start - offsets[t.component],
                               t.b_start, t.length))
            part += len(split.components)
        return out

    def header(self, page: PageJob, piece: int) -> PageHeader:
        return self._header(page.chunk_hash, page.chunk_index, piece)

    def _header(self, chunk_hash: bytes, chunk_index: int, piece: int) -> PageHeader:
        part, shard = divmod(piece, self.group.shards)
        return PageHeader(
            self.spec.fingerprint_bytes,
            chunk_hash,
            self.group.index,
            self.group.kind,
            chunk_index,
            self.chunk_tokens,
            self.tensors[piece],
            shard,
            self.group.shards,
            part,
            self.spec.grid.parts,
            self.layers[part],
        )

    # ---- payload views ----------------------------------------------------------------
    def _attention_views(self, piece: int, payload: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, the piece's K and V as one ``(2, tokens, heads, head_size)`` view."""
        tensors, views, offset = self.tensors[piece], [], 0
        for k in tensors[::2]:
            size = 2 * k.nbytes
            views.append(payload[offset : offset + size].view(_dtype(k.dtype)).view(2, *k.shape))
            offset += size
        return views

    # ---- copies -----------------------------------------------------------------------
    def gather(self, layout: AttentionGroupLayout | MambaGroupLayout, page: PageJob,
               piece: int, payload: torch.Tensor) -> None:
        """Copy this rank's part of ``page`` for ``piece`` (one it writes) into ``payload``."""
        runs, layout = self.write_runs[piece], self._layout(layout, piece)
        if isinstance(layout, AttentionGroupLayout):
            (run,) = runs  # a written piece's heads are one run of this rank's heads
            heads = slice(run.rank_start, run.rank_start + run.length)
            index = layout.token_index(list(page.block_ids), page.first_token, self.chunk_tokens, heads)
            layout.gather(index, self._attention_views(piece, payload))
            return
        for smap in self._state_maps(layout, piece, runs):
            smap.gather(payload, page.block_ids[0])

    def scatter_pages(self, layout: AttentionGroupLayout | MambaGroupLayout,
                      pages: list[tuple[PageJob, int, torch.Tensor]]) -> None:
        """:meth:`scatter` of many (page, piece, payload) of this group. Attention pages in a
        strided kernel layout go in one copy per layer, K/V and head run for all of them
        (their tokens' indices and payloads concatenated); others one by one."""
        if not isinstance(layout, AttentionGroupLayout) or layout.views is None:
            for page, piece, payload in pages:
                self.scatter(layout, page, piece, payload)
            return
        by_piece: dict[int, list[tuple[PageJob, torch.Tensor]]] = {}
        for page, piece, payload in pages:
            by_piece.setdefault(piece, []).append((page, payload))
        tokens: dict[str, TokenIndex] = {}  # per page: where its tokens go (every piece alike)
        whole = layout
        for piece, items in by_piece.items():
            layout = self._layout(whole, piece)
            views, kblocks, slots = [], [], []
            for page, payload in items:
                at = tokens.get(page.key)
                if at is None:
                    skip = page.skip_tokens
                    at = tokens[page.key] = layout.token_index(
                        list(page.block_ids), page.first_token + skip, self.chunk_tokens - skip)
                views.append(self._attention_views(piece, payload))
                kblocks.append(at.kblocks)
                slots.append(at.slots)
            piece_kblocks, piece_slots = torch.cat(kblocks), torch.cat(slots)
            for run in self.read_runs[piece]:
                parts = slice(run.part_start, run.part_start + run.length)
                data = [torch.cat([v[:, page.skip_tokens:, parts] for (page, _), v in
                                   zip(items, (vs[layer] for vs in views), strict=True)], dim=1)
                        for layer in range(len(layout.layers))]  # fmt: skip
                heads = slice(run.rank_start, run.rank_start + run.length)
                layout.scatter(TokenIndex(piece_kblocks, piece_slots, heads), data)

    def _row_layers(self, layout: AttentionGroupLayout | MambaGroupLayout, piece: int,
                    rows: torch.Tensor, pages: Sequence[PageJob]) -> list[torch.Tensor] | None:
        """Per layer, the K/V of ``piece`` pages that are the rows of ``rows`` ((len(pages),
        page length) uint8) as one ``(2, pages, tokens, heads, head_size)`` view; None where the
        layout or the rows' alignment does not allow copying them in one go."""
        tensors, hlen = self.tensors[piece], self.header_lens[piece]
        layout = self._layout(layout, piece)
        if not isinstance(layout, AttentionGroupLayout) or layout.views is None or not pages:
            return None
        itemsize = _dtype(tensors[0].dtype).itemsize
        if rows.stride(0) % itemsize or (rows.storage_offset() + hlen) % itemsize:
            return None
        assert rows.shape == (len(pages), self.page_lens[piece])
        n, offset, per_layer = len(pages), hlen, []
        for k in tensors[::2]:
            size = 2 * k.nbytes  # the layer's K then V, each (tokens, heads, head_size)
            layer = rows[:, offset : offset + size].view(_dtype(k.dtype)).view(n, 2, *k.shape)
            per_layer.append(layer.transpose(0, 1))  # (2, pages, tokens, heads, head_size)
            offset += size
        return per_layer

    def _row_stack(self, layout: AttentionGroupLayout | MambaGroupLayout, piece: int,
                   rows: torch.Tensor, pages: Sequence[PageJob]) -> torch.Tensor | None:
        """The K/V of ``piece`` pages that are the rows of ``rows`` as one ``(2, pages, tokens,
        layers, heads, head_size)`` view, where the layout stacks its layers (one copy per K
        and V for all of them); else None."""
        sub = self._layout(layout, piece)
        if not isinstance(sub, AttentionGroupLayout) or sub.stacked is None:
            return None
        per_layer = self._row_layers(layout, piece, rows, pages)
        if per_layer is None:
            return None
        first = per_layer[0]  # (2, pages, tokens, heads, head_size)
        step = per_layer[1].storage_offset() - first.storage_offset() if len(per_layer) > 1 else 0
        kv, p, t, h, d = first.stride()
        shape = (*first.shape[:3], len(per_layer), *first.shape[3:])
        return first.as_strided(shape, (kv, p, t, step, h, d), first.storage_offset())

    def gather_rows(self, layout: AttentionGroupLayout | MambaGroupLayout, piece: int,
                    rows: torch.Tensor, pages: Sequence[PageJob]) -> bool:
        """Copy the payloads of ``pages``' ``piece`` (one this rank writes) into the rows of
        ``rows`` ((len(pages), page length) uint8; headers left to ``seal_page``) with one copy
        per layer and K/V. False, copying nothing, where the layout or the rows' alignment does
        not allow it (then :meth:`gather` page by page)."""
        per_layer = self._row_layers(layout, piece, rows, pages)
        if per_layer is None:
            return False
        whole, layout = layout, self._layout(layout, piece)
        assert isinstance(layout, AttentionGroupLayout)
        at = layout.token_rows([(p.block_ids, p.first_token) for p in pages], self.chunk_tokens)
        (run,) = self.write_runs[piece]  # a written piece's heads are one run of this rank's heads
        index = TokenIndex(at.kblocks, at.slots, slice(run.rank_start, run.rank_start + run.length))
        stack = self._row_stack(whole, piece, rows, pages)
        if stack is not None:
            layout.gather_stacked(index, stack)
        else:
            layout.gather(index, per_layer)
        return True

    def row_index(self, layout: AttentionGroupLayout | MambaGroupLayout, piece: int,
                  rows: torch.Tensor, pages: Sequence[PageJob]) -> TokenIndex | None:
        """Where the tokens of ``pages`` go, on the host (any thread may build it), for
        :meth:`scatter_rows` of those rows; None where the layout or the rows' alignment does not
        allow writing them as rows (then :meth:`scatter_pages`)."""
        if any(p.skip_tokens for p in pages) or self._row_layers(layout, piece, rows, pages) is None:
            return None
        sub = self._layout(layout, piece)
        assert isinstance(sub, AttentionGroupLayout)
        return sub.token_rows([(p.block_ids, p.first_token) for p in pages], self.chunk_tokens, host=True)

    def scatter_rows(self, layout: AttentionGroupLayout | MambaGroupLayout, piece: int,
                     rows: torch.Tensor, pages: Sequence[PageJob], at: TokenIndex | None = None) -> bool:
        """Write ``pages`` (none skipping tokens), whose verified ``piece`` pages are the rows of
        ``rows`` ((len(pages), page length) uint8), with one copy per K/V and head run (per layer
        too where the layout does not stack them) reading the rows in place; ``at``: their
        :meth:`row_index`, if built already. False, writing nothing, where the layout or the
        page's alignment does not allow it (then :meth:`scatter_pages`)."""
        per_layer = self._row_layers(layout, piece, rows, pages)
        if per_layer is None:
            return False
        whole, layout = layout, self._layout(layout, piece)
        assert isinstance(layout, AttentionGroupLayout)
        if at is None:
            at = layout.token_rows([(p.block_ids, p.first_token) for p in pages], self.chunk_tokens)
        else:
            at = layout.on_device(at)
        stack = self._row_stack(whole, piece, rows, pages)
        for run in self.read_runs[piece]:
            parts = slice(run.part_start, run.part_start + run.length)
            index = TokenIndex(at.kblocks, at.slots, slice(run.rank_start, run.rank_start + run.length))
            if stack is not None:
                layout.scatter_stacked(index, stack[:, :, :, :, parts])
            else:
                layout.scatter(index, [v[:, :, :, parts] for v in per_layer])
        return True

    def scatter(self, layout: AttentionGroupLayout | MambaGroupLayout, page: PageJob,
                piece: int, payload: torch.Tensor) -> None:
        """Write this rank's part of ``piece`` (one it reads) from ``payload`` into the blocks."""
        runs, layout = self.read_runs[piece], self._layout(layout, piece)
        if isinstance(layout, AttentionGroupLayout):
            skip = page.skip_tokens
            views = self._attention_views(piece, payload)
            for run in runs:
                index = layout.token_index(
                    list(page.block_ids), page.first_token + skip, self.chunk_tokens - skip,
                    slice(run.rank_start, run.rank_start + run.length),
                )
                layout.scatter(index, [v[:, skip:, run.part_start : run.part_start + run.length]
                                       for v in views])
            return
        for smap in self._state_maps(layout, piece, runs):
            smap.scatter(payload, page.block_ids)
