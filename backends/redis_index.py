"""The redis backends' shared accounting index: capacity and exact LRU kept inside Redis.

Every process using the same Redis (or cluster) and ``prefix`` shares one index, so they share
one capacity and one LRU order. The index is four keys with one hash tag, so in a cluster they
live in one slot (a script may only touch one slot) while page keys spread over all slots::

    {<prefix>:idx}:lru    sorted set   member = page key (the backend key), score = tick
    {<prefix>:idx}:size   hash         page key -> page size in bytes
    {<prefix>:idx}:used   string       sum of the sizes (bytes)
    {<prefix>:idx}:tick   string       INCR counter giving the LRU order

Lua scripts change them atomically (EVALSHA, falling back to EVAL on NOSCRIPT, e.g. after a
server restart). Scripts carry ``flags=allow-oom``: accounting must keep working when the
server is out of memory (deletes and heals free memory). Every script is idempotent enough
for redis-py's single retry after a dropped connection (re-accounting the same page replaces
its size; removing an absent page is a no-op).

Self-healing: if the server dropped an index key (``maxmemory`` with ``allkeys-*`` policies),
the scripts rebuild ``used`` from the size hash, restart ``tick`` above the largest score, and
forget the index when the sorted set and the hash disagree in size (the forgotten pages stay
readable until the server evicts them; they are no longer counted).

Threading: :class:`RedisIndex` holds no mutable state; it is safe from any thread.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError

__all__ = ["RedisIndex"]

_PRELUDE = """#!lua flags=allow-oom
local LRU, SIZE, USED, TICK = KEYS[1], KEYS[2], KEYS[3], KEYS[4]

-- bytes accounted now; repairs the index if the server dropped one of its keys
local function load_used()
  if redis.call('ZCARD', LRU) ~= redis.call('HLEN', SIZE) then
    redis.call('DEL', LRU, SIZE)
    redis.call('SET', USED, 0)
    return 0
  end
  local used = redis.call('GET', USED)
  if used then return tonumber(used) end
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
"""

# ARGV: capacity, key1, size1, key2, size2, ...  (pages already SET, in put order)
# Returns the victims evicted to get used <= capacity: key1, size1, key2, size2, ...
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
local victims = {}
while used > cap do
  local popped = redis.call('ZPOPMIN', LRU)
  if #popped == 0 then used = 0 break end
  local size = tonumber(redis.call('HGET', SIZE, popped[1]) or '0')
  redis.call('HDEL', SIZE, popped[1])
  used = used - size
  victims[#victims + 1] = popped[1]
  victims[#victims + 1] = size
end
redis.call('SET', USED, used)
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
redis.call('SET', USED, used)
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
redis.call('SET', USED, used)
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

    def __init__(self, prefix: str) -> None:
        tag = "{" + prefix + ":idx}"
        self.lru, self.size, self.used, self.tick = (
            f"{tag}:lru",
            f"{tag}:size",
            f"{tag}:used",
            f"{tag}:tick",
        )
        self.keys = (self.lru, self.size, self.used, self.tick)

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

    def account(self, client: Any, capacity: int, stored: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        """Account pages just SET (in order), evict LRU down to ``capacity``; return victims."""
        args: list[Any] = [capacity]
        for key, size in stored:
            args += (key, size)
        flat = self._account(client, self.keys, args)
        return [(_text(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]

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


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
