"""Load selection: which backend each page of a request is loaded from.

Pure logic, no I/O, no vLLM: the scheduler side looks every available backend up (one batched
``contains`` per backend), hands the answers to a :class:`LoadPolicy`, and gets a
:class:`LoadChoice` back. Policies (``load_policy`` in config):

* ``weighted`` (default): one backend; score = matched tokens x ``load_weight``; highest score
  wins, ties go to the earlier backend.
* ``ranged``: the longest prefix that the backends hold *together*; every page comes from the
  heaviest backend that holds it (e.g. the first chunks from cpu, the rest and the Mamba state
  from disk when only disk holds the longer prefix).
* ``adaptive``: ``weighted`` with each weight scaled by the backend's measured speed relative
  to the fastest one (:class:`LoadCostModel`), so a slow or failing backend loses traffic by
  itself. A backend without a fresh measurement (never used, or not for ``adaptive_forget_s``) that
  holds the longest prefix is probed first, so every tier gets measured and a recovered one
  wins its traffic back.

Threading: not thread-safe; the scheduler thread owns policies and cost models.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from hybrid_offload.connector.config import DEFAULT_ADAPTIVE_FORGET_S, LOAD_POLICIES
from hybrid_offload.core.planner import HybridOffloadPlanner
from hybrid_offload.core.spec import GroupKind


@dataclass(frozen=True)
class BackendMatch:
    """One backend's answer for one request.

    ``presence[group][chunk]`` covers chunks ``[0, k_max)`` (chunks before the lookup start
    count as present); ``tokens`` is the loadable prefix from this backend alone (0: none).
    """

    name: str
    weight: float
    tokens: int
    presence: tuple[tuple[bool, ...], ...]


@dataclass(frozen=True)
class LoadChoice:
    """Load tokens ``[start_tokens, end_tokens)``; ``sources[(group, chunk)]`` names the backend
    of every page to load; ``score`` compares choices (tokens x weight)."""

    start_tokens: int
    end_tokens: int
    sources: Mapping[tuple[int, int], str]
    score: float

    def backends(self) -> list[str]:
        """Backends used, in first-use order."""
        return list(dict.fromkeys(self.sources.values()))

    def tokens_by_backend(self, planner: HybridOffloadPlanner) -> dict[str, int]:
        """Loaded tokens attributed per backend: by the source of each chunk's attention page
        (the Mamba state's source when the model has no attention group)."""
        chunk = planner.chunk_tokens
        plans = [p for p in planner.plans if p.kind is not GroupKind.MAMBA] or list(planner.plans)
        out: dict[str, int] = {}
        first, last = self.start_tokens // chunk, self.end_tokens // chunk
        for c in range(first, last):
            name = next((self.sources[(p.index, c)] for p in plans if (p.index, c) in self.sources), None)
            if name is None:  # e.g. a sliding-window chunk outside the window: the end's source
                name = self.sources[next(k for k in self.sources if k[1] == last - 1)]
            tokens = chunk - (self.start_tokens - c * chunk if c == first else 0)
            out[name] = out.get(name, 0) + tokens
        return out


class LoadPolicy(ABC):
    """Chooses where a request's pages come from, given every backend's match."""

    name: ClassVar[str]
    #: whether :meth:`choose` reads ``BackendMatch.presence`` beyond each match's own prefix
    #: (then lookups ask every page: see ``HybridOffloadPlanner.lookup``)
    uses_presence: ClassVar[bool] = False

    def __init__(self, planner: HybridOffloadPlanner) -> None:
        self.planner = planner

    @abstractmethod
    def choose(
        self, matches: Sequence[BackendMatch], start_tokens: int, num_tokens: int
    ) -> LoadChoice | None:
        """The load to make beyond ``start_tokens`` (chunk-aligned), or None (nothing to load)."""

    def observe(self, name: str, nbytes: int, seconds: float, ok: bool) -> None:
        """A measured load from ``name``; policies that do not learn ignore it."""
        return

    def settled(
        self, matches: Sequence[BackendMatch], rest: Sequence[tuple[str, float]], full_tokens: int
    ) -> bool:
        """Whether :meth:`choose` answers the same whatever the backends not asked yet hold:
        ``matches`` are those asked so far, in order, ``rest`` the (name, load weight) of the
        others, in order, ``full_tokens`` the most any backend can match. A lookup stops asking
        once this is True. The default asks every backend."""
        return False

    def _single(self, match: BackendMatch, start_tokens: int, weight: float) -> LoadChoice:
        k_start = start_tokens // self.planner.chunk_tokens
        k = match.tokens // self.planner.chunk_tokens
        sources = {
            (plan.index, c): match.name
            for plan in self.planner.plans
            for c in self.planner.needed_chunks(plan, k, k_start)
        }
        return LoadChoice(start_tokens, match.tokens, sources, (match.tokens - start_tokens) * weight)


class WeightedPolicy(LoadPolicy):
    """One backend: highest matched tokens x weight; ties to the earlier backend."""

    name = "weighted"

    def weight(self, match: BackendMatch) -> float:
        return match.weight

    def choose(
        self, matches: Sequence[BackendMatch], start_tokens: int, num_tokens: int
    ) -> LoadChoice | None:
        best: tuple[BackendMatch, float] | None = None
        best_score = 0.0
        for match in matches:
            weight = self.weight(match)
            score = (match.tokens - start_tokens) * weight
            if match.tokens > start_tokens and score > best_score:
                best, best_score = (match, weight), score
        return None if best is None else self._single(best[0], start_tokens, best[1])

    def settled(
        self, matches: Sequence[BackendMatch], rest: Sequence[tuple[str, float]], full_tokens: int
    ) -> bool:
        """True once an asked backend holds ``full_tokens`` with a weight no later backend
        exceeds (an equal score keeps the earlier backend)."""
        best = max((self.weight(m) for m in matches if m.tokens >= full_tokens), default=None)
        return best is not None and all(
            self.weight(BackendMatch(name, weight, full_tokens, ())) <= best for name, weight in rest
        )


class RangedPolicy(LoadPolicy):
    """The longest prefix all backends hold together; each page from its heaviest holder."""

    name = "ranged"
    uses_presence = True

    def choose(
        self, matches: Sequence[BackendMatch], start_tokens: int, num_tokens: int
    ) -> LoadChoice | None:
        live = [m for m in matches if m.presence]
        if not live:
            return None
        groups = len(live[0].presence)
        union = [
            [any(m.presence[g][c] for m in live) for c in range(len(live[0].presence[g]))]
            for g in range(groups)
        ]
        end = self.planner.loadable_prefix(union, num_tokens, start_tokens).tokens
        if end <= start_tokens:
            return None
        chunk = self.planner.chunk_tokens
        ranked = sorted(live, key=lambda m: -m.weight)  # stable: ties keep config order
        sources: dict[tuple[int, int], str] = {}
        for plan in self.planner.plans:
            for c in self.planner.needed_chunks(plan, end // chunk, start_tokens // chunk):
                sources[(plan.index, c)] = next(m.name for m in ranked if m.presence[plan.index][c])
        weights = {m.name: m.weight for m in live}
        choice = LoadChoice(start_tokens, end, sources, 0.0)
        score = sum(t * weights[n] for n, t in choice.tokens_by_backend(self.planner).items())
        return LoadChoice(start_tokens, end, sources, score)


@dataclass
class _Cost:
    speed: float  # smoothed bytes per second of whole load calls (latency included)
    updated: float


@dataclass
class LoadCostModel:
    """Smoothed load speed per backend (exponential moving average of bytes / call seconds).

    A failed load counts as speed 0. ``relative_speed`` is a backend's speed over the fastest
    measured one; backends never measured, or not measured for ``forget_s``, count as 1.0.
    """

    alpha: float = 0.3
    forget_s: float = DEFAULT_ADAPTIVE_FORGET_S
    clock: Callable[[], float] = time.monotonic
    _costs: dict[str, _Cost] = field(default_factory=dict)

    def observe(self, name: str, nbytes: int, seconds: float, ok: bool) -> None:
        sample = nbytes / max(seconds, 1e-6) if ok else 0.0
        now = self.clock()
        cost = self._costs.get(name)
        if cost is None or now - cost.updated > self.forget_s:
            self._costs[name] = _Cost(sample, now)
        else:
            cost.speed += self.alpha * (sample - cost.speed)
            cost.updated = now

    def measured(self, name: str) -> bool:
        """Whether ``name`` has a measurement younger than ``forget_s``."""
        cost = self._costs.get(name)
        return cost is not None and self.clock() - cost.updated <= self.forget_s

    def relative_speed(self, name: str) -> float:
        now = self.clock()
        fresh = {n: c.speed for n, c in self._costs.items() if now - c.updated <= self.forget_s}
        if name not in fresh:
            return 1.0
        fastest = max(fresh.values())
        return fresh[name] / fastest if fastest > 0 else 1.0

    def snapshot(self) -> dict[str, float]:
        return {name: cost.speed for name, cost in self._costs.items()}


class AdaptivePolicy(WeightedPolicy):
    """Weighted, with weights scaled by measured relative speed."""

    name = "adaptive"

    def __init__(self, planner: HybridOffloadPlanner, costs: LoadCostModel | None = None) -> None:
        super().__init__(planner)
        self.costs = costs or LoadCostModel()

    def weight(self, match: BackendMatch) -> float:
        return match.weight * max(self.costs.relative_speed(match.name), 1e-9)

    def choose(
        self, matches: Sequence[BackendMatch], start_tokens: int, num_tokens: int
    ) -> LoadChoice | None:
        live = [m for m in matches if m.tokens > start_tokens]
        if not live:
            return None
        longest = max(m.tokens for m in live)
        probe = [m for m in live if m.tokens == longest and not self.costs.measured(m.name)]
        if probe and len(probe) < len(live):  # some measured, some not: measure the others
            best = max(probe, key=lambda m: m.weight)  # max keeps the first of equals
            return self._single(best, start_tokens, best.weight)
        return super().choose(matches, start_tokens, num_tokens)

    def settled(
        self, matches: Sequence[BackendMatch], rest: Sequence[tuple[str, float]], full_tokens: int
    ) -> bool:
        """As weighted, and only when every backend not asked has been measured (one that has
        not may be chosen to measure it)."""
        measured = all(self.costs.measured(name) for name, _ in rest)
        return measured and super().settled(matches, rest, full_tokens)

    def observe(self, name: str, nbytes: int, seconds: float, ok: bool) -> None:
        self.costs.observe(name, nbytes, seconds, ok)


_POLICIES: dict[str, type[LoadPolicy]] = {
    cls.name: cls for cls in (WeightedPolicy, RangedPolicy, AdaptivePolicy)
}


def make_policy(
    name: str, planner: HybridOffloadPlanner, adaptive_forget_s: float = DEFAULT_ADAPTIVE_FORGET_S
) -> LoadPolicy:
    """The policy called ``name`` (one of :data:`LOAD_POLICIES`); ``adaptive_forget_s`` is the
    ``adaptive`` policy's :attr:`LoadCostModel.forget_s`."""
    if name == AdaptivePolicy.name:
        return AdaptivePolicy(planner, LoadCostModel(forget_s=adaptive_forget_s))
    try:
        return _POLICIES[name](planner)
    except KeyError:
        raise ValueError(f"unknown load policy {name!r} (known: {', '.join(LOAD_POLICIES)})") from None


def presence_matrix(
    keys: Sequence[Sequence[str]], present: set[str], k_max: int, start: int
) -> tuple[tuple[bool, ...], ...]:
    """``presence[group][chunk]`` for chunks ``[0, k_max)``: chunks before ``start`` count as
    present (vLLM holds them), later ones as ``present`` says."""
    return tuple(tuple(c < start or group_keys[c] in present for c in range(k_max)) for group_keys in keys)
