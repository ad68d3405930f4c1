"""Retention built for hybrids: an :class:`~.lru_index.EvictionPolicy` that evicts by resume
point instead of by page.

A hybrid model's prefix is loadable only up to a recurrent state (a *resume point*) with every
attention page before it. A page is worth keeping only while it serves some resume point, and a
resume point is worth what the next request that resumes there saves. :class:`ResumePointPolicy`
keeps that structure from :class:`Retention` hints that the store path gives per page
(:meth:`ResumePointPolicy.describe`, before the page enters the index):

* **Units.** Pages that leave together (the pieces of one chunk's page sets, and of one state's)
  share a unit; a unit without a hint is its page alone.
* **Chains.** A state unit names its chunk's attention unit as ``parent``, an attention unit the
  previous chunk's. A state *references* every held attention unit up its chain.
* **Priorities** are GreedyDual's: a unit stored or used gets ``floor + weight`` (the ``floor``
  rises to the priority of each unit evicted), and the lowest goes first. With equal weights
  this is least recently used; a unit with twice the weight survives about twice as long. A
  state's attention is refreshed with it, after it: a state goes before the pages it needs.
* **Released first**: attention whose last referencing state left (it serves no resume point
  left), and units hinted with weight 0 (an application said its session ended).
* **Order of arrival.** Pages may come deepest first (a state before its attention): a state
  reaches up its chain as its attention arrives.
* **Leaving.** A victim's unit leaves at once (what only it needed is released). A unit whose
  last page is deleted, or removed to be put again (a replace: remove, make room, add), leaves
  when another unit is added, or, unless it left last, when the index asks for the order; one
  put back before then keeps its place in the chains.
* **Scans.** A unit whose request stores more than :data:`SCAN_SHARE` of the tier (``capacity``
  given) weighs 0.
* Hints for keys that never enter the index are forgotten after :data:`MAX_PENDING_HINTS`.

Called under the index's lock (the :class:`~.lru_index.EvictionPolicy` contract); ``describe``
too.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from .lru_index import EvictionPolicy

__all__ = [
    "MAX_PENDING_HINTS", "SCAN_SHARE", "SESSIONS", "ResumePointPolicy", "Retention", "page_weight",
    "session_weight",
]  # fmt: skip

#: hints described but not (yet) added that a policy remembers
MAX_PENDING_HINTS = 1 << 16
#: a request whose new pages take more than this share of a tier is a scan there: they go first
SCAN_SHARE = 0.5
#: what an application may say of a request's session (``kv_transfer_params``)
SESSIONS = ("continues", "ends")


def session_weight(session: str | None) -> float:
    """The weight of a request's pages by what the application said of its session: 0 (released
    first) when it ``ends``, else 1."""
    if session is not None and session not in SESSIONS:
        raise ValueError(f"session must be one of {', '.join(SESSIONS)}, got {session!r}")
    return 0.0 if session == "ends" else 1.0


def page_weight(new_bytes: int, capacity: int, session: str | None = None) -> float:
    """The weight of the pages one request stores in a tier of ``capacity`` bytes: its
    :func:`session_weight`, and 0 when they take more than :data:`SCAN_SHARE` of the tier (a
    one-shot long prompt must not flush it)."""
    weight = session_weight(session)
    return 0.0 if new_bytes > SCAN_SHARE * capacity else weight


@dataclass(frozen=True, slots=True)
class Retention:
    """What one stored page is for (see the module docstring).

    ``unit``: the pages that leave together; ``parent``: the attention unit this unit extends
    ("" at a chain's start); ``state``: a resume point, useless without its chain;
    ``weight``: value per byte against an unhinted page (1.0); 0 releases it first;
    ``request_bytes``: what the request storing it stores in all (a scan in a tier it would
    mostly fill: :func:`page_weight`).
    """

    unit: str
    parent: str = ""
    state: bool = False
    weight: float = 1.0
    request_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.unit:
            raise ValueError("Retention.unit must be non-empty")
        if not self.weight >= 0:
            raise ValueError(f"Retention.weight must be >= 0, got {self.weight}")
        if self.request_bytes < 0:
            raise ValueError(f"Retention.request_bytes must be >= 0, got {self.request_bytes}")


class _Unit:
    __slots__ = ("chain", "entry", "keys", "parent", "referrers", "state", "waits", "weight")

    def __init__(self, hint: Retention, weight: float) -> None:
        self.keys: set[str] = set()
        self.parent = hint.parent
        self.state = hint.state
        self.weight = weight
        self.referrers: set[str] = set()  # an attention unit's states whose chain holds it
        self.chain: list[str] = []  # a state's referenced attention units, nearest first
        self.waits = ""  # a state's first chain unit not held (yet): pages arrive deepest first
        self.entry: tuple[float, int] | None = None  # (priority, seq) in the heap; None: released


class ResumePointPolicy(EvictionPolicy):
    """Evicts released units first, then the lowest GreedyDual priority (module docstring).
    ``capacity``: the tier's capacity, for the scan rule of :func:`page_weight` (None: none)."""

    def __init__(self, capacity: Callable[[], float] | None = None) -> None:
        self._capacity = capacity
        self._units: dict[str, _Unit] = {}
        self._unit_of: dict[str, str] = {}
        self._pending: OrderedDict[str, Retention] = OrderedDict()
        self._released: OrderedDict[str, None] = OrderedDict()  # units evicted first, oldest first
        #: units whose last key left other than as a victim (a delete, or the first half of a
        #: replace: remove, make room, add): settled when another unit is added or, but the
        #: last one, when the index asks for the order
        self._vacated: dict[str, _Unit] = {}
        self._waiting: dict[str, set[str]] = {}  # a unit not held -> the states whose chain stops there
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._victim: str | None = None
        self.floor = 0.0

    # ---- hints ------------------------------------------------------------------------
    def describe(self, key: str, hint: Retention) -> None:
        """What ``key`` is for; read when it is next added (a held key keeps its unit)."""
        self._pending[key] = hint
        self._pending.move_to_end(key)
        while len(self._pending) > MAX_PENDING_HINTS:
            self._pending.popitem(last=False)

    def describe_batch(self, hints: Sequence[tuple[str, Retention]]) -> None:
        """:meth:`describe` each (key, hint): a backend's ``describe_batch``, under its lock."""
        for key, hint in hints:
            self.describe(key, hint)

    # ---- EvictionPolicy ---------------------------------------------------------------
    def added(self, key: str) -> None:
        hint = self._pending.pop(key, None) or Retention(key)
        name = hint.unit
        if self._vacated and name not in self._vacated:
            self._settle()
        self._unit_of[key] = name
        unit = self._units.get(name)
        if unit is None and name in self._vacated:  # put back (a replace): as it was
            unit = self._units[name] = self._vacated.pop(name)
            unit.keys.add(key)
            if unit.entry is None:
                self._released[name] = None
            elif unit.state:
                self._touch(name, unit)
            else:  # after the states it serves, at the weight of the heaviest
                weights = [u.weight for r in unit.referrers if (u := self._units.get(r)) is not None]
                self._refresh(name, unit, max(weights, default=None))
            if unit.state and unit.waits:  # what it waited for may have come meanwhile
                self._waiting.get(unit.waits, set()).discard(name)
                waits, unit.waits = unit.waits, ""
                self._reference(name, unit, waits)
            else:
                self._wake(name)
            return
        if unit is not None:
            unit.keys.add(key)
            if unit.entry is not None:
                self._touch(name, unit)
            return
        weight = hint.weight
        if self._capacity is not None and hint.request_bytes:
            weight = min(weight, page_weight(hint.request_bytes, int(self._capacity())))
        unit = self._units[name] = _Unit(hint, weight)
        unit.keys.add(key)
        if unit.weight == 0:
            self._release(name, unit)
            return
        self._refresh(name, unit)
        if unit.state:
            self._reference(name, unit, unit.parent)
        else:
            self._wake(name)

    def used(self, key: str) -> None:
        name = self._unit_of[key]
        unit = self._units[name]
        if unit.entry is not None:  # a released unit stays released (its chain may be gone)
            self._touch(name, unit)

    def removed(self, key: str) -> None:
        name = self._unit_of.pop(key)
        unit = self._units[name]
        unit.keys.discard(key)
        if unit.keys:
            return
        del self._units[name]
        self._released.pop(name, None)
        evicted, self._victim = self._victim == key, None
        if evicted:
            self._gone(name, unit)
        else:
            self._vacated[name] = unit

    def evicting(self, key: str) -> None:
        """GreedyDual's floor rises to the priority of each unit evicted; a victim's unit leaves
        at once (its orphans go next), where a deleted or replaced one waits (:meth:`added`)."""
        self._victim = key
        unit = self._units[self._unit_of[key]]
        if unit.entry is not None:
            self.floor = max(self.floor, unit.entry[0])

    def kind(self, key: str) -> str:
        """``"state"`` or ``"attention"`` (a page without hints counts as attention)."""
        return "state" if self._units[self._unit_of[key]].state else "attention"

    def clear(self) -> None:
        self._units.clear()
        self._unit_of.clear()
        self._released.clear()
        self._vacated.clear()
        self._waiting.clear()
        self._heap.clear()
        self._victim = None
        self.floor = 0.0

    def order(self) -> Iterator[str]:
        self._settle(keep_last=True)
        for name in self._released:  # the index does not change while it iterates
            yield from sorted(self._units[name].keys)
        while self._heap:  # stale entries off the top: the unit left or was refreshed
            priority, seq, name = self._heap[0]
            unit = self._units.get(name)
            if unit is not None and unit.entry == (priority, seq):
                break
            heapq.heappop(self._heap)
        else:
            return
        yield from sorted(unit.keys)
        heap = self._heap[:]  # beyond the first unit (its keys could not be evicted): a copy
        heapq.heappop(heap)
        while heap:
            priority, seq, name = heapq.heappop(heap)
            unit = self._units.get(name)
            if unit is not None and unit.entry == (priority, seq):
                yield from sorted(unit.keys)

    # ---- internals --------------------------------------------------------------------
    def _touch(self, name: str, unit: _Unit) -> None:
        """A unit used or stored again: refreshed, and a state's chain after it."""
        self._refresh(name, unit)
        if unit.state:
            for parent in unit.chain:
                held = self._units.get(parent)  # a vacated one until settled
                if held is not None:
                    self._refresh(parent, held, unit.weight)

    def _refresh(self, name: str, unit: _Unit, weight: float | None = None) -> None:
        """``unit`` gets ``floor + weight`` (its own weight by default), never lower than it has."""
        priority = self.floor + (unit.weight if weight is None else max(weight, unit.weight))
        if unit.entry is not None and unit.entry[0] > priority:
            return
        unit.entry = (priority, next(self._seq))
        heapq.heappush(self._heap, (priority, unit.entry[1], name))
        if len(self._heap) > 2 * len(self._units) + 64:  # stale entries: rebuild from the live ones
            self._heap = [(u.entry[0], u.entry[1], n) for n, u in self._units.items() if u.entry is not None]
            heapq.heapify(self._heap)

    def _gone(self, name: str, unit: _Unit) -> None:
        """``unit`` (no longer in :attr:`_units`) left for good: a state's attention that no other
        state needs is released, and so are the states needing a unit of attention."""
        if unit.waits:
            waiting = self._waiting.get(unit.waits, set())
            waiting.discard(name)
            if not waiting:
                self._waiting.pop(unit.waits, None)
        for parent in unit.chain:
            held = self._units.get(parent) or self._vacated.get(parent)
            if held is not None:
                held.referrers.discard(name)
                if not held.referrers and parent in self._units:
                    self._release(parent, held)
        for referrer in unit.referrers:
            state = self._units.get(referrer) or self._vacated.get(referrer)
            if state is not None and name in state.chain:
                state.chain.remove(name)
                if referrer in self._units:
                    self._release(referrer, state)

    def _settle(self, keep_last: bool = False) -> None:
        """Units that left and were not put back: gone for good (:meth:`_gone`). ``keep_last``:
        not the one that left last (a replace making room before it puts the page back)."""
        vacated, self._vacated = self._vacated, {}
        if keep_last and vacated:
            last = next(reversed(vacated))
            self._vacated[last] = vacated.pop(last)
        for name, unit in vacated.items():
            self._gone(name, unit)

    def _wake(self, name: str) -> None:
        """States put before attention unit ``name`` (deepest first) reach up through it now."""
        for waiting in self._waiting.pop(name, ()):
            state = self._units.get(waiting)
            if state is not None:
                state.waits = ""
                self._reference(waiting, state, name)

    def _release(self, name: str, unit: _Unit) -> None:
        unit.entry = None
        self._released[name] = None

    def _reference(self, state_name: str, state: _Unit, name: str) -> None:
        """A state references the held attention units up its chain from ``name`` and refreshes
        them after itself; it waits at the first unit not held (put after it, or never: what
        lies beyond a gap cannot be loaded with this state)."""
        while name:
            unit = self._units.get(name)
            if unit is None:
                state.waits = name
                self._waiting.setdefault(name, set()).add(state_name)
                return
            if unit.state:
                return
            unit.referrers.add(state_name)
            if unit.entry is None:  # released attention serves this resume point again
                self._released.pop(name, None)
            self._refresh(name, unit, state.weight)
            state.chain.append(name)
            name = unit.parent
