"""Which engine can restore how much of a prompt, from KV events (docs/operations.md, "KV events").

Per engine and medium (``GPU`` for vLLM's own prefix cache, a tier's name for ours), the block
hashes each KV cache group holds. Media published with locality ``REMOTE`` are tiers several
engines share: their blocks are pooled, and an engine can restore from a pooled medium it has
published itself (it is attached to it). A prompt's prefix of ``p`` tokens is *restorable* from a
medium when every attention group holds blocks covering ``[0, p)`` (a sliding-window group the
last window before ``p``) and every state (``mamba``) group holds a block ending exactly at ``p``:
attention without a state at its end restores nothing of a hybrid model.

Group kinds are learned per engine from events that carry ``kv_cache_spec_kind`` (a group never
named is taken for attention). vLLM's hash block size is learned from the first block that
starts a prefix, unless given. Memory is bounded: each (engine or pool, medium, group) keeps
its newest ``max_blocks`` hashes. Thread-safe (one lock).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hybrid_offload.core.kv_events import REMOTE, KVEventsSpec
from hybrid_offload.router.events import Cleared, Event, Hash, Removed, Stored
from hybrid_offload.router.hashing import block_hashes, hash_function

logger = logging.getLogger(__name__)

GPU = "GPU"
MAMBA = "mamba"
SLIDING_WINDOW = "sliding_window"
#: hashes kept per (engine or pool, medium, group)
MAX_BLOCKS = 1 << 20
#: weight of a token restorable from vLLM's GPU cache vs from a tier (``route``)
DEFAULT_WEIGHTS = {GPU: 1.0}
TIER_WEIGHT = 0.9
_POOL = "\x00pool"


@dataclass
class _Blocks:
    span: int
    hashes: OrderedDict[Hash, None]


class CacheIndex:
    """Events in (:meth:`apply`), restorable prefixes out (:meth:`restorable`, :meth:`route`).

    ``hash_block_size``: vLLM's (None: learned); ``algo``/``seed``: its
    ``prefix_caching_hash_algo`` and ``PYTHONHASHSEED`` (None: unset); ``int_hashes``: events
    carry 64-bit ints (vLLM's default)."""

    def __init__(
        self,
        hash_block_size: int | None = None,
        algo: str = "sha256",
        seed: str | None = None,
        int_hashes: bool = True,
        max_blocks: int = MAX_BLOCKS,
    ) -> None:
        hash_function(algo)  # refuse an algorithm we cannot reproduce now, not at the first query
        self.algo, self.seed, self.int_hashes = algo, seed, int_hashes
        self._spec = KVEventsSpec(hash_block_size, int_hashes) if hash_block_size else None
        self._unlearnable = False
        self._max = max_blocks
        self._lock = threading.Lock()
        self._blocks: dict[tuple[str, str, int], _Blocks] = {}  # (scope, medium, group)
        self._kinds: dict[str, dict[int, tuple[str, int | None]]] = {}  # engine -> group -> (kind, window)
        self._pooled: dict[str, set[str]] = {}  # engine -> pooled media it published

    @property
    def hash_block_size(self) -> int | None:
        return None if self._spec is None else self._spec.hash_block_size

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
                    self._drop(lambda scope, medium, _g: scope == engine and medium == GPU)

    def reset_engine(self, engine: str) -> None:
        """Forget what ``engine`` holds itself (its GPU cache, its private tiers): it restarted
        or its stream lost events. Pooled tiers keep their blocks."""
        with self._lock:
            self._drop(lambda scope, _m, _g: scope == engine)

    def _drop(self, which) -> None:  # type: ignore[no-untyped-def]
        for key in [k for k in self._blocks if which(*k)]:
            del self._blocks[key]

    def _scope(self, engine: str, medium: str, locality: str | None) -> str:
        if locality == REMOTE and medium != GPU:
            self._pooled.setdefault(engine, set()).add(medium)
            return _POOL
        return engine

    def _stored(self, engine: str, event: Stored) -> None:
        if not event.hashes or event.block_size <= 0:
            return
        group = event.group or 0
        if event.kind is not None:
            self._kinds.setdefault(engine, {})[group] = (event.kind, event.sliding_window)
        else:
            self._kinds.setdefault(engine, {}).setdefault(group, ("full_attention", None))
        if self._spec is None and event.parent is None:
            self._learn(event)
        medium = event.medium or GPU
        key = (self._scope(engine, medium, event.locality), medium, group)
        blocks = self._blocks.get(key)
        if blocks is None:
            blocks = self._blocks[key] = _Blocks(event.block_size, OrderedDict())
        for h in event.hashes:
            blocks.hashes[h] = None
            blocks.hashes.move_to_end(h)
        while len(blocks.hashes) > self._max:
            blocks.hashes.popitem(last=False)

    def _removed(self, engine: str, event: Removed) -> None:
        medium = event.medium or GPU
        scope = self._scope(engine, medium, event.locality)
        for (s, m, g), blocks in self._blocks.items():
            if s == scope and m == medium and (event.group is None or g == event.group):
                for h in event.hashes:
                    blocks.hashes.pop(h, None)

    def _learn(self, event: Stored) -> None:
        """vLLM's hash block size: the divisor of a first block's length whose chained hash at
        the block's end is the one published."""
        if self._unlearnable:
            return
        n = len(event.token_ids)
        for size in (d for d in range(1, n + 1) if n % d == 0):
            spec = KVEventsSpec(size, self.int_hashes)
            chain = block_hashes(event.token_ids, size, self.algo, self.seed)
            if chain and spec.external(chain[-1]) == event.hashes[-1]:
                self._spec = spec
                return
        if n:
            self._unlearnable = True
            logger.warning(
                "KV events: no hash block size reproduces the engine's hashes with %s (seed %s); "
                "check the engine's prefix_caching_hash_algo and PYTHONHASHSEED",
                self.algo, self.seed,
            )

    # ---- queries ------------------------------------------------------------------------
    def restorable(self, engine: str, tokens: Sequence[int]) -> dict[str, int]:
        """Per medium ``engine`` can read, the longest prefix of ``tokens`` it can restore from
        it (at most ``len(tokens) - 1``: vLLM computes the last prompt token itself)."""
        spec = self._spec
        if spec is None:
            return {}
        prompt = [spec.external(h) for h in block_hashes(tokens, spec.hash_block_size, self.algo, self.seed)]
        with self._lock:
            kinds = self._kinds.get(engine, {})
            media = {m for (s, m, _g) in self._blocks if s == engine}
            media |= self._pooled.get(engine, set())
            return {m: self._prefix(engine, m, kinds, prompt, len(tokens) - 1) for m in sorted(media)}

    def _prefix(
        self, engine: str, medium: str, kinds: Mapping[int, tuple[str, int | None]],
        prompt: list[Hash], limit: int,
    ) -> int:
        assert self._spec is not None
        hbs = self._spec.hash_block_size
        scope = _POOL if medium in self._pooled.get(engine, ()) else engine
        limit = min(limit, len(prompt) * hbs)
        empty = _Blocks(hbs, OrderedDict())
        groups = {g: (self._blocks.get((scope, medium, g)) or empty, kind, window)
                  for g, (kind, window) in kinds.items()}  # fmt: skip
        if not groups:
            return 0

        def held(blocks: _Blocks, end: int) -> bool:
            return end % hbs == 0 and 0 < end <= len(prompt) * hbs and prompt[end // hbs - 1] in blocks.hashes

        reach = limit
        for blocks, kind, _window in groups.values():
            if kind not in (MAMBA, SLIDING_WINDOW):  # attention: the contiguous run from 0
                end = 0
                while end + blocks.span <= limit and held(blocks, end + blocks.span):
                    end += blocks.span
                reach = min(reach, end)
        for p in range(reach - reach % hbs, 0, -hbs):
            if all(self._holds_at(blocks, kind, window, p, held) for blocks, kind, window in groups.values()):
                return p
        return 0

    @staticmethod
    def _holds_at(blocks: _Blocks, kind: str, window: int | None, p: int, held) -> bool:  # type: ignore[no-untyped-def]
        if p % blocks.span:
            return False
        if kind == MAMBA:
            return held(blocks, p)
        if kind == SLIDING_WINDOW:
            start = max(0, p - (window or p))
            return all(held(blocks, q) for q in range(p, start, -blocks.span))
        return True  # attention: checked as the reach

    def route(
        self,
        tokens: Sequence[int],
        engines: Sequence[str],
        weights: Mapping[str, float] | None = None,
        load: Mapping[str, int] | None = None,
    ) -> str:
        """The engine of ``engines`` with the most weighted restorable tokens (``weights`` per
        medium: GPU 1.0, tiers 0.9 by default); ties go to the least ``load``, then the order."""
        if not engines:
            raise ValueError("route() needs at least one engine")
        weights = {**DEFAULT_WEIGHTS, **(weights or {})}
        load = load or {}

        def score(engine: str) -> tuple[float, int]:
            media = self.restorable(engine, tokens)
            best = max((weights.get(m, TIER_WEIGHT) * t for m, t in media.items()), default=0.0)
            return best, -load.get(engine, 0)

        return max(engines, key=score)
