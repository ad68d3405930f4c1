"""A production trace replayed through one tier at full scale, with our own retention code.

The trace (Mooncake format, :func:`~.trace_file.load_trace`) names each request's prompt by *hash ids*, one
per ``block`` tokens (512), equal ids meaning equal tokens. :class:`Replay` plays it request by
request through one tier of a given capacity, as our scheduler would with a chunk of ``block``
tokens, calling the code the connector runs, not a re-implementation of it:

* keys: :func:`~hybrid_offload.core.planner.chain_chunk_hashes` over the hash ids;
* lookup: :meth:`~hybrid_offload.core.planner.HybridOffloadPlanner.loadable_prefix` (all
  attention up to a boundary and a state there);
* which states are stored: :func:`~hybrid_offload.core.checkpoints.prefill_checkpoints` (the
  tail, the junction found by :class:`~hybrid_offload.connector.scheduler.sightings.ChunkSightings`),
  and states between them where prefill steps of ``step_tokens`` end
  (:func:`~hybrid_offload.core.checkpoints.interval_stop`, ``state_due``);
* the tier: :class:`~hybrid_offload.backends.lru_index.LruIndex` with the policy under test,
  refreshed deepest first when a request ends (the scheduler's ``TouchJob``).

Two bounds need the future, so they live here only: admission by an oracle (pages no later hit
uses are not stored) and :class:`NextUsePolicy` (Belady: evict what is used last).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from hybrid_offload.backends.lru_index import EvictionPolicy, LruIndex, LruPolicy
from hybrid_offload.backends.retention import ResumePointPolicy, Retention
from hybrid_offload.connector.scheduler.retention_hints import request_bytes
from hybrid_offload.connector.scheduler.sightings import ChunkSightings
from hybrid_offload.core.checkpoints import interval_stop, prefill_checkpoints, state_due
from hybrid_offload.core.planner import HybridOffloadPlanner, chain_chunk_hashes
from hybrid_offload.core.spec import GroupKind, GroupSpec, make_model_spec
from hybrid_offload.tools.bench.trace_file import TRACE_BLOCK_TOKENS, TraceRequest, session_ends

__all__ = ["Geometry", "NextUsePolicy", "Replay", "Rules", "Traffic", "unlimited", "uses_of"]


@dataclass(frozen=True)
class Geometry:
    """A model's page bytes: attention per token (all attention layers; a fraction where a
    chunk's pages carry headers) and one state set."""

    model: str
    attention_bytes_per_token: float
    state_bytes: int

    def chunk_bytes(self, chunk: int) -> int:
        return round(self.attention_bytes_per_token * chunk)


@dataclass(frozen=True)
class Rules:
    """How the store plan places states: ``dense`` puts one at every chunk boundary (the plain
    baseline); otherwise the connector's rules with ``interval`` (``checkpoint_interval_tokens``)
    and prefill steps of ``step_tokens`` (vLLM's ``max_num_batched_tokens``)."""

    interval: int = 1024
    step_tokens: int = 8192
    dense: bool = False


class Traffic:
    """The trace's requests keyed once: per request its chunk keys (hex of the chain hashes)
    and what a later request uses of it (for the bounds and the session hints)."""

    def __init__(self, requests: Sequence[TraceRequest], chunk: int = TRACE_BLOCK_TOKENS) -> None:
        self.chunk = chunk
        self.lengths = [r.input_length for r in requests]
        self.keys: list[list[str]] = []
        for r in requests:
            full = r.input_length // chunk
            hashes = chain_chunk_hashes(b"trace", r.hash_ids[:full], 1)
            self.keys.append([h.hex()[:32] for h in hashes])
        spec = make_model_spec(
            (
                GroupSpec(0, GroupKind.FULL_ATTENTION, chunk, ("attn",), page_bytes=chunk, num_kv_heads=1,
                          head_size=1),
                GroupSpec(1, GroupKind.MAMBA, chunk, ("mamba",), page_bytes=chunk, state_shapes=((1, 1),),
                          state_dtypes=("bfloat16",), mamba_cache_mode="align"),
            ),
            {"trace": True}, max_model_len=max(self.lengths, default=0) + chunk,
        )  # fmt: skip
        self.planner = HybridOffloadPlanner(spec, chunk_tokens=chunk)
        chunks = {k for keys in self.keys for k in keys}
        self.distinct_chunks = len(chunks)
        #: whether a later request extends each request's prompt (an application that keeps the
        #: session knows it): its full chunks begin a later request
        self.continues = [not ends for ends in session_ends(requests, chunk)]

    def __len__(self) -> int:
        return len(self.keys)

    def working_set(self, geometry: Geometry) -> int:
        """Bytes of every distinct chunk's attention and a state at every boundary."""
        return self.distinct_chunks * (geometry.chunk_bytes(self.chunk) + geometry.state_bytes)


def attention_key(chunk_key: str) -> str:
    return "a" + chunk_key


def state_key(chunk_key: str) -> str:
    return "s" + chunk_key


class NextUsePolicy(EvictionPolicy):
    """Belady's rule for the offline bound: the key whose next use is latest goes first (keys
    never used again first of all). ``uses`` lists each key's using request indices; ``now``
    is the request being played."""

    def __init__(self, uses: dict[str, list[int]]) -> None:
        self.uses = uses
        self.now = 0
        self._next: dict[str, int] = {}
        self._heap: list[tuple[int, int, str]] = []
        self._seq = itertools.count()

    def next_use(self, key: str) -> int:
        times = self.uses.get(key, ())
        i = bisect.bisect_right(times, self.now)
        return times[i] if i < len(times) else 1 << 60

    def _push(self, key: str) -> None:
        when = self._next[key] = self.next_use(key)
        heapq.heappush(self._heap, (-when, next(self._seq), key))

    def added(self, key: str) -> None:
        self._push(key)

    def used(self, key: str) -> None:
        self._push(key)

    def removed(self, key: str) -> None:
        del self._next[key]

    def clear(self) -> None:
        self._next.clear()
        self._heap.clear()

    def order(self) -> Iterator[str]:
        while self._heap:
            when, _, key = self._heap[0]
            if self._next.get(key) == -when:
                if -when <= self.now:  # its use passed (as a miss): find the next one
                    heapq.heappop(self._heap)
                    self._push(key)
                    continue
                yield key
                rest = sorted((-w, k) for k, w in self._next.items() if k != key)
                yield from (k for _, k in rest)
                return
            heapq.heappop(self._heap)


@dataclass
class Outcome:
    """What one replay served: tokens loaded, hits, and the tier's evictions."""

    served_tokens: int = 0
    hits: int = 0
    evictions: int = 0
    stored_bytes: int = 0
    #: served tokens per tier (the tier each request loaded from)
    served_by: list[int] = field(default_factory=list)


class Replay:
    """Plays :class:`Traffic` through a tier, or tiers in order (module docstring).

    ``policy``: the first tier's eviction policy; ``lower``: more tiers below it, (capacity,
    policy) each. Stores go to every tier that lacks the page (write-through, as the store plan
    sends them), a request loads from the tier with the longest loadable prefix (the first of
    equals) and, with ``promote``, puts what it loaded into the tiers above that one lacking it
    (deepest first, as the worker does), and every tier is refreshed deepest first. ``hints``:
    describe each page to a :class:`ResumePointPolicy` (``"sessions"``: also the session hint,
    weight 0 for a request no later request extends); ``admit``: a filter on keys (the oracle
    bound).
    """

    def __init__(
        self, traffic: Traffic, geometry: Geometry, capacity: int, rules: Rules,
        policy: EvictionPolicy | None = None, hints: str = "", admit: Callable[[str], bool] | None = None,
        lower: Sequence[tuple[int, EvictionPolicy | None]] = (), promote: bool = True,
    ) -> None:  # fmt: skip
        self.traffic = traffic
        self.promote = promote
        self.rules = rules
        self.policies = [p or LruPolicy() for p in (policy, *(p for _, p in lower))]
        capacities = (capacity, *(c for c, _ in lower))
        self.tiers: list[LruIndex[None]] = [
            LruIndex(c, p) for c, p in zip(capacities, self.policies, strict=True)
        ]
        self.hints = hints
        self.admit = admit
        self.geometry = geometry
        self.sizes = {"a": geometry.chunk_bytes(traffic.chunk), "s": geometry.state_bytes}
        self.sightings = ChunkSightings(capacity=1 << 40)
        self.outcome = Outcome(served_by=[0] * len(self.tiers))
        self._request_bytes = 0
        #: per request, the boundary (chunks) it loaded
        self.hit_chunks: list[int] = []

    def run(self) -> Outcome:
        for i in range(len(self.traffic)):
            for policy in self.policies:
                if isinstance(policy, NextUsePolicy):
                    policy.now = i
            self.request(i)
        return self.outcome

    # ---- one request --------------------------------------------------------------------
    def request(self, i: int) -> None:
        traffic, chunk = self.traffic, self.traffic.chunk
        keys, n = traffic.keys[i], traffic.lengths[i]
        hashes = [bytes.fromhex(k) for k in keys]
        self.sightings.see(hashes)
        k_max = min(traffic.planner.max_boundary_chunks(n), len(keys))
        found = [traffic.planner.loadable_prefix([[attention_key(k) in tier for k in keys[:k_max]],
                                                  [state_key(k) in tier for k in keys[:k_max]]], n)
                 for tier in self.tiers]  # fmt: skip
        best = max(range(len(found)), key=lambda t: (found[t].tokens, -t))
        served = found[best].tokens
        loaded = served // chunk
        self.hit_chunks.append(loaded)
        if loaded:
            self.outcome.served_tokens += served
            self.outcome.served_by[best] += served
            self.outcome.hits += 1
            source = self.tiers[best]
            for k in keys[:loaded]:
                source.touch(attention_key(k))
            source.touch(state_key(keys[loaded - 1]))
        limit = k_max * chunk
        shared = self.sightings.shared_chunks(hashes, loaded) * chunk
        attention = max(f.attention_tokens for f in found)
        reach = max(min(attention, limit), min(shared, limit))
        checkpoints = prefill_checkpoints(n, chunk, reach if reach > served else 0)
        geo = self.geometry
        self._request_bytes = request_bytes(n - served, len(checkpoints), geo.attention_bytes_per_token,
                                            geo.state_bytes)  # fmt: skip
        if loaded and best and self.promote:  # what the load read, also the state, deepest first
            stored = self._request_bytes
            self._request_bytes += request_bytes(served, 1, geo.attention_bytes_per_token, geo.state_bytes)
            self._put(state_key(keys[loaded - 1]), keys, loaded - 1, i, state=True, upto=best)
            for c in reversed(range(loaded)):
                self._put(attention_key(keys[c]), keys, c, i, state=False, upto=best)
            self._request_bytes = stored
        states = self._prefill(i, keys, n, served, checkpoints, limit)
        for tier in self.tiers:  # the scheduler's TouchJob: deepest first
            for c in reversed(range(len(keys))):
                if c + 1 in states or c + 1 == loaded:
                    tier.touch(state_key(keys[c]))
                tier.touch(attention_key(keys[c]))

    def _prefill(self, i: int, keys: list[str], n: int, served: int, checkpoints: list[int],
                 limit: int) -> set[int]:  # fmt: skip
        """Steps of the prefill from ``served``: the attention chunks each completes, then the
        state at its end where one is due. The boundaries (chunks) whose state was stored."""
        chunk, rules = self.traffic.chunk, self.rules
        pos, last = served, (served or None)
        stored: set[int] = set()
        while pos < n:
            end = min(pos + rules.step_tokens, n)
            inside = [c for c in checkpoints if pos < c < end]
            if inside:
                end = inside[0]
            elif checkpoints and end <= checkpoints[-1] and not rules.dense:
                end = interval_stop(pos, end, last if last is not None else pos, rules.interval, chunk)
            for c in range(pos // chunk, min(end // chunk, len(keys))):
                self._put(attention_key(keys[c]), keys, c, i, state=False)
            if rules.dense:
                due = [b for b in range(max(pos // chunk, 0) + 1, end // chunk + 1) if b * chunk <= limit]
            else:
                due = [end // chunk] if end % chunk == 0 and end <= limit and state_due(
                    end, checkpoints, last, rules.interval) else []  # fmt: skip
            for b in due:
                if self._put(state_key(keys[b - 1]), keys, b - 1, i, state=True):
                    stored.add(b)
                last = b * chunk
            pos = end
        return stored

    def _put(self, key: str, keys: list[str], c: int, i: int, state: bool, upto: int | None = None) -> bool:
        """Put ``key`` into every tier lacking it (of the first ``upto``); whether the first
        tier holds it."""
        if self.admit is not None and not self.admit(key):
            return False
        size = self.sizes[key[0]]
        for tier, policy in list(zip(self.tiers, self.policies, strict=True))[:upto]:
            if key in tier:
                continue
            if self.hints and isinstance(policy, ResumePointPolicy):
                ends = self.hints == "sessions" and not self.traffic.continues[i]
                parent = attention_key(keys[c]) if state else (attention_key(keys[c - 1]) if c else "")
                policy.describe(key, Retention(key, parent, state, 0.0 if ends else 1.0, self._request_bytes))
            evicted = tier.put(key, size, None)
            if evicted is not None:
                self.outcome.evictions += len(evicted)
                self.outcome.stored_bytes += size
        return key in self.tiers[0]


def uses_of(traffic: Traffic, hit_chunks: Sequence[int]) -> dict[str, list[int]]:
    """The request indices that load each key, from a replay's hits (ascending)."""
    uses: dict[str, list[int]] = {}
    for i, loaded in enumerate(hit_chunks):
        if loaded:
            keys = traffic.keys[i]
            for k in keys[:loaded]:
                uses.setdefault(attention_key(k), []).append(i)
            uses.setdefault(state_key(keys[loaded - 1]), []).append(i)
    return uses


def unlimited(traffic: Traffic, geometry: Geometry, rules: Rules) -> Replay:
    """The replay with a tier that never evicts (what every bound is measured against)."""
    replay = Replay(traffic, geometry, math.inf, rules)  # type: ignore[arg-type]
    replay.run()
    return replay
