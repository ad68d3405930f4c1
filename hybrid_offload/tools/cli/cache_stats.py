"""``hybrid-offload cache stats``, and the page sets ``stats`` and ``verify`` count.

A page set is the pages of one (fingerprint, KV cache group, chunk) at one shard count: one
per layer part (a range of decoder layers) holding layers of the group and per shard, in the
layout of the engine that wrote it. An engine loads it only when parts holding every layer are
there, each with every shard, so a set missing one (evicted, deleted, corrupt, a pipeline
stage's part never written) is bytes that serve no hit. :class:`PageSets` counts complete and
incomplete sets from page headers.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, TextIO

from hybrid_offload.backends import Backend, PageInfo
from hybrid_offload.core.model_card import card_problem, decode_card, is_card_key
from hybrid_offload.core.page_format import PageHeader
from hybrid_offload.tools.cli.cache_output import EXIT_OK, Progress, emit_json, model_name
from hybrid_offload.tools.cli.cache_read import (
    list_pages,
    namespace,
    read_headers,
    read_pages,
    split_too_large,
)


class PageSets:
    """Which pieces (layer part, shard) of which page sets were seen (see the module docstring).

    A set is complete when some of its parts, each with every shard, cover the group's layers
    without overlapping (any mix of layouts): as many of them as the best-covered set of its
    fingerprint and group has (the listing knows no model; parts are measured in tensors)."""

    def __init__(self) -> None:
        #: per (fingerprint, group, chunk hash, shards): per part (start, end), shards seen and
        #: the part's tensors per shard
        self._seen: dict[tuple[str, int, bytes, int], dict[tuple[int, int], tuple[set[int], int]]] = (
            defaultdict(dict)
        )

    def add(self, fingerprint: str, header: PageHeader) -> None:
        at = (fingerprint, header.group_index, header.chunk_hash, header.shards)
        part = (header.layer_start, header.layer_end)
        shards, _ = self._seen[at].setdefault(part, (set(), len(header.tensors)))
        shards.add(header.shard)

    @staticmethod
    def _cover(parts: dict[tuple[int, int], tuple[set[int], int]], shards: int) -> int:
        """Most tensors that whole parts (every shard) not overlapping hold."""
        whole = sorted((end, start, n) for (start, end), (held, n) in parts.items() if len(held) == shards)
        best: dict[int, int] = {}  # best cover of parts ending at or before each end
        top = 0
        for end, start, n in whole:
            before = max((v for e, v in best.items() if e <= start), default=0)
            top = max(top, before + n)
            best[end] = max(best.get(end, 0), top)
        return top

    def counts(self) -> dict[tuple[str, int], dict[str, int]]:
        """Per (fingerprint, group): ``complete`` and ``incomplete`` sets."""
        covers = {at: self._cover(parts, at[3]) for at, parts in self._seen.items()}
        most: dict[tuple[str, int], int] = defaultdict(int)
        for (fp, group, _, _), cover in covers.items():
            most[(fp, group)] = max(most[(fp, group)], cover)
        out: dict[tuple[str, int], dict[str, int]] = defaultdict(lambda: {"complete": 0, "incomplete": 0})
        for (fp, group, _, _), cover in covers.items():
            out[(fp, group)]["complete" if cover and cover == most[(fp, group)] else "incomplete"] += 1
        return out

    def totals(self) -> dict[str, int]:
        """``complete`` and ``incomplete`` sets over all fingerprints and groups."""
        counts = self.counts().values()
        return {what: sum(c[what] for c in counts) for what in ("complete", "incomplete")}


def format_parts(parts: Iterable[Iterable[int]]) -> str:
    """``[[0, 24], [24, 48], [0, 48]]`` -> ``0-24,0-48,24-48`` (decoder layer ranges)."""
    return ",".join(f"{a}-{b}" for a, b in sorted(tuple(p) for p in parts)) or "-"


def format_shards(seen: Iterable[tuple[int, int]]) -> str:
    """``{(0, 4), (1, 4), (2, 4), (3, 4)}`` -> ``0-3/4``; several shard (or part) counts joined
    by ``,``."""
    by_count: dict[int, list[int]] = defaultdict(list)
    for shard, shards in sorted(set(seen)):
        by_count[shards].append(shard)
    parts = []
    for shards, held in sorted(by_count.items()):
        runs: list[list[int]] = []
        for shard in held:
            if runs and shard == runs[-1][1] + 1:
                runs[-1][1] = shard
            else:
                runs.append([shard, shard])
        text = " ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
        parts.append(f"{text}/{shards}")
    return ", ".join(parts) or "-"


def gather_stats(
    backend: Backend, infos: list[PageInfo], progress: Progress, max_page_bytes: int,
    card_key: bytes | None = None,
) -> dict[str, Any]:
    """Per fingerprint (model name from its card, signed under ``card_key`` where given) and
    KV cache group (from page headers, the only part of a page read; sizes from the listing):
    pages, bytes, shards seen, complete and incomplete page sets."""
    from hybrid_offload.core.page_format import PageFormatError, decode_header

    groups: dict[tuple[str, int, str], dict[str, Any]] = {}
    models: dict[str, str | None] = {}
    unreadable: list[dict[str, str]] = []
    sets = PageSets()
    vanished = 0
    fits, large = split_too_large(infos, max_page_bytes)
    cards = [info for info in fits if is_card_key(info.key)]
    pages = [info for info in fits if not is_card_key(info.key)]
    done = 0
    for info, data in [*read_pages(backend, cards), *read_headers(backend, pages)]:
        done += 1
        progress.update(done)
        if data is None:
            vanished += 1
            continue
        if is_card_key(info.key):
            problem = card_problem(info.key, data, card_key)
            if problem is not None:
                unreadable.append({"key": info.key, "error": problem})
            models[namespace(info.key)] = None if problem else model_name(decode_card(data))
            continue
        try:
            header = decode_header(data)[0]
        except PageFormatError as exc:
            unreadable.append({"key": info.key, "error": str(exc)})
            continue
        slot = (namespace(info.key), header.group_index, str(header.kind.value))
        row = groups.setdefault(slot, {"pages": 0, "bytes": 0, "shards": set(), "parts": set()})
        row["pages"] += 1
        row["bytes"] += info.size
        row["shards"].add((header.shard, header.shards))
        row["parts"].add((header.layer_start, header.layer_end))
        sets.add(slot[0], header)
    progress.close()
    set_counts = sets.counts()
    fingerprints: dict[str, dict[str, Any]] = {
        fp: {"fingerprint": fp, "model": models.get(fp), "pages": 0, "bytes": 0, "groups": []}
        for fp in sorted({slot[0] for slot in groups} | set(models))
    }
    for (fp, group, kind), row in sorted(groups.items()):
        entry = fingerprints[fp]
        entry["pages"] += row["pages"]
        entry["bytes"] += row["bytes"]
        counted = set_counts[(fp, group)]
        entry["groups"].append({"group_index": group, "kind": kind, "pages": row["pages"],
                                "bytes": row["bytes"], "shards": sorted(row["shards"]),
                                "parts": sorted(row["parts"]),
                                "sets_complete": counted["complete"],
                                "sets_incomplete": counted["incomplete"]})  # fmt: skip
    too_large = [{"key": info.key, "size": info.size} for info in large]
    return {"fingerprints": list(fingerprints.values()), "unreadable": unreadable, "vanished": vanished,
            "too_large": too_large}  # fmt: skip


def cmd_stats(backend: Backend, args: argparse.Namespace, out: TextIO) -> int:
    """Pages, bytes, layer parts, shards and page sets (complete / all) per fingerprint and KV
    cache group."""
    infos = list_pages(backend, args.fingerprint)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    card_key = None if args.secret is None else args.secret.subkey("page")
    stats = gather_stats(backend, infos, Progress(len(infos), "read", show), args.max_page_bytes, card_key)
    if args.json:
        emit_json(stats, out)
        return EXIT_OK
    columns = f"{'PAGES':>8} {'BYTES':>14} {'SETS':>11} {'PARTS':>7} SHARDS"
    out.write(f"{'FINGERPRINT':<34} {'GROUP':>5} {'KIND':<15} {columns}\n")
    for fp in stats["fingerprints"]:
        for g in fp["groups"]:
            sets = f"{g['sets_complete']}/{g['sets_complete'] + g['sets_incomplete']}"
            out.write(f"{fp['fingerprint']:<34} {g['group_index']:>5} {g['kind']:<15} {g['pages']:>8} "
                      f"{g['bytes']:>14} {sets:>11} {format_parts(g['parts']):>7} "
                      f"{format_shards(map(tuple, g['shards']))}\n")  # fmt: skip
        out.write(f"{fp['fingerprint']:<34} {'all':>5} {'':<15} {fp['pages']:>8} {fp['bytes']:>14} "
                  f"model: {fp['model'] or '?'}\n")  # fmt: skip
    incomplete = sum(g["sets_incomplete"] for fp in stats["fingerprints"] for g in fp["groups"])
    if incomplete:
        out.write(f"{incomplete} page sets lack a layer part or shard (SETS: complete / all): never loaded\n")
    for item in stats["unreadable"]:
        out.write(f"unreadable {item['key']}: {item['error']}\n")
    if stats["vanished"]:
        out.write(f"{stats['vanished']} pages vanished while reading\n")
    for item in stats["too_large"]:
        out.write(f"too large (not read) {item['key']}: {item['size']} bytes\n")
    return EXIT_OK
