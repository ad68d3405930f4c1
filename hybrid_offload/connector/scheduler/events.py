"""KV events for what our tiers gain and lose (the contract: :mod:`hybrid_offload.core.kv_events`).

Scheduler thread only. Two levels:

* **Page sets.** The store planner tells :class:`TierEvents` which sets it sent to which tiers
  (:meth:`~TierEvents.planned`); the workers' reports say which pieces each tier stored and
  evicted. A set is in a tier once every piece of it (all stages' parts, all shards) is reported
  stored there; it leaves when a piece is reported evicted, or when a lookup asks the tier for
  it and the tier does not have it (shared tiers evict without telling anyone).
* **Blocks**, what events name: ``S`` tokens ending on a position where both our chunks and
  vLLM's hashes end. An attention group's block is in a tier when the sets of all its chunks
  are; a state group's block is the one set of the state at its end. A block is published
  (``BlockStored``) when it comes into a tier and removed (``BlockRemoved``) when it leaves.

vLLM takes the events with :meth:`~TierEvents.take` and publishes them next to its own. Only
sets this engine stored are published, each time it stores them again after a loss. What is
remembered is bounded (LRU): a set or block forgotten is not published as removed. A tier other
engines read is published as ``<name>@<store id>`` (:func:`published_medium`); a block carries
vLLM's ``extra_keys`` for its tokens (a LoRA name, a ``cache_salt``), as vLLM's own events do
(without token ids, the salt hidden: :func:`event_extra_keys`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

from hybrid_offload.core.kv_events import (
    LOCAL,
    MAX_PUBLISHED_SETS,
    OWNERSHIP,
    REMOTE,
    KVEventsSpec,
    medium_name,
)
from hybrid_offload.core.planner import HybridOffloadPlanner
from hybrid_offload.core.spec import GroupKind

if TYPE_CHECKING:
    from hybrid_offload.backends import BackendConfig
    from hybrid_offload.connector.metadata import PageJob
    from hybrid_offload.connector.scheduler.request_state import RequestState


def published_medium(backend: BackendConfig, shared: bool) -> str:
    """The ``medium`` of a tier's events: its name, or for a tier other engines read too
    (``shared``) ``<name>@<store id>`` (:func:`~hybrid_offload.core.kv_events.medium_name`)."""
    return medium_name(backend.name, backend.type, backend.options) if shared else backend.name


@dataclass(frozen=True)
class _Keyed:
    """What vLLM's ``generate_block_hash_extra_keys`` reads of a request (its per-block digests
    of prompt embeddings: the request's own cache of them)."""

    lora_request: Any
    cache_salt: str | None
    mm_features: tuple[Any, ...] = ()
    prompt_embeds: Any = None
    _prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = field(default_factory=dict)


#: what stands for a request's ``cache_salt`` in events without token ids (the salt is a secret)
HIDDEN_SALT = "<cache_salt>"
#: what stands for an image's identifier there (a content hash would confirm a guessed image)
HIDDEN_MM = "<mm>"
#: what stands for a digest of prompt embeddings there (the same reason)
HIDDEN_EMBEDS = "<prompt_embeds>"


def event_extra_keys(
    request: Any, start: int, end: int, salt: bool = True
) -> list[tuple[Any, ...] | None] | None:
    """``extra_keys`` of the block of tokens ``[start, end)`` of ``request`` as vLLM's own
    ``BlockStored`` carries them (``to_event_extra_keys``: one entry, None when it has none);
    ``salt`` False: a ``cache_salt`` is published as :data:`HIDDEN_SALT` (events without token
    ids: a reader cannot hash the prompt anyway, and the salt would let it confirm a guess),
    each multimodal item's identifier as :data:`HIDDEN_MM` and a digest of prompt embeddings as
    :data:`HIDDEN_EMBEDS`."""
    cache_salt = getattr(request, "cache_salt", None)
    features = tuple(getattr(request, "mm_features", None) or ())
    if not salt:
        cache_salt = cache_salt and HIDDEN_SALT
        features = tuple(replace(f, identifier=HIDDEN_MM) for f in features)
    embeds = getattr(request, "prompt_embeds", None)
    digests = getattr(request, "_prompt_embeds_per_block_hashes", None)
    keyed = _Keyed(getattr(request, "lora_request", None), cache_salt, features, embeds,
                   digests if isinstance(digests, dict) else {})  # fmt: skip
    keys, _ = generate_block_hash_extra_keys(keyed, start, end, 0)  # type: ignore[arg-type]
    if not salt and keys:
        keys = tuple((k[0], HIDDEN_EMBEDS) if isinstance(k, tuple) and k[:1] == ("prompt_embeds",) else k
                     for k in keys)  # fmt: skip
    return to_event_extra_keys([keys])


@dataclass
class _Set:
    """One page set: where it is complete, and which pieces each tier still owes."""

    group: int
    waiting: dict[str, set[str]] = field(default_factory=dict)
    tiers: set[str] = field(default_factory=set)
    blocks: list[tuple[int, int | bytes]] = field(default_factory=list)  # (group, hash) it is part of


@dataclass
class _Block:
    """One block as a ``BlockStored`` names it, and the page sets it needs."""

    group: int
    block_hash: int | bytes
    parent: int | bytes | None
    token_ids: list[int]
    members: tuple[str, ...]
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None
    published: set[str] = field(default_factory=set)


class TierEvents:
    """Turns store plans and worker reports into ``BlockStored`` / ``BlockRemoved`` events.

    ``shared``: tier name -> whether other engines may read it (``locality`` REMOTE);
    ``media``: tier name -> the ``medium`` its events carry (default: the name;
    :func:`published_medium`)."""

    def __init__(
        self,
        planner: HybridOffloadPlanner,
        spec: KVEventsSpec,
        shared: dict[str, bool],
        capacity: int = MAX_PUBLISHED_SETS,
        media: Mapping[str, str] | None = None,
    ) -> None:
        self.planner = planner
        self.spec = spec
        self.block_tokens = spec.block_tokens(planner.chunk_tokens)
        self._shared = shared
        self._media = dict(media or {})
        self._capacity = capacity
        self._sets: OrderedDict[str, _Set] = OrderedDict()  # page-set key -> set
        self._owner: dict[str, str] = {}  # piece key -> page-set key
        self._blocks: OrderedDict[tuple[int, int | bytes], _Block] = OrderedDict()
        self._events: list[KVCacheEvent] = []

    # ---- inputs ---------------------------------------------------------------------------
    def planned(self, state: RequestState, page: PageJob, tiers: Iterable[str]) -> None:
        """``page``'s set was sent to ``tiers`` for the request of ``state``."""
        tiers = tuple(tiers)
        if not tiers:
            return
        entry = self._sets.get(page.key)
        if entry is None:
            entry = self._sets[page.key] = _Set(page.group)
        entry.group = page.group
        self._sets.move_to_end(page.key)
        pieces = self.planner.piece_keys(page.key, page.group)
        for piece in pieces:
            self._owner[piece] = page.key
        for tier in tiers:
            if tier not in entry.tiers:
                entry.waiting[tier] = set(pieces)
        block = self._block(state, page)
        if block is not None:
            self._check(block, (t for m in block.members if (s := self._sets.get(m)) for t in s.tiers))
        self._forget_oldest()

    def stored(self, tier: str, pieces: Iterable[str]) -> None:
        """A worker stored ``pieces`` in ``tier``."""
        for piece in pieces:
            key = self._owner.get(piece)
            entry = self._sets.get(key) if key is not None else None
            waiting = entry.waiting.get(tier) if entry is not None else None
            if entry is None or waiting is None:
                continue
            waiting.discard(piece)
            if not waiting:
                del entry.waiting[tier]
                entry.tiers.add(tier)
                for block_id in entry.blocks:
                    block = self._blocks.get(block_id)
                    if block is not None:
                        self._check(block, (tier,))

    def evicted(self, tier: str, pieces: Iterable[str]) -> None:
        """``tier`` lost ``pieces`` (its own report: evicted or deleted)."""
        self.missing(tier, {key for piece in pieces if (key := self._owner.get(piece)) is not None})

    def looked_up(self, tier: str, keys: list[str], answers: list[bool]) -> None:
        """A lookup found which of the page sets ``keys`` ``tier`` holds: a set there counts
        for the blocks this engine completes (e.g. loaded chunks next to stored ones)."""
        for key, hit in zip(keys, answers, strict=True):
            if hit:
                entry = self._sets.get(key)
                if entry is None:
                    entry = self._sets[key] = _Set(-1)  # group: set when this engine stores it
                entry.tiers.add(tier)
        self._forget_oldest()
        self.missing(tier, (k for k, hit in zip(keys, answers, strict=True) if not hit))

    def missing(self, tier: str, keys: Iterable[str]) -> None:
        """``tier`` does not hold the page sets ``keys`` (a lookup found them absent)."""
        for key in keys:
            entry = self._sets.get(key)
            if entry is None or tier not in entry.tiers:
                continue
            entry.tiers.discard(tier)
            for block_id in entry.blocks:
                block = self._blocks.get(block_id)
                if block is not None and tier in block.published:
                    block.published.discard(tier)
                    self._events.append(self._removed_event(tier, block))

    def forget_all(self) -> None:
        """Pages stored so far are never loaded again (a cache reset, new weights): every block
        published is removed, and nothing is remembered."""
        for block in self._blocks.values():
            for tier in sorted(block.published):
                self._events.append(self._removed_event(tier, block))
        self._sets.clear()
        self._owner.clear()
        self._blocks.clear()

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, in order."""
        events, self._events = self._events, []
        return events

    # ---- blocks ---------------------------------------------------------------------------
    def _block(self, state: RequestState, page: PageJob) -> _Block | None:
        """The block ``page``'s set is part of, made on first sight; None when it has no vLLM
        hash yet (its end is past the request's hashed tokens) or no name (a state between
        two hashes)."""
        chunk, span = self.planner.chunk_tokens, self.block_tokens
        end = (page.chunk_index + 1) * chunk
        mamba = self.planner.plans[page.group].kind is GroupKind.MAMBA
        if mamba and end % span:
            return None
        end = -(-end // span) * span
        request = state.request
        at = self.spec.hash_index(end)
        hashes = request.block_hashes
        if at is None or at >= len(hashes):
            return None
        block_id = (page.group, self.spec.external(hashes[at]))
        block = self._blocks.get(block_id)
        if block is not None:
            self._blocks.move_to_end(block_id)
            return block
        first = (end - span) // chunk
        keys = state.keys[page.group]
        if end // chunk > len(keys):
            return None
        members = (page.key,) if mamba else tuple(keys[first : end // chunk])
        before = self.spec.hash_index(end - span)
        lora = getattr(request, "lora_request", None)
        block = self._blocks[block_id] = _Block(
            group=page.group,
            block_hash=block_id[1],
            parent=None if before is None else self.spec.external(hashes[before]),
            token_ids=list(request.all_token_ids[end - span : end]),
            members=members,
            lora_id=lora.adapter_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None,
            extra_keys=event_extra_keys(request, end - span, end, salt=self.spec.token_ids),
        )
        for key in members:
            entry = self._sets.get(key)
            if entry is None:
                entry = self._sets[key] = _Set(page.group)
            entry.group = page.group
            entry.blocks.append(block_id)
        return block

    def _check(self, block: _Block, tiers: Iterable[str]) -> None:
        """Publish ``block`` in those of ``tiers`` that now hold all of its sets."""
        for tier in set(tiers):
            if tier in block.published:
                continue
            if all((s := self._sets.get(m)) is not None and tier in s.tiers for m in block.members):
                block.published.add(tier)
                self._events.append(self._stored_event(tier, block))

    def _forget_oldest(self) -> None:
        while len(self._sets) > self._capacity:
            key, entry = self._sets.popitem(last=False)
            if entry.group < 0:
                continue  # only seen by a lookup: no pieces owned
            for piece in self.planner.piece_keys(key, entry.group):
                if self._owner.get(piece) == key:
                    del self._owner[piece]
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)

    # ---- events ---------------------------------------------------------------------------
    def _locality(self, tier: str) -> str:
        return REMOTE if self._shared.get(tier, True) else LOCAL

    def _stored_event(self, tier: str, block: _Block) -> BlockStored:
        group = self.planner.plans[block.group].group
        extra: dict[str, Any] = {}
        if group.sliding_window is not None:
            extra["kv_cache_spec_sliding_window"] = group.sliding_window
        return BlockStored(
            block_hashes=[block.block_hash],
            parent_block_hash=block.parent,
            token_ids=block.token_ids if self.spec.token_ids else [],
            block_size=self.block_tokens,
            lora_id=block.lora_id,
            medium=self._media.get(tier, tier),
            lora_name=block.lora_name,
            extra_keys=block.extra_keys,
            group_idx=block.group,
            kv_cache_spec_kind=group.kind.value,
            locality=self._locality(tier),
            ownership=OWNERSHIP,
            **extra,
        )

    def _removed_event(self, tier: str, block: _Block) -> BlockRemoved:
        return BlockRemoved(
            block_hashes=[block.block_hash],
            medium=self._media.get(tier, tier),
            group_idx=block.group,
            locality=self._locality(tier),
            ownership=OWNERSHIP,
        )
