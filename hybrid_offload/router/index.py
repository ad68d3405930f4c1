"""Which engine can restore how much of a prompt, from the engines' KV events.

The contract of our events: ``hybrid_offload/core/kv_events.py`` and docs/operations.md, "KV
events". The index keeps, per engine and *medium* (``GPU``: vLLM's own prefix cache, also when
an event says None; a tier's published name for ours), the block hashes each KV cache group
holds, and the span of that group's blocks (``block_size``, per medium and group, from its
first event).

* Media published with locality ``REMOTE`` are tiers several engines share: one *pool* per
  medium name, filled and emptied by every engine's events (a removal from any engine removes
  from the pool). Our events name a shared tier ``<tier name>@<store id>`` (the store's
  identity: :func:`hybrid_offload.core.kv_events.medium_name`), so two stores that share a
  tier name are two pools and one store seen by several engines is one. An engine restores
  from a pooled medium once it published an event of it. ``GPU`` and ``LOCAL`` media (and
  those without locality, unless the name is pooled) belong to the publishing engine.
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
``len(tokens) - 1`` (vLLM computes the last prompt token itself). A group whose span is no
multiple of the hash block restores nothing (vLLM's spans always are). A query hashes the prompt
once (outside the lock) and costs O(len(tokens) / hash_block_size) per group and medium.

Hashes are compared as vLLM's 64-bit ints: events carrying digest bytes
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) are reduced the same way, so both settings work.
Events hashed with extra keys (LoRA, multimodal, cache_salt) are kept but never match a prompt.
All engines of one index must serve the same model (vLLM's hashes do not include it).

**The hash block size** (vLLM's, needed to hash a prompt) is best given (``hash_block_size``):
then nothing is learned. Otherwise it is learned from vLLM's own GPU events only (medium
``GPU`` or None; ours and other tiers' teach nothing) that start a prefix (no parent, no extra
keys): the first such event of each applied batch votes for the divisor of its block size at
which the chained hash of its tokens is the one published (hashed outside the lock, at most
:data:`MAX_LEARN_TOKENS` tokens). The index takes the first vote, then the value that holds the
most of the last :data:`LEARN_WINDOW` votes (a change needs more votes than the current value:
``stats.relearned``, logged). So a forged event, or a flood of them, misleads routing only
until the engine's own batches outvote it again (at most ``LEARN_WINDOW // 2 + 1`` of them once
the forgery stops); an event no size reproduces (another algorithm or seed: warned once) votes
for nothing.

**Memory is bounded per holder** (a stream may be forged; issue 45 N6): each (engine or pool,
medium) keeps its ``max_blocks`` most recently stored (group, hash) entries (LRU; about 150
bytes each); an engine holds or reads at most ``max_media`` tier media besides its GPU (beyond
that its least recently published one is dropped: its own entries, or its share of a pool;
``stats.media_dropped``), so pools number at most ``max_media`` per engine (a pool no engine
reads any more is dropped); group indices are ``0 <= g < max_groups`` and names (medium, kind)
at most :data:`~hybrid_offload.router.events.MAX_NAME` characters (other events are refused:
``stats.events_refused``). Worst case per engine: ``(max_media + 1) * max_blocks`` entries.
Thread-safe: one lock.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hybrid_offload.core.kv_events import REMOTE, external_hash
from hybrid_offload.router.events import MAX_NAME, Cleared, Event, Hash, MalformedBatchError, Removed, Stored
from hybrid_offload.router.hashing import block_hashes, hash_function

logger = logging.getLogger(__name__)

GPU = "GPU"
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
MAMBA = "mamba"
#: (group, hash) entries kept per (engine or pool, medium)
MAX_BLOCKS = 1 << 20
#: tier media an engine holds or reads, besides its GPU (a config rarely has more than 4 tiers)
MAX_MEDIA = 8
#: group indices accepted: ``0 <= group_idx < MAX_GROUPS`` (vLLM's hybrid models have tens)
MAX_GROUPS = 128
#: a routing weight per restorable token of vLLM's GPU cache and of any other medium
GPU_WEIGHT = 1.0
TIER_WEIGHT = 0.9
#: learning the hash block size: votes kept, tokens hashed for one vote (at most that many
#: hashes), tokens of an event read
LEARN_WINDOW = 15
MAX_LEARN_TOKENS = 8192
MAX_LEARN_HASHES = 4096
MAX_LEARN_EVENT_TOKENS = 1 << 17

Holder = str | None  # an engine, or None: the pool of a shared medium


@dataclass
class IndexStats:
    """Counters, plain data: ``media_dropped`` (an engine's least recently published tier
    medium, beyond ``max_media``), ``events_refused`` (a group outside ``[0, max_groups)`` or
    a name too long), ``relearned`` (the learned hash block size changed), ``learn_failures``
    (GPU first-block events no hash block size reproduces)."""

    media_dropped: int = 0
    events_refused: int = 0
    relearned: int = 0
    learn_failures: int = 0


@dataclass
class _Medium:
    """One (holder, medium): ``(group << 64) | hash`` -> None in LRU order; spans per group."""

    entries: OrderedDict[int, None] = field(default_factory=OrderedDict)
    spans: dict[int, int] = field(default_factory=dict)
    kinds: dict[int, tuple[str, int | None]] = field(default_factory=dict)


def _key(group: int, h: Hash) -> int:
    """An entry's key: the group, and the hash as vLLM's 64-bit int (digest bytes reduced)."""
    value = h if isinstance(h, int) else external_hash(h)  # a digest as vLLM's int
    assert isinstance(value, int)
    return (group << 64) | value


def _divisors(n: int) -> list[int]:
    """``n``'s divisors, largest first (the cheapest to hash first)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def _lesson(event: Stored) -> list[int] | None:
    """The tokens whose chained hash, at their end, ``event`` publishes first (None: it teaches
    nothing: too many tokens, or not one hash per block nor vLLM's mamba align quirk)."""
    size = event.block_size
    try:
        n = len(event.token_ids)
        if n == 0 or n % size or n > MAX_LEARN_EVENT_TOKENS:
            return None
        if len(event.hashes) == n // size and size <= MAX_LEARN_TOKENS:  # the first block's suffices
            return list(event.token_ids[:size])
        if len(event.hashes) == 1 and n <= MAX_LEARN_TOKENS:  # vLLM's mamba align mode: one hash, at the end
            return list(event.token_ids)
    except MalformedBatchError:  # token ids that do not decode
        pass
    return None


class CacheIndex:
    """Events in (:meth:`apply`), restorable prefixes out (:meth:`restorable`, :meth:`best`,
    :meth:`route`).

    ``hash_block_size``: vLLM's (None: learned from the events); ``algo``: its
    ``prefix_caching_hash_algo``; ``seed``: its ``PYTHONHASHSEED`` (None: unset);
    ``max_blocks``: entries kept per (engine or pool, medium); ``max_media``: tier media per
    engine; ``max_groups``: group indices accepted (the bounds: module docstring)."""

    def __init__(
        self,
        hash_block_size: int | None = None,
        algo: str = "sha256",
        seed: str | None = None,
        max_blocks: int = MAX_BLOCKS,
        max_media: int = MAX_MEDIA,
        max_groups: int = MAX_GROUPS,
    ) -> None:
        hash_function(algo, seed)  # refuse an algorithm we cannot reproduce now, not at a query
        if hash_block_size is not None and hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
        if max_media < 1 or max_groups < 1:
            raise ValueError(f"max_media and max_groups must be positive, got {max_media}, {max_groups}")
        self.algo, self.seed = algo, seed
        self._hbs = hash_block_size
        self._given = hash_block_size is not None
        self._votes: deque[int] = deque(maxlen=LEARN_WINDOW)
        self._max, self._max_media, self._max_groups = max_blocks, max_media, max_groups
        self.stats = IndexStats()
        self._lock = threading.Lock()
        self._media: dict[tuple[Holder, str], _Medium] = {}
        self._kinds: dict[str, dict[int, tuple[str, int | None]]] = {}  # engine -> group -> kind
        self._views: dict[str, OrderedDict[str, None]] = {}  # engine -> tier media, LRU
        self._readers: dict[str, set[str]] = {}  # pooled medium -> engines that read it
        self._warned: set[str] = set()
        self._turn = itertools.count()  # round robin among ties

    @property
    def hash_block_size(self) -> int | None:
        """vLLM's hash block size: given, or learned (None until then)."""
        return self._hbs

    # ---- events -------------------------------------------------------------------------
    def apply(self, engine: str, events: Iterable[Event]) -> None:
        """Apply ``engine``'s events in order."""
        lesson: Stored | None = None
        with self._lock:
            for event in events:
                if isinstance(event, Stored):
                    if self._stored(engine, event) and lesson is None:
                        lesson = event
                elif isinstance(event, Removed):
                    self._removed(engine, event)
                elif isinstance(event, Cleared):
                    self._media.pop((engine, GPU), None)
        if lesson is not None:
            self._learn(lesson)

    def reset_engine(self, engine: str) -> None:
        """Forget what ``engine`` holds itself (its GPU cache, its private tiers): it restarted,
        or its event stream lost batches. Pools keep their blocks; the group kinds stay."""
        with self._lock:
            self._media.pop((engine, GPU), None)
            view = self._views.get(engine, OrderedDict[str, None]())
            for medium in [m for m in view if engine not in self._readers.get(m, ())]:
                del view[medium]
                self._media.pop((engine, medium), None)

    def _refused(self, why: str) -> None:
        self.stats.events_refused += 1
        self._warn_once("refused", "KV events: an event was refused (%s; stats.events_refused)", why)

    def _warn_once(self, kind: str, message: str, *args: object) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)

    def _valid(self, group: int | None, medium: str, kind: str | None) -> bool:
        if group is not None and not 0 <= group < self._max_groups:
            self._refused(f"group_idx {group} outside [0, {self._max_groups})")
        elif len(medium) > MAX_NAME or (kind is not None and len(kind) > MAX_NAME):
            self._refused(f"a medium or kind over {MAX_NAME} characters")
        else:
            return True
        return False

    def _holder(self, engine: str, medium: str, locality: str | None) -> Holder:
        if medium == GPU or not (locality == REMOTE or (locality is None and medium in self._readers)):
            return engine
        return None

    def _admit(self, engine: str, medium: str, holder: Holder) -> None:
        """``engine`` holds (or, ``holder`` None, reads) ``medium``, most recently of its tier
        media; beyond ``max_media`` the least recent one is dropped."""
        if medium == GPU:
            return
        if holder is None:
            self._readers.setdefault(medium, set()).add(engine)
        view = self._views.setdefault(engine, OrderedDict())
        if medium in view:
            view.move_to_end(medium)
            return
        view[medium] = None
        while len(view) > self._max_media:
            self._drop(engine, next(iter(view)))
            self.stats.media_dropped += 1
            self._warn_once(
                "media", "KV events of %s: over %d tier media; the least recently published is "
                "dropped (stats.media_dropped)", engine, self._max_media,
            )  # fmt: skip

    def _drop(self, engine: str, medium: str) -> None:
        """``engine`` no longer holds or reads ``medium``; a pool no engine reads is dropped."""
        self._views[engine].pop(medium, None)
        self._media.pop((engine, medium), None)
        readers = self._readers.get(medium)
        if readers is not None and engine in readers:
            readers.discard(engine)
            if not readers:
                del self._readers[medium]
                self._media.pop((None, medium), None)

    def _stored(self, engine: str, event: Stored) -> bool:
        """Apply ``event``; whether it may teach the hash block size (module docstring)."""
        if not event.hashes or event.block_size <= 0:
            return False
        group, medium = event.group_idx or 0, event.medium or GPU
        if not self._valid(event.group_idx, medium, event.kind):
            return False
        holder = self._holder(engine, medium, event.locality)
        self._admit(engine, medium, holder)
        store = self._media.get((holder, medium))
        if store is None:
            store = self._media[(holder, medium)] = _Medium()
        kinds = self._kinds.setdefault(engine, {})
        if event.kind is not None:
            kinds[group] = store.kinds[group] = (event.kind, event.sliding_window)
        else:
            kinds.setdefault(group, (FULL_ATTENTION, None))
        store.spans.setdefault(group, event.block_size)
        entries = store.entries
        for h in event.hashes:
            k = _key(group, h)
            entries[k] = None
            entries.move_to_end(k)
        while len(entries) > self._max:
            entries.popitem(last=False)
        return not self._given and medium == GPU and event.parent is None and not event.has_extra_keys

    def _removed(self, engine: str, event: Removed) -> None:
        medium = event.medium or GPU
        if not self._valid(event.group_idx, medium, None):
            return
        holder = self._holder(engine, medium, event.locality)
        store = self._media.get((holder, medium))
        if holder is None or store is not None:
            self._admit(engine, medium, holder)  # an engine that saw a pooled block go reads it
        if store is None:
            return
        groups = list(store.spans) if event.group_idx is None else (event.group_idx,)
        for group in groups:
            for h in event.hashes:
                store.entries.pop(_key(group, h), None)

    # ---- the hash block size --------------------------------------------------------------
    def _learn(self, event: Stored) -> None:
        """``event``'s vote (hashed outside the lock), then the value most recent votes hold."""
        tokens = _lesson(event)
        if tokens is None:
            return
        vote = self._vote(tokens, event.block_size, _key(0, event.hashes[0]))
        with self._lock:
            if vote is None:
                self.stats.learn_failures += 1
                if self._hbs is None:
                    self._warn_once(
                        "learn", "KV events: no hash block size reproduces the engine's block hashes "
                        "with prefix_caching_hash_algo %r and seed %r (check the engine's algorithm and "
                        "its PYTHONHASHSEED, or pass hash_block_size); every prompt counts as restoring "
                        "nothing", self.algo, self.seed,
                    )  # fmt: skip
                return
            self._votes.append(vote)
            counts = Counter(self._votes)
            best = max(counts, key=lambda d: (counts[d], d == self._hbs))
            if self._hbs is None:
                self._hbs = best
            elif best != self._hbs and counts[best] > counts[self._hbs]:
                logger.warning(
                    "KV events: the hash block size is now %d (was %d): %d of the last %d GPU "
                    "events agree", best, self._hbs, counts[best], len(self._votes),
                )  # fmt: skip
                self.stats.relearned += 1
                self._hbs = best

    def _vote(self, tokens: list[int], size: int, published: int) -> int | None:
        """The divisor of ``size`` at which the chained hash of ``tokens``, at their end, is
        ``published`` (the current value tried first, then the largest); None: none within
        :data:`MAX_LEARN_HASHES` hashes."""
        budget, current = MAX_LEARN_HASHES, self._hbs
        candidates = _divisors(size)
        if current in candidates:
            candidates.remove(current)
            candidates.insert(0, current)
        for d in candidates:
            cost = len(tokens) // d
            if cost > budget:
                continue
            budget -= cost
            if _key(0, block_hashes(tokens, d, self.algo, self.seed)[-1]) == published:
                return d
        return None

    # ---- queries ------------------------------------------------------------------------
    def prompt_hashes(self, tokens: Sequence[int]) -> list[int] | None:
        """The prompt's hashes as the index compares them (None: hash block size unknown)."""
        return self._chain(tokens)[0]

    def _chain(self, tokens: Sequence[int]) -> tuple[list[int] | None, int]:
        """The prompt's hashes and the hash block size they were taken at (None, 0: unknown)."""
        hbs = self._hbs
        if hbs is None:
            return None, 0
        return [_key(0, h) for h in block_hashes(tokens, hbs, self.algo, self.seed)], hbs

    def restorable(self, engine: str, tokens: Sequence[int]) -> dict[str, int]:
        """Per medium ``engine`` holds or reads, the longest prefix of ``tokens`` it can restore
        from it (0 for every medium while the hash block size is unknown)."""
        return self._restorable(engine, *self._chain(tokens), len(tokens))

    def _restorable(self, engine: str, chain: list[int] | None, hbs: int, n_tokens: int) -> dict[str, int]:
        with self._lock:
            media = set(self._views.get(engine, ()))
            if (engine, GPU) in self._media:
                media.add(GPU)
            if chain is None:
                return dict.fromkeys(sorted(media), 0)
            kinds = self._kinds.get(engine, {})
            limit = n_tokens - 1
            return {m: self._prefix(self._store(engine, m), kinds, chain, hbs, limit) for m in sorted(media)}

    def _store(self, engine: str, medium: str) -> _Medium | None:
        own = self._media.get((engine, medium))
        return own if own is not None else self._media.get((None, medium))

    @staticmethod
    def _prefix(
        store: _Medium | None, engine_kinds: Mapping[int, tuple[str, int | None]],
        chain: list[int], hbs: int, limit: int,
    ) -> int:  # fmt: skip
        """The largest restorable ``p <= limit`` from ``store`` (the conditions: module docstring)."""
        if store is None:
            return 0
        entries = store.entries
        kinds = {**engine_kinds, **store.kinds}
        top = min(limit, len(chain) * hbs)

        def held(group: int, end: int) -> bool:
            return end > 0 and end % hbs == 0 and (group << 64 | chain[end // hbs - 1]) in entries

        step, reach = hbs, top
        windows: list[tuple[int, int, int]] = []  # (group, span, window)
        states: list[int] = []
        for group, (kind, window) in kinds.items():
            span = store.spans.get(group)
            if span is None or span % hbs:  # a needed group this medium holds nothing of
                return 0
            if kind == MAMBA:
                states.append(group)
                continue
            step = math.lcm(step, span)
            if kind.startswith(SLIDING_WINDOW) and window:  # sliding_window, sliding_window_mla
                windows.append((group, span, window))
            else:  # attention: the contiguous run from 0
                end = 0
                while end + span <= reach and held(group, end + span):
                    end += span
                reach = end
        runs_of: list[tuple[int, int, list[int]]] = []  # (span, window, run of blocks ending at k*span)
        for group, span, window in windows:  # up to the attention's reach only
            runs = [0]
            for k in range(1, reach // span + 1):
                runs.append(runs[-1] + 1 if held(group, k * span) else 0)
            runs_of.append((span, window, runs))
        for p in range(reach - reach % step, 0, -step):
            if all(runs[p // span] * span >= min(p, window) for span, window, runs in runs_of) and all(
                held(group, p) for group in states
            ):
                return p
        return 0

    def best(self, tokens: Sequence[int], engines: Sequence[str]) -> list[tuple[str, str, int]]:
        """``(engine, medium, tokens restorable)`` for every medium of ``engines``, most tokens
        first (then in the order of ``engines`` and media names)."""
        chain, hbs = self._chain(tokens)
        rows = [(e, m, t) for e in engines for m, t in self._restorable(e, chain, hbs, len(tokens)).items()]
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
        ``weights`` per medium, or per tier name for a medium ``name@id``: ``GPU``
        :data:`GPU_WEIGHT`, others :data:`TIER_WEIGHT` unless given). Ties go to the least
        ``load`` then the first in ``engines``; without ``load``, round robin over the tied
        engines."""
        if not engines:
            raise ValueError("route() needs at least one engine")
        chain, hbs = self._chain(tokens)
        weight = {GPU: GPU_WEIGHT, **(weights or {})}

        def score(engine: str) -> float:
            media = self._restorable(engine, chain, hbs, len(tokens))
            return max((_weight(weight, m) * t for m, t in media.items()), default=0.0)

        scores = [score(e) for e in engines]
        top = max(scores)
        tied = [e for e, s in zip(engines, scores, strict=True) if s == top]
        if load is not None:
            return min(tied, key=lambda e: load.get(e, 0))  # min keeps the first of equals
        return tied[next(self._turn) % len(tied)]


def _weight(weights: Mapping[str, float], medium: str) -> float:
    """``medium``'s weight: its own, else its tier name's (``name@id``), else :data:`TIER_WEIGHT`."""
    if medium in weights:
        return weights[medium]
    return weights.get(medium.partition("@")[0], TIER_WEIGHT)
