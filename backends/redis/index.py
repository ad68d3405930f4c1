"""The redis backends' shared accounting index: capacity and exact LRU kept inside Redis.

Every process using the same Redis (or cluster) and ``prefix`` shares one index, so they share
one capacity and one LRU order. The index is a few keys with one hash tag, so in a cluster they
live in one slot (a script may only touch one slot) while page keys spread over all slots::

    {<prefix>:idx}:lru    sorted set   member = page key (the backend key), score = tick
    {<prefix>:idx}:size   hash         page key -> page size in bytes
    {<prefix>:idx}:used   string       sum of the sizes (bytes)
    {<prefix>:idx}:tick   string       INCR counter giving the LRU order
    {<prefix>:idx}:rebuild string      set while the index needs a rebuild from a scan
    {<prefix>:idx}:healed  string      set for HEAL_EVERY_S by the script that last healed

Lua scripts change them atomically (EVALSHA, falling back to EVAL on NOSCRIPT, e.g. after a
server restart). Scripts carry ``flags=allow-oom``: accounting must keep working when the
server is out of memory (deletes and heals free memory). Every script is idempotent enough
for redis-py's single retry after a dropped connection (re-accounting the same page replaces
its size; removing an absent page is a no-op).

Self-healing: if the server dropped an index key (``maxmemory`` with ``allkeys-*`` policies),
the scripts rebuild ``used`` from the size hash and restart ``tick`` above the largest score.
When the sorted set and the hash disagree (one of them was dropped), a script keeps what it can
inside the index slot (sizes without a tick become the oldest pages; ticks without a size are
dropped), never drops the whole index, and raises a flag, ``{<prefix>:idx}:rebuild``: the
next put that sees it (:meth:`RedisIndex.account` returns it) claims it and re-adopts the
pages still stored, found by a SCAN (:meth:`RedisIndex.adopt`), evicting down to the capacity.

Bounded heals: any writer of the server can make the index look damaged before every script
(a junk ZADD, a DEL of ``used``), and a heal costs O(pages) inside Redis (a repair at 30k
pages: 60k commands, 47 ms here, the server blocked meanwhile). So the first script that sees
damage takes the ``healed`` marker (SET NX with an expiry of :data:`HEAL_EVERY_S`, kept by the
server's clock, so shared by every client) and heals; until the marker expires, the others do
O(1) work: a mismatch stays (extra members are popped as size-0 victims, at most
:data:`MAX_STRAYS_PER_EVICTION` per eviction; sizes without a tick wait), and a missing
``used`` counts as 0 and is not stored (capacity is enforced again after the next heal). A
marker no script set (no expiry, or a longer one) is dropped. Normal operation never reads it.

Threading: :class:`RedisIndex` holds no mutable state; it is safe from any thread.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from redis.exceptions import NoScriptError

__all__ = ["HEAL_EVERY_S", "MAX_STRAYS_PER_EVICTION", "RedisIndex"]

#: an O(pages) heal of the index (a repair, or a new sum of ``used``) runs at most this often
#: per server and prefix: any writer of the server can make the index look damaged (a junk
#: ZADD, a DEL of ``used``) before every script (issue 45 N13)
HEAL_EVERY_S = 60.0
#: members without a size (junk a writer added, or ticks of a dropped size hash) popped at
#: most by one eviction: a flood of junk costs bounded work per put
MAX_STRAYS_PER_EVICTION = 128

_PRELUDE = (
    f"""#!lua flags=allow-oom
local LRU, SIZE, USED, TICK, REBUILD, HEALED = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local HEAL_EVERY_MS, MAX_STRAYS = {round(HEAL_EVERY_S * 1000)}, {MAX_STRAYS_PER_EVICTION}
"""
    + """
-- whether this run may do O(pages) work to heal the index: granted to the first run per
-- HEAL_EVERY_MS (the HEALED marker expires then), asked at most once per run. A marker no
-- script of ours set (no expiry, or a longer one) is dropped first.
local healing = nil
local function may_heal()
  if healing == nil then
    local ttl = redis.call('PTTL', HEALED)
    if ttl == -1 or ttl > HEAL_EVERY_MS then redis.call('DEL', HEALED) end
    healing = redis.call('SET', HEALED, 1, 'NX', 'PX', HEAL_EVERY_MS) ~= false
  end
  return healing
end

-- the set and the hash disagree (the server dropped one): keep what the slot can tell, flag
-- a rebuild from a scan of the pages (their sizes live outside this slot)
local function repair()
  local sizes = redis.call('HKEYS', SIZE)
  for i = 1, #sizes do redis.call('ZADD', LRU, 'NX', 0, sizes[i]) end
  if redis.call('ZCARD', LRU) ~= #sizes then
    local members = redis.call('ZRANGE', LRU, 0, -1)
    for i = 1, #members do
      if redis.call('HEXISTS', SIZE, members[i]) == 0 then redis.call('ZREM', LRU, members[i]) end
    end
  end
  redis.call('DEL', USED)
  redis.call('SET', REBUILD, 1)
end

-- whether ``used`` is known in this run (else: 0 until a heal sums the sizes; not stored)
local used_known = true

-- bytes accounted now; repairs the index if the server dropped one of its keys (O(pages):
-- only when may_heal(); meanwhile a mismatch stays, and a missing ``used`` counts as 0)
local function load_used()
  local n = redis.call('HLEN', SIZE)
  if redis.call('ZCARD', LRU) ~= n then
    if may_heal() then repair() end
  elseif n == 0 and tonumber(redis.call('GET', USED) or '0') > 0 then
    redis.call('SET', REBUILD, 1)  -- both dropped: only a scan can find the pages again
    redis.call('SET', USED, 0)
  end
  local used = redis.call('GET', USED)
  if used then return tonumber(used) end
  if n > 0 and not may_heal() then
    used_known = false
    return 0
  end
  local total = 0
  local sizes = redis.call('HVALS', SIZE)
  for i = 1, #sizes do total = total + tonumber(sizes[i]) end
  redis.call('SET', USED, total)
  return total
end

-- the first of n fresh, increasing ticks
local function next_ticks(n)
  if redis.call('EXISTS', TICK) == 0 then
    local top = redis.call('ZREVRANGE', LRU, 0, 0, 'WITHSCORES')
    if #top > 0 then redis.call('SET', TICK, top[2]) end
  end
  return redis.call('INCRBY', TICK, n) - n + 1
end

-- drop k from the index; its size, or 0 if it was not indexed
local function forget(k)
  local size = redis.call('HGET', SIZE, k)
  redis.call('ZREM', LRU, k)
  if not size then return 0 end
  redis.call('HDEL', SIZE, k)
  return tonumber(size)
end

-- ``used`` stored for the next script, unless this run does not know it
local function store_used(used)
  if used_known then redis.call('SET', USED, used) end
end

-- pop least recently used pages until used <= cap; returns used and {key1, size1, ...}.
-- At most MAX_STRAYS members without a size (size 0 among the victims) are popped per call.
local function evict(used, cap)
  local victims, strays = {}, 0
  while used > cap and strays < MAX_STRAYS do
    local popped = redis.call('ZPOPMIN', LRU)
    if #popped == 0 then used = 0 break end
    local size = redis.call('HGET', SIZE, popped[1])
    if size then
      redis.call('HDEL', SIZE, popped[1])
      size = tonumber(size)
    else
      size, strays = 0, strays + 1
    end
    used = used - size
    victims[#victims + 1] = popped[1]
    victims[#victims + 1] = size
  end
  return used, victims
end
"""
)

# ARGV: capacity, key1, size1, key2, size2, ...  (pages already SET, in put order)
# Returns {rebuild flag (0/1), then the victims evicted to get used <= capacity: key1, size1, ...}
_ACCOUNT = (
    _PRELUDE
    + """
local cap = tonumber(ARGV[1])
local used = load_used()
local tick = next_ticks((#ARGV - 1) / 2)
for i = 2, #ARGV, 2 do
  used = used - forget(ARGV[i]) + tonumber(ARGV[i + 1])
  redis.call('HSET', SIZE, ARGV[i], ARGV[i + 1])
  redis.call('ZADD', LRU, tick, ARGV[i])
  tick = tick + 1
end
local victims
used, victims = evict(used, cap)
store_used(used)
table.insert(victims, 1, redis.call('EXISTS', REBUILD))
return victims
"""
)

# ARGV: capacity, key1, size1, ... (pages a scan found stored). Pages the index does not know
# are adopted as the least recently used (tick 0); then LRU pages are evicted down to the
# capacity. Returns the victims: key1, size1, ...
_ADOPT = (
    _PRELUDE
    + """
local cap = tonumber(ARGV[1])
local used = load_used()
for i = 2, #ARGV, 2 do
  if redis.call('HSETNX', SIZE, ARGV[i], ARGV[i + 1]) == 1 then
    redis.call('ZADD', LRU, 'NX', 0, ARGV[i])
    used = used + tonumber(ARGV[i + 1])
  end
end
local victims
used, victims = evict(used, cap)
store_used(used)
return victims
"""
)

# ARGV: capacity, n_hits, then n_hits pairs (key, size) of pages a GET found, then heal pairs
# (key, score seen before the GET that missed it).
# A hit still indexed gets a fresh tick (ZADD XX: never re-adds a key deleted meanwhile). A hit
# not indexed (an orphan: the index was reset, or a put's accounting was lost) is adopted if it
# fits under the capacity. A missed key is forgotten only if its score is unchanged (no put
# accounted it since the snapshot). Returns {pages forgotten, bytes forgotten, pages adopted}.
_TOUCH = (
    _PRELUDE
    + """
local cap, n_hits = tonumber(ARGV[1]), tonumber(ARGV[2])
local used = load_used()
local adopted, healed, freed = 0, 0, 0
if n_hits > 0 then
  local tick = next_ticks(n_hits)
  for i = 3, 2 + 2 * n_hits, 2 do
    local size = tonumber(ARGV[i + 1])
    if redis.call('ZSCORE', LRU, ARGV[i]) then
      redis.call('ZADD', LRU, 'XX', tick, ARGV[i])
    elseif used + size <= cap then
      redis.call('HSET', SIZE, ARGV[i], ARGV[i + 1])
      redis.call('ZADD', LRU, tick, ARGV[i])
      used = used + size
      adopted = adopted + 1
    end
    tick = tick + 1
  end
end
for i = 3 + 2 * n_hits, #ARGV, 2 do
  local score = redis.call('ZSCORE', LRU, ARGV[i])
  if score and tonumber(score) == tonumber(ARGV[i + 1]) then
    freed = freed + forget(ARGV[i])
    healed = healed + 1
  end
end
used = used - freed
if used < 0 then used = 0 end
store_used(used)
return {healed, freed, adopted}
"""
)

# ARGV: page keys, oldest first. Indexed ones get fresh ticks in that order (ZADD XX never
# re-adds a key deleted meanwhile); the others are ignored. Returns nothing.
_REFRESH = (
    _PRELUDE
    + """
local tick = next_ticks(#ARGV)
for i = 1, #ARGV do
  redis.call('ZADD', LRU, 'XX', tick, ARGV[i])
  tick = tick + 1
end
"""
)

# No ARGV. Returns the bytes accounted (repairing the index first if needed).
_USED = _PRELUDE + "\nreturn load_used()\n"

# ARGV: keys to forget. Returns the bytes forgotten.
_REMOVE = (
    _PRELUDE
    + """
local used = load_used()
local freed = 0
for i = 1, #ARGV do freed = freed + forget(ARGV[i]) end
used = used - freed
if used < 0 then used = 0 end
store_used(used)
return freed
"""
)


class _Script:
    """A Lua script run by EVALSHA, with EVAL as the NOSCRIPT fallback (which caches it)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return client.eval(self.source, len(keys), *keys, *args)


class RedisIndex:
    """The index keys of one ``prefix`` and the operations on them (see the module docstring).

    ``client`` arguments are ``redis.Redis`` or ``redis.cluster.RedisCluster`` clients; every
    method is one round trip and raises redis-py's exceptions unchanged.
    """

    _account = _Script(_ACCOUNT)
    _touch = _Script(_TOUCH)
    _refresh = _Script(_REFRESH)
    _remove = _Script(_REMOVE)
    _used = _Script(_USED)
    _adopt = _Script(_ADOPT)

    def __init__(self, prefix: str) -> None:
        tag = "{" + prefix + ":idx}"
        self.lru, self.size, self.used, self.tick = (
            f"{tag}:lru",
            f"{tag}:size",
            f"{tag}:used",
            f"{tag}:tick",
        )
        self.rebuild_flag = f"{tag}:rebuild"
        #: set (with an expiry of HEAL_EVERY_S) by the script that last healed the index
        self.healed = f"{tag}:healed"
        self.keys = (self.lru, self.size, self.used, self.tick, self.rebuild_flag, self.healed)

    def snapshot(self, client: Any, keys: Sequence[str]) -> tuple[list[int | None], list[int | None]]:
        """Each key's LRU tick and indexed size (None where not indexed), in one round trip."""
        pipe = client.pipeline(transaction=False)
        pipe.zmscore(self.lru, list(keys))
        pipe.hmget(self.size, list(keys))
        scores, sizes = pipe.execute()
        return (
            [None if s is None else int(s) for s in scores],
            [None if s is None else int(s) for s in sizes],
        )

    def account(
        self, client: Any, capacity: int, stored: Sequence[tuple[str, int]]
    ) -> tuple[list[tuple[str, int]], bool]:
        """Account pages just SET (in order), evict LRU down to ``capacity``; return the victims
        and whether the index needs a rebuild from a scan (see the module docstring)."""
        args: list[Any] = [capacity]
        for key, size in stored:
            args += (key, size)
        flag, *flat = self._account(client, self.keys, args)
        return _pairs(flat), bool(int(flag))

    def claim_rebuild(self, client: Any) -> bool:
        """Take the rebuild flag: True for the one caller that should rebuild."""
        return bool(client.delete(self.rebuild_flag))

    def adopt(self, client: Any, capacity: int, found: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        """Adopt stored ``(key, size)`` pages the index does not know as the least recently
        used, evict down to ``capacity``; return the victims (to DEL)."""
        args: list[Any] = [capacity]
        for key, size in found:
            args += (key, size)
        return _pairs(self._adopt(client, self.keys, args))

    def touch(
        self,
        client: Any,
        capacity: int,
        hits: Sequence[tuple[str, int]],
        heal: Sequence[tuple[str, int]],
    ) -> tuple[int, int, int]:
        """Refresh (or adopt) the ``(key, size)`` hits; forget missed ``(key, snapshot score)``
        pairs whose score is unchanged. Returns (pages forgotten, bytes forgotten, adopted).
        """
        args: list[Any] = [capacity, len(hits)]
        for pair in (*hits, *heal):
            args += pair
        healed, freed, adopted = self._touch(client, self.keys, args)
        return int(healed), int(freed), int(adopted)

    def rebuild(
        self,
        client: Any,
        capacity: int,
        batches: Iterable[list[str]],
        page_key: Callable[[str], str],
    ) -> tuple[int, list[tuple[str, int]]]:
        """Adopt every page the index does not know, from ``batches`` of stored keys (a SCAN),
        and evict down to ``capacity`` (victims are DELeted here, at ``page_key(key)``).
        Returns (pages adopted, victims). A page another client puts meanwhile may be adopted
        (as the oldest), or evicted, before its own accounting; a get heals that."""
        adopted, evicted = 0, []
        for keys in batches:
            sizes = client.hmget(self.size, keys)
            unknown = [k for k, size in zip(keys, sizes, strict=True) if size is None]
            if not unknown:
                continue
            pipe = client.pipeline(transaction=False)
            for k in unknown:
                pipe.strlen(page_key(k))
            found = [(k, int(n)) for k, n in zip(unknown, pipe.execute(), strict=True) if n]
            victims = self.adopt(client, capacity, found)
            if victims:
                pipe = client.pipeline(transaction=False)
                for k, _ in victims:
                    pipe.delete(page_key(k))
                pipe.execute()
            adopted += len(found)
            evicted += victims
        return adopted, evicted

    def refresh(self, client: Any, keys: Sequence[str]) -> None:
        """Make the indexed ``keys`` the most recently used, in order (no page I/O)."""
        if keys:
            self._refresh(client, self.keys, list(keys))

    def remove(self, client: Any, keys: Sequence[str]) -> int:
        """Forget ``keys``; return the bytes they accounted."""
        return int(self._remove(client, self.keys, list(keys)))

    def used_bytes(self, client: Any) -> int:
        """The ``used`` counter (rebuilt first if the server dropped an index key)."""
        return max(0, int(self._used(client, self.keys, [])))


def _pairs(flat: Sequence[Any]) -> list[tuple[str, int]]:
    return [(_text(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
