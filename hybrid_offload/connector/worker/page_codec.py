"""Page geometry of one KV cache group on this worker, and the copies between the pages of a
page set and vLLM's KV cache.

Worker side; torch work runs on the model-runner thread (see ``worker``). A (chunk, group) page
set is one page per *piece*: per layer part holding some of the group's layers
(:mod:`hybrid_offload.core.layer_parts`) and per shard (:mod:`hybrid_offload.core.tp_shards`).
This worker (a TP rank of a pipeline stage) writes, of the parts of its engine's layout in its
stage, the shards inside its part of the model (``written``) and reads the ones overlapping it
(``read``), or those of another layout's parts holding its layers (:meth:`PageCodec.foreign`),
so a set written at any PP x TP layout loads at any other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple, overload

import torch

from hybrid_offload.connector.metadata import PageJob
from hybrid_offload.connector.worker.state_maps import Run, StateMap, byte_map, flat_buffer
from hybrid_offload.core.layer_parts import LayerPartError, ModelLayers, layers_digest
from hybrid_offload.core.page_format import CHUNK_HASH_LEN, PageHeader, PageTemplate, header_len, page_len
from hybrid_offload.core.planner import Piece
from hybrid_offload.core.spec import GroupSpec, ModelSpec, TensorSpec
from hybrid_offload.core.tp_shards import Transfer, read_plan, shards_read, shards_written, transfers
from hybrid_offload.engine.kv_layout import AttentionGroupLayout, LayoutError, MambaGroupLayout, TokenIndex

Layout = AttentionGroupLayout | MambaGroupLayout


class PiecePayload(NamedTuple):
    """One piece of a page to write into vLLM's KV cache: its page job, the piece and its payload."""

    page: PageJob
    piece: Piece
    #: the page's bytes past its header (1-D uint8, on the host or the device)
    payload: torch.Tensor


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class PageCodec:
    """Piece geometry of one group for this worker, and the copies into and out of its pages.
    Methods take a :class:`~hybrid_offload.core.planner.Piece` of ``written``, ``read`` or
    :meth:`foreign`. A piece's page may hold more layers than this worker's (a part spanning
    several pipeline stages): ``tensors`` and ``offsets`` say where this worker's are in it."""

    def __init__(self, spec: ModelSpec, group: GroupSpec, chunk_tokens: int) -> None:
        self.spec, self.group, self.chunk_tokens = spec, group, chunk_tokens
        splits, shards, t, r = group.splits, group.shards, spec.tp_size, spec.tp_rank
        self._write_shards = shards_written(splits, shards, t, r)
        self._read_shards = shards_read(splits, shards, t, r)
        #: per piece: this worker's layers in it (positions in the group), their payload
        #: tensors and byte offset, and the whole page's tensors, header and page lengths
        self.held: dict[Piece, tuple[int, ...]] = {}
        self.tensors: dict[Piece, tuple[TensorSpec, ...]] = {}
        self.offsets: dict[Piece, int] = {}
        self.view_lens: dict[Piece, int] = {}
        self.page_tensors: dict[Piece, tuple[TensorSpec, ...]] = {}
        self.header_lens: dict[Piece, int] = {}
        self.page_lens: dict[Piece, int] = {}
        #: per piece read, what its pages share (verify_page checks a page against it)
        self.templates: dict[Piece, PageTemplate] = {}
        write_runs = {s: self._runs(s, [transfers(x, (shards, s), (t, r)) for x in splits])
                      for s in self._write_shards}  # fmt: skip
        plans = [read_plan(x, shards, self._read_shards, t, r) for x in splits]
        self._shard_read_runs = {s: self._runs(s, [plan[s] for plan in plans]) for s in self._read_shards}
        self.write_runs: dict[Piece, list[Run]] = {}
        self.read_runs: dict[Piece, list[Run]] = {}
        self.written: list[Piece] = []
        self.read: list[Piece] = []
        for (start, end), positions in spec.grid.ranges(group.layer_names).items():
            digest = layers_digest([group.layer_names[i] for i in positions])
            for s in self._write_shards:
                piece = self._add(Piece(start, end, digest, s), positions, len(positions), 0)
                self.write_runs[piece] = write_runs[s]
                self.written.append(piece)
            self.read.extend(self._add_read(Piece(start, end, digest, s), positions, len(positions), 0)
                             for s in self._read_shards)  # fmt: skip
        self._foreign: dict[tuple[tuple[int, ...], int], tuple[ModelLayers, list[Piece]]] = {}
        self._subsets: dict[tuple[int, tuple[int, ...]], tuple[Layout, Layout]] = {}
        self._maps: dict[tuple[int, Piece, int], tuple[Layout, list[StateMap]]] = {}

    def _add(self, piece: Piece, held: tuple[int, ...], layers: int, first: int) -> Piece:
        if piece not in self.held:
            per_layer = self.group.page_tensors(self.chunk_tokens, piece.shard, 1)
            self.held[piece] = held
            self.tensors[piece] = self.group.page_tensors(self.chunk_tokens, piece.shard, len(held))
            self.offsets[piece] = first * sum(x.nbytes for x in per_layer)
            self.view_lens[piece] = sum(x.nbytes for x in self.tensors[piece])
            self.page_tensors[piece] = self.group.page_tensors(self.chunk_tokens, piece.shard, layers)
            self.header_lens[piece] = header_len(self.page_tensors[piece])
            self.page_lens[piece] = page_len(self.page_tensors[piece])
        return piece

    def _add_read(self, piece: Piece, held: tuple[int, ...], layers: int, first: int) -> Piece:
        self._add(piece, held, layers, first)
        if piece not in self.templates:
            self.read_runs[piece] = self._shard_read_runs[piece.shard]
            self.templates[piece] = PageTemplate.of(self._header(bytes(CHUNK_HASH_LEN), 0, piece))
        return piece

    def foreign(self, layout: tuple[int, ...], model: ModelLayers) -> list[Piece]:
        """The pieces this worker reads of a page set written in ``layout`` (``model``: the
        whole model's layers): of each part holding some of this worker's layers of the group,
        the shards it reads. Raises LayerPartError where ``model`` does not hold them."""
        known = self._foreign.get((layout, id(model)))
        if known is not None and known[0] is model:
            return known[1]
        mine = {name: i for i, name in enumerate(self.group.layer_names)}
        pieces: list[Piece] = []
        for span in model.ranges(self.group.index, layout):
            names = model.names(self.group.index, span)
            held = tuple(mine[n] for n in names if n in mine)
            if not held:
                continue
            first = names.index(self.group.layer_names[held[0]])
            if names[first : first + len(held)] != tuple(self.group.layer_names[i] for i in held):
                raise LayerPartError(f"group {self.group.index}: this stage's layers are not one run of "
                                     f"part {list(span)}'s")  # fmt: skip
            digest = layers_digest(names)
            pieces.extend(self._add_read(Piece(*span, digest, s), held, len(names), first)
                          for s in self._read_shards)  # fmt: skip
        if sorted(i for p in pieces if p.shard == self._read_shards[0] for i in self.held[p]) != list(
            range(len(self.group.layer_names))
        ):
            raise LayerPartError(f"group {self.group.index}: layout {list(layout)} does not hold every "
                                 "layer of this stage")  # fmt: skip
        self._foreign[(layout, id(model))] = (model, pieces)
        return pieces

    def _view(self, piece: Piece, payload: torch.Tensor) -> torch.Tensor:
        """This worker's layers' bytes of ``piece``'s payload."""
        offset, size = self.offsets[piece], self.view_lens[piece]
        return payload if not offset and size == payload.numel() else payload[offset : offset + size]

    @overload
    def _layout(self, layout: AttentionGroupLayout, piece: Piece) -> AttentionGroupLayout: ...
    @overload
    def _layout(self, layout: MambaGroupLayout, piece: Piece) -> MambaGroupLayout: ...
    @overload
    def _layout(self, layout: Layout, piece: Piece) -> Layout: ...

    def _layout(self, layout: Layout, piece: Piece) -> Layout:
        """``layout`` (the group's layers on this worker) narrowed to ``piece``'s part (a
        layout of the same kind)."""
        positions = self.held[piece]
        if positions == tuple(range(len(layout.layers))):
            return layout
        key = (id(layout), positions)
        known = self._subsets.get(key)
        if known is None or known[0] is not layout:
            known = self._subsets[key] = (layout, layout.subset(positions))
        return known[1]

    def _state_maps(self, layout: MambaGroupLayout, piece: Piece, runs: list[Run]) -> list[StateMap]:
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
                bases = [int(raw.storage_offset()) if raw.untyped_storage().data_ptr() == ptr else None
                         for raw in layout.layers]  # fmt: skip
                src, dst = byte_map(self.group, self.tensors[piece], runs, bases)
                maps.append(StateMap(src, dst, flat_buffer(first), stride,
                                     self.view_lens[piece]))  # fmt: skip
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

    def template(self, piece: Piece) -> PageTemplate:
        """What every page of ``piece`` shares (for checks and for sealing many at once)."""
        known = self.templates.get(piece)
        if known is None:
            known = self.templates[piece] = PageTemplate.of(self._header(bytes(CHUNK_HASH_LEN), 0, piece))
        return known

    def header(self, page: PageJob, piece: Piece) -> PageHeader:
        return self._header(page.chunk_hash, page.chunk_index, piece)

    def _header(self, chunk_hash: bytes, chunk_index: int, piece: Piece) -> PageHeader:
        return PageHeader(
            self.spec.fingerprint_bytes,
            chunk_hash,
            self.group.index,
            self.group.kind,
            chunk_index,
            self.chunk_tokens,
            self.page_tensors[piece],
            piece.shard,
            self.group.shards,
            piece.start,
            piece.end,
            piece.digest,
        )

    # ---- payload views ----------------------------------------------------------------
    def _attention_views(self, piece: Piece, payload: torch.Tensor) -> list[torch.Tensor]:
        """Per layer of this worker's, the piece's K and V as one ``(2, tokens, heads,
        head_size)`` view of ``payload`` (the page's whole payload)."""
        payload = self._view(piece, payload)
        tensors, views, offset = self.tensors[piece], [], 0
        for k in tensors[::2]:
            size = 2 * k.nbytes
            views.append(payload[offset : offset + size].view(_dtype(k.dtype)).view(2, *k.shape))
            offset += size
        return views

    def prepare(self, layout: AttentionGroupLayout | MambaGroupLayout) -> None:
        """Build the element maps of this engine's own pieces over ``layout`` now (when the
        caches are registered) rather than in the first store or load (~0.1 s)."""
        if not isinstance(layout, MambaGroupLayout):
            return
        for pieces, runs in ((self.read, self.read_runs), (self.written, self.write_runs)):
            for piece in pieces:
                for smap in self._state_maps(self._layout(layout, piece), piece, runs[piece]):
                    smap.prepare()

    # ---- copies -----------------------------------------------------------------------
    def gather(self, layout: AttentionGroupLayout | MambaGroupLayout, page: PageJob,
               piece: Piece, payload: torch.Tensor) -> None:
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
                      pages: Sequence[PiecePayload]) -> None:
        """:meth:`scatter` of many pieces' payloads of this group. Attention pages in a
        layout that moves whole tokens go in one copy per layer, K/V and head run for all of
        them (their tokens' indices and payloads concatenated); others one by one."""
        if not isinstance(layout, AttentionGroupLayout) or not layout.scatters_by_token:
            for page, piece, payload in pages:
                self.scatter(layout, page, piece, payload)
            return
        by_piece: dict[Piece, list[tuple[PageJob, torch.Tensor]]] = {}
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

    def _row_layers(self, layout: AttentionGroupLayout | MambaGroupLayout, piece: Piece, rows: torch.Tensor,
                    pages: Sequence[PageJob], write: bool = False) -> list[torch.Tensor] | None:
        """Per layer, the K/V of ``piece`` pages that are the rows of ``rows`` ((len(pages),
        page length) uint8) as one ``(2, pages, tokens, heads, head_size)`` view; None where the
        layout (for ``write``: into the cache, else out of it) or the rows' alignment does not
        allow copying them in one go."""
        tensors, hlen = self.tensors[piece], self.header_lens[piece] + self.offsets[piece]
        layout = self._layout(layout, piece)
        if not isinstance(layout, AttentionGroupLayout) or not pages:
            return None
        if not (layout.scatters_by_token if write else layout.views is not None):
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

    def _row_stack(self, layout: AttentionGroupLayout | MambaGroupLayout, piece: Piece,
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

    def gather_rows(self, layout: AttentionGroupLayout | MambaGroupLayout, piece: Piece,
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

    def rows_fit(self, layout: AttentionGroupLayout | MambaGroupLayout, piece: Piece,
                 rows: torch.Tensor, pages: Sequence[PageJob]) -> bool:
        """Whether :meth:`scatter_rows` can write ``pages`` from ``rows`` (else
        :meth:`scatter_pages`): the layout moves whole tokens, the rows are aligned for its
        dtype and no page skips tokens."""
        if any(p.skip_tokens for p in pages):
            return False
        return self._row_layers(layout, piece, rows, pages, True) is not None

    def row_index(self, layout: AttentionGroupLayout | MambaGroupLayout, piece: Piece,
                  pages: Sequence[PageJob]) -> TokenIndex:
        """Where the tokens of ``pages`` (none skipping tokens) go, ``(pages, tokens)`` on the
        host (any thread may build it); :meth:`scatter_rows` takes its rows for those pages."""
        sub = self._layout(layout, piece)
        assert isinstance(sub, AttentionGroupLayout)
        return sub.token_rows([(p.block_ids, p.first_token) for p in pages], self.chunk_tokens, host=True)

    def scatter_rows(self, layout: AttentionGroupLayout | MambaGroupLayout, piece: Piece,
                     rows: torch.Tensor, pages: Sequence[PageJob], at: TokenIndex | None = None) -> bool:
        """Write ``pages`` (none skipping tokens), whose verified ``piece`` pages are the rows of
        ``rows`` ((len(pages), page length) uint8), with one copy per K/V and head run (per layer
        too where the layout does not stack them) reading the rows in place; ``at``: their
        :meth:`row_index` (those rows of it), if built already. False, writing nothing, where
        :meth:`rows_fit` does not hold (then :meth:`scatter_pages`)."""
        per_layer = self._row_layers(layout, piece, rows, pages, True)
        if per_layer is None:
            return False
        whole, layout = layout, self._layout(layout, piece)
        assert isinstance(layout, AttentionGroupLayout)
        if at is None:
            at = layout.token_rows([(p.block_ids, p.first_token) for p in pages], self.chunk_tokens)
        else:
            at = layout.on_device(at)
        stack = self._row_stack(whole, piece, rows, pages)
        if stack is None:
            self._scatter_layers(layout, piece, per_layer, at)
            return True
        for run in self.read_runs[piece]:
            parts = slice(run.part_start, run.part_start + run.length)
            index = TokenIndex(at.kblocks, at.slots, slice(run.rank_start, run.rank_start + run.length))
            layout.scatter_stacked(index, stack[:, :, :, :, parts])
        return True

    def scatter_runs(self, layout: AttentionGroupLayout | MambaGroupLayout, piece: Piece,
                     runs: Sequence[tuple[torch.Tensor, Sequence[PageJob]]], at: TokenIndex) -> None:
        """:meth:`scatter_rows` of several runs of rows (each :meth:`rows_fit`), ``at`` the
        :meth:`row_index` of all their pages in order. Where vLLM's cache-write op writes the
        layout, the runs' K/V are first copied side by side and written in one call per layer
        (a call costs more than copying a run: it wakes the op's threads); else run by run."""
        sub = self._layout(layout, piece)
        assert isinstance(sub, AttentionGroupLayout)
        if len(runs) > 1 and sub.views is None and sub.writes is not None:
            per_run = [self._row_layers(layout, piece, rows, pages, True) for rows, pages in runs]
            assert all(p is not None for p in per_run)
            per_layer = [torch.cat(layer, dim=1) for layer in zip(*per_run, strict=True)]
            self._scatter_layers(sub, piece, per_layer, sub.on_device(at))
            return
        first = 0
        for rows, pages in runs:
            part = dataclasses.replace(at, kblocks=at.kblocks[first : first + len(pages)],
                                       slots=at.slots[first : first + len(pages)])  # fmt: skip
            written = self.scatter_rows(layout, piece, rows, pages, part)
            assert written  # rows_fit allowed it
            first += len(pages)

    def _scatter_layers(self, layout: AttentionGroupLayout, piece: Piece, per_layer: list[torch.Tensor],
                        at: TokenIndex) -> None:  # fmt: skip
        """Write ``per_layer`` (per layer of ``piece``'s part, ``(2, pages, tokens, heads,
        head_size)``) at ``at``, one scatter per head run of the piece."""
        for run in self.read_runs[piece]:
            parts = slice(run.part_start, run.part_start + run.length)
            index = TokenIndex(at.kblocks, at.slots, slice(run.rank_start, run.rank_start + run.length))
            layout.scatter(index, [v[:, :, :, parts] for v in per_layer])

    def scatter(self, layout: AttentionGroupLayout | MambaGroupLayout, page: PageJob,
                piece: Piece, payload: torch.Tensor) -> None:
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
            smap.scatter(self._view(piece, payload), page.block_ids)
