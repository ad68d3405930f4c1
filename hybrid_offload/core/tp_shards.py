"""Tensor-parallel-portable page sets: how a (chunk, group) page splits into shards.

Pure logic, no torch. A group's per-layer tensors are described at tensor-parallel size 1 by
:class:`TensorSplit`: the axis vLLM shards across ranks and the components laid out along it
(attention: KV heads; Mamba2 conv state: x, B, C; SSM / GDN state: heads), each a number of
*units* (heads, groups) of ``unit_size`` indices. Rank ``r`` of ``t`` holds, of every
component, the units :func:`held_units` ``(units, t, r)`` gives (a contiguous share, or one
replicated unit when there are fewer units than ranks, as vLLM does for KV heads and for a
single Mamba group), concatenated along the axis in component order.

A page set is ``shards`` pages; shard ``p`` holds :func:`held_units` ``(units, shards, p)`` of
every component. Shard counts and units never depend on the engine's TP size, so any TP size
reads a set written by any other: a rank writes the shards that lie entirely in its holding
(:func:`shards_written`) and reads those that overlap it (:func:`shards_read`), copying the
contiguous runs :func:`transfers` lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class ShardLayoutError(ValueError):
    """A TP size or shard count that this group's structure cannot be split into."""


def held_units(units: int, parts: int, index: int) -> range:
    """Units of a component held by part ``index`` of ``parts`` (a TP rank or a shard).

    ``units >= parts``: an even contiguous share (``units % parts == 0``). Fewer units than
    parts: the one unit ``index * units // parts``, replicated (``parts % units == 0``).
    """
    if not 0 <= index < parts:
        raise ShardLayoutError(f"part {index} of {parts} does not exist")
    if units >= parts:
        if units % parts:
            raise ShardLayoutError(f"{units} units do not split evenly into {parts} parts")
        share = units // parts
        return range(index * share, (index + 1) * share)
    if parts % units:
        raise ShardLayoutError(f"{parts} parts cannot replicate {units} units evenly")
    first = index * units // parts
    return range(first, first + 1)


@dataclass(frozen=True)
class Component:
    """``units`` units (at TP=1) of ``unit_size`` indices each, along a tensor's split axis."""

    name: str
    units: int
    unit_size: int


@dataclass(frozen=True)
class TensorSplit:
    """How one per-layer tensor splits: along ``axis``, ``components`` in this order."""

    axis: int
    components: tuple[Component, ...]

    def extent(self, parts: int, index: int) -> int:
        """Length of the split axis in part ``index`` of ``parts`` (parts=1: the full tensor)."""
        return sum(len(held_units(c.units, parts, index)) * c.unit_size for c in self.components)

    def component_extent(self, component: int, parts: int, index: int) -> int:
        c = self.components[component]
        return len(held_units(c.units, parts, index)) * c.unit_size

    def offsets(self, parts: int, index: int) -> list[int]:
        """Start of each component along the axis in part ``index`` of ``parts``."""
        out, at = [], 0
        for i in range(len(self.components)):
            out.append(at)
            at += self.component_extent(i, parts, index)
        return out


@dataclass(frozen=True)
class Transfer:
    """Copy ``length`` indices along the split axis: part A at ``a_start`` <-> part B at
    ``b_start``; they are ``units`` (TP=1 numbering) of component ``component``."""

    component: int
    a_start: int
    b_start: int
    length: int
    units: range


def transfers(split: TensorSplit, a: tuple[int, int], b: tuple[int, int]) -> list[Transfer]:
    """Contiguous runs shared by part ``a = (parts, index)`` and part ``b``, one per component
    they share units of."""
    out = []
    a_offsets, b_offsets = split.offsets(*a), split.offsets(*b)
    for i, c in enumerate(split.components):
        in_a, in_b = held_units(c.units, *a), held_units(c.units, *b)
        lo, hi = max(in_a.start, in_b.start), min(in_a.stop, in_b.stop)
        if lo < hi:
            out.append(Transfer(
                i,
                a_offsets[i] + (lo - in_a.start) * c.unit_size,
                b_offsets[i] + (lo - in_b.start) * c.unit_size,
                (hi - lo) * c.unit_size,
                range(lo, hi),
            ))
    return out


def shard_count(splits: Sequence[TensorSplit], max_shards: int) -> int:
    """The largest shard count ``s`` dividing ``max_shards`` such that every component either
    splits into ``s`` even shares or (fewer units than shards) is replicated evenly, and no
    shard is a pure replica of another (``s`` at most the largest component's units)."""
    if max_shards < 1:
        raise ShardLayoutError(f"max_shards must be at least 1, got {max_shards}")
    components = [c for s in splits for c in s.components]
    if not components:
        return 1
    largest = max(c.units for c in components)
    for s in sorted((d for d in range(1, max_shards + 1) if max_shards % d == 0), reverse=True):
        if s <= largest and all(
            (c.units % s == 0) if c.units >= s else (s % c.units == 0) for c in components
        ):
            return s
    return 1


def _inside(inner: range, outer: range) -> bool:
    return outer.start <= inner.start and inner.stop <= outer.stop


def _units_of(splits: Sequence[TensorSplit], parts: int, index: int) -> list[range]:
    return [held_units(c.units, parts, index) for s in splits for c in s.components]


def check_tp_size(splits: Sequence[TensorSplit], tp_size: int) -> None:
    """Raise :class:`ShardLayoutError` unless vLLM can shard every component ``tp_size`` ways."""
    for s in splits:
        for c in s.components:
            try:
                held_units(c.units, tp_size, 0)
            except ShardLayoutError as exc:
                raise ShardLayoutError(f"{c.name}: {exc}") from None


def shards_written(splits: Sequence[TensorSplit], shards: int, tp_size: int, rank: int) -> list[int]:
    """Shards rank ``rank`` of ``tp_size`` writes: those inside its holding, each by the lowest
    such rank (replicas hold identical bytes). Raises when some shard has no writer."""
    owner: dict[int, int] = {}
    for r in range(tp_size):
        mine = _units_of(splits, tp_size, r)
        for p in range(shards):
            if p not in owner and all(
                _inside(u, m) for u, m in zip(_units_of(splits, shards, p), mine, strict=True)
            ):
                owner[p] = r
    orphans = [p for p in range(shards) if p not in owner]
    if orphans:
        raise ShardLayoutError(
            f"shards {orphans} of {shards} span several of {tp_size} TP ranks; use a shard "
            f"count that is a multiple of the TP size"
        )
    return [p for p in range(shards) if owner[p] == rank]


def shards_read(splits: Sequence[TensorSplit], shards: int, tp_size: int, rank: int) -> list[int]:
    """Shards rank ``rank`` of ``tp_size`` reads: every shard overlapping its holding in all
    components (so a replicated component is found in one of them)."""
    mine = _units_of(splits, tp_size, rank)
    chosen = []
    for p in range(shards):
        theirs = _units_of(splits, shards, p)
        if all(max(u.start, m.start) < min(u.stop, m.stop) for u, m in zip(theirs, mine, strict=True)):
            chosen.append(p)
    for i, m in enumerate(mine):
        covered = set().union(*(_units_of(splits, shards, p)[i] for p in chosen)) if chosen else set()
        if not set(m) <= covered:
            raise ShardLayoutError(f"rank {rank} of {tp_size}: shards {chosen} miss units of component {i}")
    return chosen


def read_plan(
    split: TensorSplit, shards: int, chosen: Sequence[int], tp_size: int, rank: int
) -> dict[int, list[Transfer]]:
    """Per chosen shard, the runs to copy into the rank's tensor (a = shard, b = rank); a
    replicated unit is copied from the first chosen shard holding it only."""
    done: list[set[int]] = [set() for _ in split.components]
    plan: dict[int, list[Transfer]] = {}
    for p in chosen:
        runs = [
            t for t in transfers(split, (shards, p), (tp_size, rank))
            if not set(t.units) <= done[t.component]
        ]
        for t in runs:
            done[t.component].update(t.units)
        plan[p] = runs
    return plan
