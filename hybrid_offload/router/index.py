"""Which engine can restore how much of a prompt, from the engines' KV events.

The contract of our events: ``hybrid_offload/core/kv_events.py`` and docs/operations.md, "KV
events". The index keeps, per engine and *medium* (``GPU``: vLLM's own prefix cache, also when
an event says None; a tier's name for ours), the block hashes each KV cache group holds, and the
span of that group's blocks (``block_size``, per medium and group, from its first event).

* Media published with locality ``REMOTE`` are tiers several engines share: one *pool* per
  medium name, filled and emptied by every engine's events (a removal from any engine removes
  from the pool). An engine restores from a pooled medium once it published an event of it.
  ``GPU`` and ``LOCAL`` media (and those without locality, unless the name is pooled) belong to
  the publishing engine.
* Group kinds (``group_idx`` -> kind, window) are learned per engine from any event that carries
  ``kv_cache_spec_kind``; a group never named is attention. A pooled medium also brings the
  groups its events named.
* ``AllBlocksCleared`` empties that engine's GPU medium only; :meth:`CacheIndex.reset_engine`
  drops the engine's own media (its GPU and private tiers), never a pool.

A prefix of ``p`` tokens is *restorable* from a medium (:meth:`CacheIndex.restorable`) when
``p`` is a multiple of the hash block and of every attention group's span, every attention group
(``full_attention``, any other attention kind of vLLM's, or unknown) holds blocks ending at each
multiple of its span up to ``p``, a ``sliding_window`` (``_mla``) group those covering the last
``window`` tokens before ``p`` (all of them when the window is unknown), and every
``mamba`` group a block whose hash is the prompt's hash at ``p`` (a state checkpoint there):
attention without a state at its end restores nothing of a hybrid model. ``p`` is at most
``len(tokens) - 1`` (vLLM computes the last prompt token itself). A query hashes the prompt once
(outside the lock) and costs O(len(tokens) / hash_block_size) per group and medium.

Hashes are compared as vLLM's 64-bit ints: events carrying digest bytes
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) are reduced the same way, so both settings work.
Events hashed with extra keys (LoRA, multimodal, cache_salt) are kept but never match a prompt.
vLLM's hash block size is learned from the first event that starts a prefix, unless given.
All engines of one index must serve the same model (vLLM's hashes do not include it).

Memory is bounded: each (engine or pool, medium) keeps its ``max_blocks`` most recently stored
(group, hash) entries (LRU; about 150 bytes each). Thread-safe: one lock.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hybrid_offload.core.kv_events import REMOTE, external_hash
from hybrid_offload.router.events import Cleared, Event, Hash, Removed, Stored
from hybrid_offload.router.hashing import block_hashes, hash_function

logger = logging.getLogger(__name__)

GPU = "GPU"
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
MAMBA = "mamba"
#: (group, hash) entries kept per (engine or pool, medium)
MAX_BLOCKS = 1 << 20
#: a routing weight per restorable token of vLLM's GPU cache and of any other medium
GPU_WEIGHT = 1.0
TIER_WEIGHT = 0.9
#: first-block events tried before the hash block size is declared unlearnable
MAX_LEARN_TRIES = 16

Scope = str | None  # an engine, or None: the pool of a shared medium


@dataclass
class _Medium:
    """One (scope, medium): ``(group << 64) | hash`` -> None in LRU order; spans per group."""

    entries: OrderedDict[int, None] = field(default_factory=OrderedDict)
    spans: dict[int, int] = field(default_factory=dict)
    kinds: dict[int, tuple[str, int | None]] = field(default_factory=dict)


def _key(group: int, h: Hash) -> int:
    """An entry's key: the group, and the hash as vLLM's 64-bit int (digest bytes reduced)."""
    if not isinstance(h, int):
        h = external_hash(h)  # a digest as vLLM's int
    return (group << 64) | h


class CacheIndex:
    """Events in (:meth:`apply`), restorable prefixes out (:meth:`restorable`, :meth:`best`,
    :meth:`route`).

    ``hash_block_size``: vLLM's (None: learned from the events); ``algo``: its
    ``prefix_caching_hash_algo``; ``seed``: its ``PYTHONHASHSEED`` (None: unset);
    ``max_blocks``: entries kept per (engine or pool, medium)."""

    def __init__(
        self,
        hash_block_size: int | None = None,
        algo: str = "sha256",
        seed: str | None = None,
        max_blocks: int = MAX_BLOCKS,
    ) -> None:
        hash_function(algo, seed)  # refuse an algorithm we cannot reproduce now, not at a query
        if hash_block_size is not None and hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
        self.algo, self.seed = algo, seed
        self._hbs = hash_block_size
        self._learn_tries = 0
        self._max = max_blocks
        self._lock = threading.Lock()
        self._media: dict[tuple[Scope, str], _Medium] = {}
        self._kinds: dict[str, dict[int, tuple[str, int | None]]] = {}  # engine -> group -> kind
        self._pooled: set[str] = set()  # media names published REMOTE
        self._attached: dict[str, set[str]] = {}  # engine -> pooled media it published
        self._turn = itertools.count()  # round robin among ties

    @property
    def hash_block_size(self) -> int | None:
        """vLLM's hash block size: given, or learned (None until then)."""
        return self._hbs

    # ---- events -------------------------------------------------------------------------
    def apply(self, engine: str, events: Iterable[Event]) -> None:
        """Apply ``engine``'s events in order."""
        with self._lock:
            for event in events:
                if isinstance(event, Stored):
                    self._stored(engine, event)
                elif isinstance(event, Removed):
                    self._removed(engine, event)
                elif isinstance(event, Cleared):
                    self._media.pop((engine, GPU), None)

    def reset_engine(self, engine: str) -> None:
        """Forget what ``engine`` holds itself (its GPU cache, its private tiers): it restarted,
        or its event stream lost batches. Pools keep their blocks; the group kinds stay."""
        with self._lock:
            for key in [k for k in self._media if k[0] == engine]:
                del self._media[key]

    def _scope(self, engine: str, medium: str, locality: str | None) -> Scope:
        if medium == GPU or not (locality == REMOTE or (locality is None and medium in self._pooled)):
            return engine
        self._pooled.add(medium)
        self._attached.setdefault(engine, set()).add(medium)
        return None

    def _stored(self, engine: str, event: Stored) -> None:
        if not event.hashes or event.block_size <= 0:
            return
        group, medium = event.group_idx or 0, event.medium or GPU
        scope = self._scope(engine, medium, event.locality)
        store = self._media.get((scope, medium))
        if store is None:
            store = self._media[(scope, medium)] = _Medium()
        kinds = self._kinds.setdefault(engine, {})
        if event.kind is not None:
            kinds[group] = store.kinds[group] = (event.kind, event.sliding_window)
        else:
            kinds.setdefault(group, (FULL_ATTENTION, None))
        store.spans.setdefault(group, event.block_size)
        if self._hbs is None and event.parent is None and not event.has_extra_keys:
            self._learn(event)
        entries = store.entries
        for h in event.hashes:
            k = _key(group, h)
            entries[k] = None
            entries.move_to_end(k)
        while len(entries) > self._max:
            entries.popitem(last=False)

    def _removed(self, engine: str, event: Removed) -> None:
        medium = event.medium or GPU
        store = self._media.get((self._scope(engine, medium, event.locality), medium))
        if store is None:
            return
        groups = store.spans if event.group_idx is None else (event.group_idx,)
        for group in groups:
            for h in event.hashes:
                store.entries.pop(_key(group, h), None)

    def _learn(self, event: Stored) -> None:
        """vLLM's hash block size: the smallest divisor of the block size at which the chained
        hash of the event's tokens, at their end, is the one published."""
        n, size = len(event.token_ids), event.block_size
        if self._learn_tries >= MAX_LEARN_TRIES or n == 0 or n % size:
            return
        if len(event.hashes) == n // size:  # one hash per block: the first block's suffices
            tokens = event.token_ids[:size]
        elif len(event.hashes) == 1:  # vLLM's mamba align mode: one hash, at the tokens' end
            tokens = event.token_ids
        else:
            return
        published = _key(0, event.hashes[0])
        for d in (d for d in range(1, size + 1) if size % d == 0):
            if _key(0, block_hashes(tokens, d, self.algo, self.seed)[-1]) == published:
                self._hbs = d
                return
        self._learn_tries += 1
        if self._learn_tries == 1:
            logger.warning(
                "KV events: no hash block size reproduces the engine's block hashes with "
                "prefix_caching_hash_algo %r and seed %r (check the engine's algorithm and its "
                "PYTHONHASHSEED); every prompt counts as restoring nothing", self.algo, self.seed,
            )  # fmt: skip

    # ---- queries ------------------------------------------------------------------------
    def prompt_hashes(self, tokens: Sequence[int]) -> list[int] | None:
        """The prompt's hashes as the index compares them (None: hash block size unknown)."""
        hbs = self._hbs
        if hbs is None:
            return None
        return [_key(0, h) for h in block_hashes(tokens, hbs, self.algo, self.seed)]

    def restorable(self, engine: str, tokens: Sequence[int]) -> dict[str, int]:
        """Per medium ``engine`` holds or reads, the longest prefix of ``tokens`` it can restore
        from it (0 for every medium while the hash block size is unknown)."""
        return self._restorable(engine, self.prompt_hashes(tokens), len(tokens))

    def _restorable(self, engine: str, chain: list[int] | None, n_tokens: int) -> dict[str, int]:
        with self._lock:
            media = {m for (s, m) in self._media if s == engine} | self._attached.get(engine, set())
            if chain is None:
                return dict.fromkeys(sorted(media), 0)
            kinds = self._kinds.get(engine, {})
            limit = n_tokens - 1
            return {m: self._prefix(self._store(engine, m), kinds, chain, limit) for m in sorted(media)}

    def _store(self, engine: str, medium: str) -> _Medium | None:
        own = self._media.get((engine, medium))
        return own if own is not None else self._media.get((None, medium))

    def _prefix(
        self, store: _Medium | None, engine_kinds: Mapping[int, tuple[str, int | None]],
        chain: list[int], limit: int,
    ) -> int:  # fmt: skip
        """The largest restorable ``p <= limit`` from ``store`` (the conditions: module docstring)."""
        assert self._hbs is not None
        if store is None:
            return 0
        hbs, entries = self._hbs, store.entries
        kinds = {**engine_kinds, **store.kinds}
        top = min(limit, len(chain) * hbs)

        def held(group: int, end: int) -> bool:
            return end > 0 and end % hbs == 0 and (group << 64 | chain[end // hbs - 1]) in entries

        step, reach = hbs, top
        windows: list[tuple[int, int, list[int]]] = []  # (span, window, run of blocks ending at k*span)
        states: list[int] = []
        for group, (kind, window) in kinds.items():
            span = store.spans.get(group)
            if span is None:  # a needed group this medium holds nothing of
                return 0
            if kind == MAMBA:
                states.append(group)
                continue
            step = math.lcm(step, span)
            if kind.startswith(SLIDING_WINDOW) and window:  # sliding_window, sliding_window_mla
                runs = [0]
                for k in range(1, top // span + 1):
                    runs.append(runs[-1] + 1 if held(group, k * span) else 0)
                windows.append((span, window, runs))
            else:  # attention: the contiguous run from 0
                end = 0
                while end + span <= reach and held(group, end + span):
                    end += span
                reach = end
        for p in range(reach - reach % step, 0, -step):
            if all(runs[p // span] * span >= min(p, window) for span, window, runs in windows) and all(
                held(group, p) for group in states
            ):
                return p
        return 0

    def best(self, tokens: Sequence[int], engines: Sequence[str]) -> list[tuple[str, str, int]]:
        """``(engine, medium, tokens restorable)`` for every medium of ``engines``, most tokens
        first (then in the order of ``engines`` and media names)."""
        chain = self.prompt_hashes(tokens)
        rows = [(e, m, t) for e in engines for m, t in self._restorable(e, chain, len(tokens)).items()]
        order = {e: i for i, e in enumerate(engines)}
        return sorted(rows, key=lambda r: (-r[2], order[r[0]], r[1]))

    def route(
        self,
        tokens: Sequence[int],
        engines: Sequence[str],
        weights: Mapping[str, float] | None = None,
        load: Mapping[str, float] | None = None,
    ) -> str:
        """The engine of ``engines`` with the most weighted restorable tokens (its best medium;
        ``weights`` per medium: ``GPU`` :data:`GPU_WEIGHT`, others :data:`TIER_WEIGHT` unless
        given). Ties go to the least ``load`` then the first in ``engines``; without ``load``,
        round robin over the tied engines."""
        if not engines:
            raise ValueError("route() needs at least one engine")
        chain = self.prompt_hashes(tokens)
        weight = {GPU: GPU_WEIGHT, **(weights or {})}

        def score(engine: str) -> float:
            media = self._restorable(engine, chain, len(tokens))
            return max((weight.get(m, TIER_WEIGHT) * t for m, t in media.items()), default=0.0)

        scores = [score(e) for e in engines]
        top = max(scores)
        tied = [e for e, s in zip(engines, scores, strict=True) if s == top]
        if load is not None:
            return min(tied, key=lambda e: load.get(e, 0))  # min keeps the first of equals
        return tied[next(self._turn) % len(tied)]
