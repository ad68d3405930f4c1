"""HybridOffloadPlanner: chunks, page keys, per-group coverage and the loadable prefix.

Pure logic: no torch, no I/O, no vLLM imports. Works on :class:`ModelSpec` from
:mod:`hybrid_offload.core.spec`.

* A prompt is cut into chunks of ``chunk_tokens`` tokens. Chunk ``i`` covers tokens
  ``[i * chunk, (i + 1) * chunk)``; only full chunks are ever stored or loaded.
* Keys are a chain hash over the chunks' token ids, seeded with the model fingerprint and the
  request's cache scope (LoRA adapter, cache salt, weights version): sha256, or HMAC-SHA256
  with the cache's secret key where one is configured (then nobody without the key can tell
  which key a prompt has). They are the same in every process and across restarts; Python's
  ``hash()`` is never used. Chain hashes are 32 bytes and every page's header carries its own,
  checked on load, so page keys (128 bits of a sha256) can be short.
* One page set per (chunk, group). For attention groups, the set of chunk ``i`` holds that
  chunk's K/V. For Mamba/GDN groups, the set of chunk ``i`` holds the state after the chunk's
  last token, i.e. at boundary ``N = (i + 1) * chunk``; it exists only where a request's
  computation stopped at ``N`` (see :func:`prefill_checkpoints`). A set is one page per
  *piece*: per layer part (a range of decoder layers, :mod:`~hybrid_offload.core.layer_parts`)
  holding some of the group's layers and per TP shard (``tp_shards``), each under its own
  backend key (:meth:`HybridOffloadPlanner.piece_keys`). An engine writes the parts of its own
  layout; a set is present in a layout when all of its pieces there are, and is read from any.
* Coverage at boundary ``N`` (``k = N / chunk``): full attention needs every chunk in
  ``[start, k)``; sliding window only the chunks inside the window before ``N``; Mamba/GDN only
  the state page at ``N``. In vLLM's "align" mode a state can be resumed at any chunk boundary,
  also inside a Mamba block: it goes into the block that covers token ``N - 1``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hybrid_offload.core.layer_parts import LAYERS_DIGEST_LEN, LayerPartError, ModelLayers, layers_digest
from hybrid_offload.core.spec import GroupKind, GroupSpec, ModelSpec
from hybrid_offload.core.tp_shards import shards_written

logger = logging.getLogger(__name__)

DEFAULT_MIN_CHUNK_TOKENS = 256
#: Default chunk (= checkpoint granularity) for hybrid models: a divisor of every block size, at
#: most this. vLLM's CPU scheduler ends prefill steps at multiples of 128 tokens (its default
#: block size); finer chunks mean more, smaller pages.
DEFAULT_HYBRID_CHUNK_TOKENS = 128
#: GPU engines raise a hybrid model's attention block to a multiple of 16 tokens (the attention
#: kernels' block alignment) that holds a Mamba/GDN state; the multiple depends on the TP size
#: (Qwen3-Next-80B: 544 tokens at TP 1 and 2, 272 at TP 4), 16 divides all of them
GPU_HYBRID_ALIGNMENT = 16


class PlannerConfigError(ValueError):
    """``chunk_tokens`` is incompatible with the model's KV cache groups."""


@dataclass(frozen=True)
class GroupPlan:
    """How one group maps onto chunks.

    ``window_chunks``: sliding-window groups need this many chunks before a boundary.
    ``blocks_per_chunk`` / ``chunks_per_block``: how the group's vLLM blocks relate to chunks
    (one of them is 1); ``unsplittable``: a Mamba group with one block per request (no align
    mode), whose only state slot is block index 0.
    """

    group: GroupSpec
    window_chunks: int | None
    blocks_per_chunk: int
    chunks_per_block: int
    unsplittable: bool = False

    @property
    def index(self) -> int:
        return self.group.index

    @property
    def kind(self) -> GroupKind:
        return self.group.kind


@dataclass(frozen=True)
class LoadablePrefix:
    """Result of a lookup: ``tokens`` (a chunk boundary, 0 if nothing loads), per group the
    largest boundary that group alone would allow (for diagnostics), and ``attention_tokens``:
    how far the full-attention pages reach without a gap (a boundary beyond ``tokens`` there
    means earlier traffic shared more of this prefix than any stored state covers)."""

    tokens: int
    per_group_tokens: tuple[int, ...]
    attention_tokens: int = 0

    @property
    def groups_disagree(self) -> bool:
        return any(t != self.tokens for t in self.per_group_tokens)


def default_chunk_tokens(
    groups: Sequence[GroupSpec], max_model_len: int = 0, hybrid_alignment: int = 0
) -> int:
    """The default chunk.

    With a Mamba group the chunk is also the granularity of state checkpoints (a request
    resumes at a chunk boundary), so it is fine: the largest divisor of every splittable block
    size not above :data:`DEFAULT_HYBRID_CHUNK_TOKENS`, in every Mamba cache mode (an
    unsplittable group, one block per request, takes a state at any step end), and of
    ``hybrid_alignment`` where given: what every hybrid block size of the platform is a multiple
    of, at any TP size (:data:`GPU_HYBRID_ALIGNMENT`), so that engines of one model at
    different TP sizes cut the same chunks and share pages. Attention-only models use the lcm
    of their block sizes, rounded up to at least 256 tokens to keep pages large.
    """
    sizes = [g.block_size for g in groups if not _is_unsplittable(g, max_model_len)]
    if any(g.kind is GroupKind.MAMBA for g in groups):
        return math.gcd(DEFAULT_HYBRID_CHUNK_TOKENS, hybrid_alignment, *sizes)
    if not sizes:
        return DEFAULT_MIN_CHUNK_TOKENS
    chunk = math.lcm(*sizes)
    return chunk * max(1, math.ceil(DEFAULT_MIN_CHUNK_TOKENS / chunk))


def _is_unsplittable(group: GroupSpec, max_model_len: int) -> bool:
    return group.kind is GroupKind.MAMBA and group.mamba_cache_mode != "align"


def _plan_group(group: GroupSpec, chunk: int, max_model_len: int) -> GroupPlan:
    if _is_unsplittable(group, max_model_len):
        return GroupPlan(group, window_chunks=None, blocks_per_chunk=1, chunks_per_block=1,
                         unsplittable=True)
    block = group.block_size
    if block <= chunk:
        if chunk % block:
            raise PlannerConfigError(
                f"chunk_tokens={chunk} is not a multiple of group {group.index} "
                f"({group.kind.value}) block size {block}"
            )
        per_chunk, per_block = chunk // block, 1
    else:
        if block % chunk:
            raise PlannerConfigError(
                f"chunk_tokens={chunk} does not divide group {group.index} "
                f"({group.kind.value}) block size {block}"
            )
        per_chunk, per_block = 1, block // chunk
    window = None
    if group.kind is GroupKind.SLIDING_WINDOW:
        window = max(1, math.ceil(max(1, (group.sliding_window or 1) - 1) / chunk))
    return GroupPlan(group, window, per_chunk, per_block)


def chain_chunk_hashes(
    seed: bytes,
    token_ids: Sequence[int],
    chunk: int,
    key: bytes | None = None,
    extras: Mapping[int, bytes] | None = None,
    first: int = 0,
) -> list[bytes]:
    """Chained 32-byte hashes, one per full chunk: ``h[i] = sha256(h[i-1] || tokens_i ||
    extras[i])``, or HMAC-SHA256 under ``key``; tokens as little-endian int64. ``extras``: what
    besides its tokens decides chunk ``i``'s KV (the images in it), by chunk index counted from
    the start of the sequence; ``token_ids`` starts at chunk ``first``. A chunk's input has a fixed
    length up to its extras, so extras never alias tokens."""
    n_full = len(token_ids) // chunk
    if n_full == 0:
        return []
    tokens = np.asarray(token_ids[: n_full * chunk], dtype="<i8").tobytes()
    step = chunk * 8
    extras = extras or {}
    out: list[bytes] = []
    prev = seed
    for i in range(n_full):
        data = prev + tokens[i * step : (i + 1) * step] + extras.get(first + i, b"")
        prev = hmac.digest(key, data, "sha256") if key else hashlib.sha256(data).digest()
        out.append(prev)
    return out


def _short_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _set_digest(chunk_hash: bytes, group_index: int) -> str:
    return _short_digest(chunk_hash + group_index.to_bytes(2, "little"))


def _piece_tail(start: int, end: int, layers: bytes, shard: int, shards: int) -> bytes:
    """What a piece adds to its set's digest (the same for every chunk)."""
    return layers + b"".join(n.to_bytes(2, "little") for n in (start, end, shard, shards))


def _piece_digest(set_digest: str, start: int, end: int, layers: bytes, shard: int, shards: int) -> str:
    """A piece's digest: its set's, the layer part's layers and decoder-layer range, and the
    shard (a model whose vLLM groups its layers otherwise names other keys: a miss)."""
    return _short_digest(bytes.fromhex(set_digest) + _piece_tail(start, end, layers, shard, shards))


def key_digest(
    chunk_hash: bytes, group_index: int, shard: int = 0, shards: int = 1, start: int = 0, end: int = 0,
    layers: bytes = bytes(LAYERS_DIGEST_LEN),
) -> str:  # fmt: skip
    """The digest half of a page's key (``<fingerprint>-<digest>``), a function of fields in
    the page's header: a page stored under another key than its own can be told. ``layers``:
    the layer part's :func:`~hybrid_offload.core.layer_parts.layers_digest`."""
    return _piece_digest(_set_digest(chunk_hash, group_index), start, end, layers, shard, shards)


class Piece(NamedTuple):
    """One page of a (chunk, group) page set: layer part ``[start, end)`` (``digest``: the
    :func:`~hybrid_offload.core.layer_parts.layers_digest` of the group's layers in it) and
    TP shard ``shard``. A named tuple: it keys the codecs' per-piece tables, looked up per page
    on the data path (a tuple hashes in C)."""

    start: int
    end: int
    digest: bytes
    shard: int


#: page-set keys whose piece keys a planner remembers (~250 bytes each with 4 pieces)
MAX_MEMO_KEYS = 1 << 16
#: how many times a lookup looks for other layouts' pages where its own layout's end
LAYOUT_ROUNDS = 2
#: state sets of a batch asked in other layouts where this engine's layout lacks them
STATE_SAMPLES = 4


class LayerMapError(ValueError):
    """The pipeline stages' layers do not make up one model's."""


def whole_model_layers(spec: ModelSpec, stages: dict[int, Sequence[Sequence[str]]]) -> ModelLayers:
    """The whole model's layers from each pipeline stage's (by PP rank, per group, as its
    workers report them): per group, the stages' layers in stage order (vLLM groups the whole
    model's layers so, and gives each stage its own). Raises :class:`LayerMapError` unless
    every stage of ``spec.pp_size`` reported, each with every group."""
    if sorted(stages) != list(range(spec.pp_size)):
        raise LayerMapError(f"layers of stages {sorted(stages)}, expected 0..{spec.pp_size - 1}")
    for rank, groups in stages.items():
        if len(groups) != len(spec.groups):
            raise LayerMapError(f"stage {rank}: {len(groups)} groups, expected {len(spec.groups)}")
    ranks = sorted(stages)
    names = tuple(tuple(n for rank in ranks for n in stages[rank][g]) for g in range(len(spec.groups)))
    return ModelLayers(spec.grid.num_layers, names, spec.grid.indexed)


class HybridOffloadPlanner:
    """Maps token prefixes to page keys and decides the longest loadable prefix."""

    def __init__(
        self, spec: ModelSpec, chunk_tokens: int | None = None, key: bytes | None = None,
        hybrid_alignment: int = 0,
    ) -> None:  # fmt: skip
        """``key``: the cache's secret (keyed chain hashes); None for sha256.
        ``hybrid_alignment``: see :func:`default_chunk_tokens` (used without ``chunk_tokens``)."""
        if chunk_tokens is not None and chunk_tokens <= 0:
            raise PlannerConfigError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.spec = spec
        default = default_chunk_tokens(spec.groups, spec.max_model_len, hybrid_alignment)
        self.chunk_tokens = chunk_tokens or default
        self.plans = tuple(_plan_group(g, self.chunk_tokens, spec.max_model_len) for g in spec.groups)
        self.namespace = spec.fingerprint
        self._key = key
        #: piece keys by page-set key: lookups ask every tier, and again each step a request waits
        self._piece_keys: dict[tuple[str, int, tuple[int, ...]], list[str]] = {}
        self._pieces: dict[tuple[int, tuple[int, ...]], list[Piece]] = {}
        self._tails: dict[tuple[int, Piece], bytes] = {}  # per (group, piece): see piece_key
        #: the whole model's layers (a pipeline stage's scheduler: once every stage reported)
        self.model: ModelLayers | None = None
        self.layouts: list[tuple[int, ...]] = []
        self._stages = [1 for _ in spec.groups]
        #: whether the whole model's layers are known (always at PP=1): only then do lookups
        #: and stores make sense in the scheduler
        self.whole_model = False
        if spec.pp_size == 1:
            self.set_model_layers(ModelLayers(spec.grid.num_layers, tuple(g.layer_names for g in spec.groups),
                                              spec.grid.indexed))  # fmt: skip

    # ---- keys -------------------------------------------------------------------------
    def scope_seed(self, scope: bytes = b"") -> bytes:
        """The chain seed: fingerprint plus a request scope (see ``connector.scope``)."""
        data = self.spec.fingerprint_bytes + b"\x00" + scope
        return hmac.digest(self._key, data, "sha256") if self._key else hashlib.sha256(data).digest()

    def chain(
        self, prev: bytes, token_ids: Sequence[int], extras: Mapping[int, bytes] | None = None, first: int = 0
    ) -> list[bytes]:
        """Hashes of the full chunks of ``token_ids`` following chain hash (or seed) ``prev``, the
        first of them chunk ``first`` (see :func:`chain_chunk_hashes` for ``extras``)."""
        return chain_chunk_hashes(prev, token_ids, self.chunk_tokens, self._key, extras, first)

    def chunk_hashes(self, token_ids: Sequence[int], scope: bytes = b"") -> list[bytes]:
        return self.chain(self.scope_seed(scope), token_ids)

    def page_key(self, chunk_hash: bytes, group_index: int) -> str:
        """Name of one (chunk, group) page set: ``<fingerprint>-<digest>``; its pages are stored
        under :meth:`piece_keys`."""
        return f"{self.namespace}-{_set_digest(chunk_hash, group_index)}"

    def group_keys(self, chunk_hashes: Sequence[bytes]) -> list[list[str]]:
        """Page-set keys per group (outer) per chunk (inner)."""
        return [[self.page_key(h, p.index) for h in chunk_hashes] for p in self.plans]

    # ---- pieces: layer parts x TP shards ------------------------------------------------
    def pieces(self, group_index: int, layout: tuple[int, ...] | None = None) -> list[Piece]:
        """The pieces of a page set of ``group_index`` in ``layout`` (default: this engine's):
        of every part holding some of the group's layers, every shard, in order. Needs the
        whole model's layers."""
        assert self.model is not None, "the whole model's layers are not known"
        layout = layout or self.spec.grid.layout
        known = self._pieces.get((group_index, layout))
        if known is None:
            shards = self.plans[group_index].group.shards
            known = self._pieces[(group_index, layout)] = [
                Piece(start, end, layers_digest(self.model.names(group_index, (start, end))), s)
                for start, end in self.model.ranges(group_index, layout)
                for s in range(shards)
            ]
        return known

    def piece_key(self, page_key: str, group_index: int, piece: Piece) -> str:
        """Backend key of one piece of a page set (the same at every PP and TP size); per page
        on the data path, so what depends on the piece alone is made once."""
        tail = self._tails.get((group_index, piece))
        if tail is None:
            shards = self.plans[group_index].group.shards
            tail = self._tails[(group_index, piece)] = _piece_tail(piece.start, piece.end, piece.digest,
                                                                   piece.shard, shards)  # fmt: skip
        namespace, _, digest = page_key.partition("-")
        return f"{namespace}-{_short_digest(bytes.fromhex(digest) + tail)}"

    def piece_keys(self, page_key: str, group_index: int, layout: tuple[int, ...] | None = None) -> list[str]:
        """Backend keys of every piece of a page set in ``layout``, in :meth:`pieces` order."""
        layout = layout or self.spec.grid.layout
        known = self._piece_keys.get((page_key, group_index, layout))
        if known is None:
            known = [self.piece_key(page_key, group_index, p) for p in self.pieces(group_index, layout)]
            if len(self._piece_keys) >= MAX_MEMO_KEYS:
                self._piece_keys.clear()  # a bound, not an LRU: single dict ops are thread-safe
            self._piece_keys[(page_key, group_index, layout)] = known
        return list(known)

    def set_model_layers(self, model: ModelLayers, stages: Sequence[Sequence[Sequence[str]]] = ()) -> None:
        """The whole model's layers (``stages``: each pipeline stage's, per group, to count the
        stages writing each group): from then on page sets cover every stage's parts and other
        layouts' pages are looked for. Raises :class:`LayerMapError` (changing nothing) where
        a layer cannot be placed, or ``model`` has another number of groups."""
        if len(model.groups) != len(self.plans):
            raise LayerMapError(f"{len(model.groups)} groups, expected {len(self.plans)}")
        own, layouts, skipped = self.spec.grid.layout, [], None
        for layout in model.layouts(own):
            try:
                for g in range(len(self.plans)):
                    model.ranges(g, layout)
            except LayerPartError as exc:
                if layout == own:
                    raise LayerMapError(str(exc)) from None
                skipped = exc
                continue
            layouts.append(layout)
        if skipped is not None:
            logger.warning("hybrid-offload: pages of other pipeline layouts are not looked for: %s", skipped)
        self.model, self.layouts = model, layouts
        if stages:
            self._stages = [max(1, sum(bool(stage[g]) for stage in stages)) for g in range(len(self.plans))]
        self._pieces = {}
        self._piece_keys.clear()
        self.whole_model = True

    def writers(self, group_index: int) -> int:
        """Workers that write pieces of a page set of ``group_index``: the TP ranks that write
        a shard, in every stage holding some of its layers."""
        g, spec = self.plans[group_index].group, self.spec
        ranks = sum(bool(shards_written(g.splits, g.shards, spec.tp_size, r)) for r in range(spec.tp_size))
        return max(1, ranks) * self._stages[group_index]

    def sets_contain(
        self,
        keys: Sequence[Sequence[str]],
        contains: Callable[[list[str]], list[bool]],
        chosen: dict[str, tuple[int, ...]] | None = None,
    ) -> Callable[[list[str]], list[bool]]:
        """Wrap a per-backend-key ``contains`` into one over page-set keys of ``keys`` (per
        group lists): a set is present when all of its pieces in one layout are.

        This engine's layout is asked first. For the sets missing there, the first piece of the
        first of each group (of a state group, up to :data:`STATE_SAMPLES`: states are stored at
        some boundaries only) is asked in every other candidate layout; the layouts where one is
        found are then asked for every piece of the rest (up to :data:`LAYOUT_ROUNDS` times): a
        cold miss costs one more call, of a key per sample and layout. ``chosen`` receives the
        layout of each set found in another layout."""
        group_of = {key: g for g, group_keys in enumerate(keys) for key in group_keys}
        own = self.spec.grid.layout
        others = [layout for layout in self.layouts if layout != own]

        def ask(wanted: list[tuple[str, tuple[int, ...]]], first: bool = False) -> list[bool]:
            """Whether every piece (``first``: the first piece) of each set is present."""
            expanded = [self.piece_keys(k, group_of[k], layout)[: 1 if first else None]
                        for k, layout in wanted]  # fmt: skip
            flat = [k for pieces in expanded for k in pieces]
            answers = iter(contains(flat) if flat else [])
            return [bool(pieces) and all([next(answers) for _ in pieces]) for pieces in expanded]

        def contains_sets(set_keys: list[str]) -> list[bool]:
            present = dict(zip(set_keys, ask([(k, own) for k in set_keys]), strict=True))
            if chosen is not None:
                for k in (k for k in set_keys if present[k]):
                    chosen.pop(k, None)
            tried: set[tuple[str, tuple[int, ...]]] = set()
            for _ in range(LAYOUT_ROUNDS):
                missing = [k for k in set_keys if not present[k]]
                if not missing or not others:
                    break
                samples: dict[int, list[str]] = {}
                for k in missing:
                    g = group_of[k]
                    wanted = STATE_SAMPLES if self.plans[g].kind is GroupKind.MAMBA else 1
                    if len(samples.setdefault(g, [])) < wanted:
                        samples[g].append(k)
                probes = [(k, layout) for sample in samples.values() for k in sample for layout in others
                          if (k, layout) not in tried]  # fmt: skip
                tried.update(probes)
                hits = ask(probes, first=True)
                found = [layout for (_, layout), hit in zip(probes, hits, strict=True) if hit]
                if not found:
                    break
                for layout in dict.fromkeys(found):
                    rest = [k for k in set_keys if not present[k]]
                    for k, hit in zip(rest, ask([(k, layout) for k in rest]), strict=True):
                        if hit:
                            present[k] = True
                            if chosen is not None:
                                chosen[k] = layout
            return [present[k] for k in set_keys]

        return contains_sets

    # ---- coverage ---------------------------------------------------------------------
    def max_boundary_chunks(self, num_prompt_tokens: int) -> int:
        """Largest chunk count whose boundary stays strictly below the prompt length.

        vLLM recomputes at least the last prompt token, and a Mamba state loaded for N tokens
        then stepped again would be corrupted, so N < num_prompt_tokens always.
        """
        return max(0, (num_prompt_tokens - 1) // self.chunk_tokens)

    def needed_chunks(self, plan: GroupPlan, k: int, start_chunk: int) -> range:
        """Chunk indices of ``plan``'s pages needed to load boundary ``k`` (chunks) from
        ``start_chunk`` on (chunks before it are already in vLLM's cache)."""
        if plan.kind is GroupKind.MAMBA:
            return range(k - 1, k)
        if plan.kind is GroupKind.SLIDING_WINDOW:
            assert plan.window_chunks is not None
            return range(max(start_chunk, k - plan.window_chunks), k)
        return range(start_chunk, k)

    def group_allows(self, plan: GroupPlan, k: int, present: Sequence[bool], start_chunk: int) -> bool:
        """Whether ``plan``'s group can be restored at boundary ``k`` given its page presence."""
        return all(present[i] for i in self.needed_chunks(plan, k, start_chunk))

    def loadable_prefix(
        self,
        presence: Sequence[Sequence[bool]],
        num_prompt_tokens: int,
        start_tokens: int = 0,
    ) -> LoadablePrefix:
        """Largest boundary ``N`` (tokens, ``start_tokens < N < num_prompt_tokens``) that every
        group can restore, given ``presence[group][chunk]``; 0 if none.

        Full-attention coverage is prefix-monotone, so its bound is found by binary search; the
        other groups are then checked downward from that bound.
        """
        if start_tokens % self.chunk_tokens:
            start_tokens -= start_tokens % self.chunk_tokens
        start = start_tokens // self.chunk_tokens
        k_max = min(self.max_boundary_chunks(num_prompt_tokens), *(len(p) for p in presence))
        if k_max <= start:
            return LoadablePrefix(0, tuple(0 for _ in self.plans))
        bound = k_max
        for plan in self.plans:
            if plan.kind is GroupKind.FULL_ATTENTION:
                bound = min(bound, _longest_present_run(presence[plan.index], start, bound))
        per_group = tuple(self._group_bound(p, presence[p.index], start, k_max) for p in self.plans)
        k = bound
        while k > start and not all(self.group_allows(p, k, presence[p.index], start) for p in self.plans):
            k -= 1
        tokens = k * self.chunk_tokens if k > start else 0
        attention = bound * self.chunk_tokens if bound > start else 0
        return LoadablePrefix(tokens, per_group, attention)

    def _group_bound(self, plan: GroupPlan, present: Sequence[bool], start: int, k_max: int) -> int:
        for k in range(k_max, start, -1):
            if self.group_allows(plan, k, present, start):
                return k * self.chunk_tokens
        return 0

    def lookup(
        self,
        keys: Sequence[Sequence[str]],
        contains: Callable[[list[str]], list[bool]],
        num_prompt_tokens: int,
        start_tokens: int = 0,
        state_probes: int = 0,
    ) -> LoadablePrefix:
        """Ask ``contains`` about the candidate pages and compute the loadable prefix.

        ``state_probes`` 0: every candidate page in one call. Otherwise the other groups' pages
        first, then the state groups' pages (one per boundary) only at boundaries the others
        allow: the ``state_probes`` highest, then, if none of those restores, the rest. Same
        ``tokens`` and ``attention_tokens`` with far fewer keys (a state group has a page per
        chunk to ask, but one is loaded); ``per_group_tokens`` of a state group and the pages
        known present then stop at the boundaries asked."""
        k_max = min(self.max_boundary_chunks(num_prompt_tokens), *(len(k) for k in keys))
        start = start_tokens // self.chunk_tokens
        if k_max <= start:
            return LoadablePrefix(0, tuple(0 for _ in self.plans))
        states = [p for p in self.plans if p.kind is GroupKind.MAMBA] if state_probes > 0 else []
        others = [p for p in self.plans if p not in states]
        answers: dict[str, bool] = {}

        def ask(wanted: list[str]) -> None:
            if wanted:
                answers.update(zip(wanted, contains(wanted), strict=True))

        def presence() -> list[list[bool]]:
            return [[answers.get(k, False) for k in group_keys[:k_max]] for group_keys in keys]

        ask([key for plan in others for key in keys[plan.index][start:k_max]])
        if states:
            present, bound = presence(), k_max
            for plan in others:
                if plan.kind is GroupKind.FULL_ATTENTION:
                    bound = min(bound, _longest_present_run(present[plan.index], start, bound))
            allowed = [all(self.group_allows(p, k, present[p.index], start) for p in others)
                       for k in range(bound, start, -1)]  # fmt: skip
            candidates = [k for k, ok in zip(range(bound, start, -1), allowed, strict=True) if ok]
            for batch in (candidates[:state_probes], candidates[state_probes:]):
                ask([keys[p.index][k - 1] for k in batch for p in states])
                if any(all(answers[keys[p.index][k - 1]] for p in states) for k in batch):
                    break
        return self.loadable_prefix(presence(), num_prompt_tokens, start_tokens)

    # ---- worker-side positions --------------------------------------------------------
    def mamba_state_block_index(self, plan: GroupPlan, boundary_tokens: int) -> int:
        """Index in the request's block table of the block holding the state at a boundary:
        the block covering token ``boundary - 1`` (vLLM's running-state slot in align mode)."""
        if plan.unsplittable:
            return 0
        return (boundary_tokens - 1) // plan.group.block_size

    @property
    def has_state_groups(self) -> bool:
        """Whether some group restores a recurrent state (whose position must be a checkpoint)."""
        return any(p.kind is GroupKind.MAMBA for p in self.plans)


def _longest_present_run(present: Sequence[bool], start: int, limit: int) -> int:
    """Largest k in [start, limit] with present[start:k] all True, by binary search over the
    prefix-monotone predicate."""
    lo, hi = start, limit
    prefix_missing = np.cumsum(~np.asarray(present[:limit], dtype=bool)) if limit else np.zeros(0)
    base = prefix_missing[start - 1] if start > 0 else 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prefix_missing[mid - 1] - base == 0:
            lo = mid
        else:
            hi = mid - 1
    return lo
