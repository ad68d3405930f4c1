"""``hybrid-offload cache ls|inspect|verify|gc|stats``: look after a page cache from outside vLLM.

The target (``--disk``, ``--redis``, ``--peer``, ``--backend-config`` or ``--config --name``)
is chosen and opened by :mod:`.cache_target`: opening never evicts, and reading a disk cache
leaves its mtimes (its LRU clock) alone. Redis and nixl_peer count a read as a use: after
``verify``, ``stats`` or ``inspect`` their pages look recently used. Opening a disk cache
removes temp files of crashed writers, as every start of the backend does; nothing else that
is not a page key is ever touched. A fingerprint's model card (:mod:`hybrid_offload.core.model_card`,
written by each engine at start-up) names its model in ``ls`` and ``stats``; ``verify`` checks
cards apart from pages; ``gc`` deletes them like pages (an engine rewrites its card at start-up).

Pages are listed with :meth:`Backend.scan` and read with ``get_into`` into buffers of their
listed sizes, in batches of at most ``BATCH_BYTES``, so memory is bounded by a batch, not by
the cache. A page listed larger than ``--max-page-bytes`` (default 1 GiB) is never read: verify
and stats report it as too large, inspect refuses it. ``stats`` reads page headers only
(:meth:`Backend.get_prefix`: a ranged read where the backend has one, redis GETRANGE).
Exit status: 0 ok, 1 a corrupt page was found or a page could not be verified for its size
(``verify``, ``inspect``), 2 bad input (arguments, config, unknown key, a backend that cannot
list, a page over the cap for ``inspect``), 3 the backend is unreachable or failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TextIO

from hybrid_offload.backends import Backend, BackendUnavailableError, PageInfo
from hybrid_offload.core.model_card import card_problem, describe_card, is_card_key
from hybrid_offload.core.secrets import Secret
from hybrid_offload.tools.cli.cache_output import (
    EXIT_CORRUPT,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    Progress,
    emit_json,
    human_age,
    human_bytes,
    model_name,
    printable,
)
from hybrid_offload.tools.cli.cache_read import (
    DEFAULT_MAX_PAGE_BYTES,
    list_pages,
    namespace,
    read_cards,
    read_pages,
    split_too_large,
)
from hybrid_offload.tools.cli.cache_stats import PageSets, cmd_stats
from hybrid_offload.tools.cli.cache_target import (
    CacheCliError,
    cache_secret,
    open_for_maintenance,
    parse_byte_size,
    parse_duration,
    parse_fingerprint,
    target_arguments,
    target_config,
)

logger = logging.getLogger(__name__)

DELETE_BATCH = 1000


# -- reading: hybrid_offload.tools.cli.cache_read ----------------------------------------------------


def delete_pages(backend: Backend, keys: list[str]) -> int:
    return sum(backend.delete_batch(keys[i : i + DELETE_BATCH]) for i in range(0, len(keys), DELETE_BATCH))


def check_page(key: str, data: bytes, secret: Secret | None = None) -> str | None:
    """Why the page (or model card) stored under ``key`` is corrupt, or None if it is valid;
    with the cache ``secret``, a page without a valid signature is invalid too."""
    from hybrid_offload.core.page_format import PageFormatError, decode_page
    from hybrid_offload.core.planner import key_digest

    if is_card_key(key):
        return card_problem(key, data, None if secret is None else secret.subkey("page"))
    try:
        header, _ = decode_page(data, key=None if secret is None else secret.subkey("page"))
    except PageFormatError as exc:
        return str(exc)
    if header.fingerprint.hex() != namespace(key):
        return f"header fingerprint {header.fingerprint.hex()} is not the key's namespace {namespace(key)}"
    own = key_digest(header.chunk_hash, header.group_index, header.shard, header.shards,
                     header.layer_start, header.layer_end, header.layers)  # fmt: skip
    if key.partition("-")[2] != own:
        return ("the header's chunk, group, layer part and shard are another key's: the page was "
                "stored under a wrong key")  # fmt: skip
    return None


# -- ls ---------------------------------------------------------------------------------------


def _age(now: float, mtime: float | None) -> float | None:
    return None if mtime is None else max(0.0, now - mtime)



def cmd_ls(backend: Backend, args: argparse.Namespace, out: TextIO) -> int:
    """One line per fingerprint: pages, bytes, oldest and newest use, model (from its card)."""
    now = time.time()
    rows: dict[str, dict[str, Any]] = {}
    card_infos: list[PageInfo] = []
    for info in backend.scan(f"{args.fingerprint}-" if args.fingerprint else ""):
        row = rows.setdefault(namespace(info.key), {"pages": 0, "bytes": 0, "oldest": None, "newest": None})
        if is_card_key(info.key):
            card_infos.append(info)
            continue
        row["pages"] += 1
        row["bytes"] += info.size
        if info.mtime is not None:
            row["oldest"] = info.mtime if row["oldest"] is None else min(row["oldest"], info.mtime)
            row["newest"] = info.mtime if row["newest"] is None else max(row["newest"], info.mtime)
    cards = read_cards(backend, card_infos, args.max_page_bytes, args.secret)
    listing = [
        {"fingerprint": fp, "pages": row["pages"], "bytes": row["bytes"],
         "oldest_age_s": _age(now, row["oldest"]), "newest_age_s": _age(now, row["newest"]),
         "model": model_name(cards.get(fp)), "card": None if (c := cards.get(fp)) is None else c.to_json()}
        for fp, row in sorted(rows.items())
    ]  # fmt: skip
    total = {"fingerprints": len(listing), "pages": sum(r["pages"] for r in listing),
             "bytes": sum(r["bytes"] for r in listing)}  # fmt: skip
    if args.json:
        emit_json({"backend": _backend_info(backend), "fingerprints": listing, "total": total}, out)
        return EXIT_OK
    out.write(f"{'FINGERPRINT':<34} {'PAGES':>8} {'BYTES':>14} {'SIZE':>10} {'OLDEST':>7} {'NEWEST':>7} "
              "MODEL\n")  # fmt: skip
    for r in listing:
        out.write(f"{r['fingerprint']:<34} {r['pages']:>8} {r['bytes']:>14} {human_bytes(r['bytes']):>10} "
                  f"{human_age(r['oldest_age_s']):>7} {human_age(r['newest_age_s']):>7} "
                  f"{r['model'] or '?'}\n")  # fmt: skip
    out.write(f"total: {total['fingerprints']} fingerprints, {total['pages']} pages, {total['bytes']} bytes "
              f"({human_bytes(total['bytes'])})\n")  # fmt: skip
    return EXIT_OK


def _backend_info(backend: Backend) -> dict[str, str]:
    return {"type": backend.type_name, "name": backend.name}


# -- inspect ----------------------------------------------------------------------------------


def describe_page(key: str, data: bytes, secret: Secret | None = None) -> dict[str, Any]:
    """Every header field, the tensor table and the checksum verdicts of one page."""
    from hybrid_offload.core.page_format import PageFormatError, decode_header, decode_page

    info: dict[str, Any] = {"key": key, "size": len(data)}
    try:
        header, hlen, _ = decode_header(data)
    except PageFormatError as exc:
        return {**info, "header_checksum": f"bad: {exc}", "valid": False, "error": str(exc)}
    info.update(
        fingerprint=header.fingerprint.hex(),
        fingerprint_matches_key=header.fingerprint.hex() == namespace(key),
        chunk_hash=header.chunk_hash.hex(),
        group_index=header.group_index,
        kind=str(header.kind.value),
        chunk_index=header.chunk_index,
        num_tokens=header.num_tokens,
        shard=header.shard,
        shards=header.shards,
        decoder_layers=[header.layer_start, header.layer_end],
        layers_digest=header.layers.hex(),
        header_len=hlen,
        payload_len=header.payload_len,
        tensors=[
            {"index": i, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes}
            for i, t in enumerate(header.tensors)
        ],
        header_checksum="ok",
        signed=header.signed,
    )
    try:
        decode_page(data)
        info["payload_checksum"] = "ok"
    except PageFormatError as exc:
        info["payload_checksum"] = f"bad: {exc}"
        info["error"] = str(exc)
    error = check_page(key, data, secret)
    info["valid"] = error is None
    if error is not None:
        info.setdefault("error", error)
    return info


def _print_description(info: dict[str, Any], out: TextIO) -> None:
    for name, value in info.items():
        if name == "tensors":
            out.write(f"{'tensors':<24} {len(value)}\n")
            out.write(f"  {'#':>4}  {'SHAPE':<24} {'DTYPE':<14} {'BYTES':>12}\n")
            for t in value:
                shape = "(" + ", ".join(map(str, t["shape"])) + ")"
                out.write(f"  {t['index']:>4}  {shape:<24} {t['dtype']:<14} {t['bytes']:>12}\n")
        elif name == "groups":
            out.write(f"{'groups':<24} {len(value)}\n")
            out.write(f"  {'#':>4}  {'KIND':<16} {'LAYERS':>6} {'SHARDS':>6}\n")
            for g in value:
                out.write(f"  {g['index']:>4}  {g['kind']:<16} {g['layers']:>6} {g['shards']:>6}\n")
        elif isinstance(value, list):
            out.write(f"{name:<24} {printable(', '.join(map(str, value))) or '-'}\n")
        else:
            text = ("yes" if value else "no") if isinstance(value, bool) else printable(str(value))
            out.write(f"{name:<24} {text}\n")


def cmd_inspect(backend: Backend, args: argparse.Namespace, out: TextIO) -> int:
    """Decode one page (``KEY`` or the first of ``--fingerprint``) and verify its checksums."""
    from hybrid_offload.backends import check_keys

    if (args.key is None) == (args.fingerprint is None) or (args.fingerprint is not None) != args.first:
        raise CacheCliError("give a page KEY, or --fingerprint FP --first")
    key = args.key
    if key is None:
        first = next((i for i in list_pages(backend, args.fingerprint) if not is_card_key(i.key)), None)
        if first is None:
            raise CacheCliError(f"no pages of fingerprint {args.fingerprint} in {backend.name!r}")
        key = first.key
    check_keys([key])
    missing = CacheCliError(f"no page {key} in {backend.type_name} backend {backend.name!r}")
    info = next((i for i in backend.scan(key) if i.key == key), None)
    if info is None:
        raise missing
    if info.size > args.max_page_bytes:
        raise CacheCliError(
            f"page {key} is {info.size} bytes, more than --max-page-bytes {args.max_page_bytes}"
        )
    data = next(read_pages(backend, [info]))[1]
    if data is None:
        raise missing
    if is_card_key(key):
        described = describe_card(key, data, None if args.secret is None else args.secret.subkey("page"))
    else:
        described = describe_page(key, data, args.secret)
    if args.json:
        emit_json(described, out)
    else:
        _print_description(described, out)
    return EXIT_OK if described["valid"] else EXIT_CORRUPT


# -- verify -----------------------------------------------------------------------------------


def _listed_wrong(backend: Backend, unread: list[PageInfo], bad: list[dict[str, Any]],
                  out: TextIO | None) -> int:  # fmt: skip
    """Pages read as None: gone since the listing (counted, returned), or still there and
    longer than listed: corrupt (a listing's size comes from what the tier keeps, e.g. Redis's
    shared index, which any client of the server can write; a page must not hide behind it)."""
    present = backend.contains_batch([info.key for info in unread]) if unread else []
    for info, there in zip(unread, present, strict=True):
        if there:
            error = f"stored larger than the {info.size} bytes the listing says (the tier's index disagrees)"
            bad.append({"key": info.key, "size": info.size, "error": error, "card": is_card_key(info.key)})
            if out is not None:
                out.write(f"corrupt {info.key}: {error}\n")
    return len(unread) - sum(present)


def cmd_verify(backend: Backend, args: argparse.Namespace, out: TextIO) -> int:
    """Read and fully verify every page; exit 1 if any is corrupt (``--delete-bad``: delete).
    Counts the page sets of the valid pages, complete or lacking a layer part or shard."""
    from hybrid_offload.core.page_format import decode_header

    infos = list_pages(backend, args.fingerprint)
    fits, large = split_too_large(infos, args.max_page_bytes)
    too_large = [{"key": info.key, "size": info.size} for info in large]
    show = sys.stderr.isatty() if args.progress is None else args.progress
    progress = Progress(len(fits), "verified", show)
    bad: list[dict[str, Any]] = []
    sets = PageSets()
    ok = cards_ok = 0
    unread: list[PageInfo] = []
    if not args.json:
        for item in too_large:
            out.write(
                f"too large {item['key']}: {item['size']} bytes > --max-page-bytes {args.max_page_bytes}\n"
            )
    for done, (info, data) in enumerate(read_pages(backend, fits), 1):
        card = is_card_key(info.key)
        if data is None:
            unread.append(info)
        elif (error := check_page(info.key, data, args.secret)) is not None:
            bad.append({"key": info.key, "size": len(data), "error": error, "card": card})
            if not args.json:
                out.write(f"corrupt {'model card ' if card else ''}{info.key}: {error}\n")
        elif card:
            cards_ok += 1
        else:
            ok += 1
            sets.add(namespace(info.key), decode_header(data)[0])
        progress.update(done)
    progress.close()
    vanished = _listed_wrong(backend, unread, bad, out if not args.json else None)
    deleted = _delete_still_bad(backend, bad, args) if args.delete_bad and bad else 0
    pages = [i for i in infos if not is_card_key(i.key)]
    bad_cards = sum(1 for b in bad if b["card"])
    summary = {"pages": len(pages), "bytes": sum(i.size for i in pages), "ok": ok,
               "corrupt": len(bad) - bad_cards, "vanished": vanished, "deleted": deleted,
               "cards": len(infos) - len(pages), "cards_ok": cards_ok,
               "cards_corrupt": bad_cards, "sets_complete": sets.totals()["complete"],
               "sets_incomplete": sets.totals()["incomplete"]}  # fmt: skip
    if args.json:
        emit_json({**summary, "corrupt_pages": bad, "too_large": too_large}, out)
    else:
        out.write(
            f"verified {summary['pages']} pages ({summary['bytes']} bytes): {ok} ok, "
            f"{summary['corrupt']} corrupt, {vanished} vanished while reading\n"
        )
        out.write(f"page sets of the ok pages: {summary['sets_complete']} complete, "
                  f"{summary['sets_incomplete']} lacking a layer part or shard (never loaded)\n")
        if summary["cards"]:
            out.write(f"verified {summary['cards']} model cards: {cards_ok} ok, {bad_cards} corrupt\n")
        if args.delete_bad:
            out.write(f"deleted {deleted} corrupt pages ({sum(b['size'] for b in bad)} bytes)\n")
        if too_large:
            out.write(f"not verified: {len(too_large)} pages larger than --max-page-bytes\n")
    return EXIT_CORRUPT if bad or too_large else EXIT_OK


def _delete_still_bad(backend: Backend, bad: list[dict[str, Any]], args: argparse.Namespace) -> int:
    """Delete the corrupt pages that are still corrupt (an engine may have re-stored one)."""
    listed = {info.key: info for item in bad for info in backend.scan(item["key"]) if info.key == item["key"]}
    fits, _ = split_too_large(listed.values(), args.max_page_bytes)
    again = read_pages(backend, fits)
    still = [info.key for info, data in again if data is not None and check_page(info.key, data, args.secret)]
    return delete_pages(backend, still)


# -- gc ---------------------------------------------------------------------------------------


def select_for_gc(
    infos: list[PageInfo], now: float, older_than: float | None, max_bytes: int | None
) -> list[PageInfo]:
    """Pages unused for longer than ``older_than``, then the least recently used of the rest
    until they total at most ``max_bytes`` (pages of unknown age count as oldest there); every
    page when neither is given (``--fingerprint`` alone)."""
    if older_than is None and max_bytes is None:
        return list(infos)
    doomed: list[PageInfo] = []
    kept: list[PageInfo] = []
    for info in infos:
        old = older_than is not None and info.mtime is not None and now - info.mtime > older_than
        (doomed if old else kept).append(info)
    if max_bytes is not None:
        total = sum(info.size for info in kept)
        for info in sorted(kept, key=lambda i: (i.mtime is not None, i.mtime or 0.0, i.key)):
            if total <= max_bytes:
                break
            doomed.append(info)
            total -= info.size
    return doomed


def cmd_gc(backend: Backend, args: argparse.Namespace, out: TextIO) -> int:
    """Delete by age, total size and/or fingerprint; ``--dry-run`` only reports."""
    if args.older_than is None and args.max_bytes is None and args.fingerprint is None:
        raise CacheCliError("gc needs --older-than, --max-bytes and/or --fingerprint")
    infos = list_pages(backend, args.fingerprint)
    doomed = select_for_gc(infos, time.time(), args.older_than, args.max_bytes)
    per_fp: dict[str, dict[str, int]] = defaultdict(lambda: {"pages": 0, "bytes": 0})
    for info in doomed:
        per_fp[namespace(info.key)]["pages"] += 1
        per_fp[namespace(info.key)]["bytes"] += info.size
    deleted = 0 if args.dry_run else delete_pages(backend, [info.key for info in doomed])
    logger.debug("gc of %s: %d pages selected, %d deleted", backend.name, len(doomed), deleted)
    unknown_age = sum(1 for info in infos if info.mtime is None) if args.older_than is not None else 0
    summary = {
        "dry_run": args.dry_run,
        "selected_pages": len(doomed),
        "selected_bytes": sum(info.size for info in doomed),
        "deleted_pages": deleted,
        "kept_pages": len(infos) - len(doomed),
        "kept_bytes": sum(info.size for info in infos) - sum(info.size for info in doomed),
        "unknown_age_pages": unknown_age,
        "selected_cards": sum(1 for info in doomed if is_card_key(info.key)),
        "by_fingerprint": dict(sorted(per_fp.items())),
    }
    if args.json:
        emit_json(summary, out)
        return EXIT_OK
    verb = "would delete" if args.dry_run else "deleted"
    count = len(doomed) if args.dry_run else deleted
    size = summary["selected_bytes"]
    dry = " (dry run: nothing deleted)" if args.dry_run else ""
    cards = f", {summary['selected_cards']} of them model cards" if summary["selected_cards"] else ""
    out.write(f"{verb} {count} pages ({size} bytes, {human_bytes(size)}{cards}){dry}\n")
    for fp, row in summary["by_fingerprint"].items():
        out.write(f"  {fp}: {row['pages']} pages, {row['bytes']} bytes\n")
    out.write(f"kept {summary['kept_pages']} pages ({summary['kept_bytes']} bytes)\n")
    if unknown_age:
        out.write(f"note: {unknown_age} pages of unknown age were not aged out\n")
    return EXIT_OK


# -- argparse ---------------------------------------------------------------------------------

_ACTIONS: dict[str, tuple[Callable[[Backend, argparse.Namespace, TextIO], int], str]] = {
    "ls": (cmd_ls, "one line per fingerprint: pages, bytes, oldest/newest use"),
    "inspect": (cmd_inspect, "decode one page's header and tensor table; verify its checksums"),
    "verify": (cmd_verify, "read and verify every page; exit 1 if any is corrupt"),
    "gc": (cmd_gc, "delete pages by age, total size and/or fingerprint"),
    "stats": (cmd_stats, "pages, bytes and shards per fingerprint and KV cache group"),
}


def _add_action_arguments(name: str, p: argparse.ArgumentParser) -> None:
    fp_help = "only pages of this fingerprint (model + layout namespace)"
    if name != "gc":
        p.add_argument(
            "--max-page-bytes",
            type=parse_byte_size,
            default=DEFAULT_MAX_PAGE_BYTES,
            metavar="SIZE",
            help="never read a page listed larger than this (default: 1GiB)",
        )
    if name == "inspect":
        p.add_argument("key", nargs="?", help="page key <fingerprint>-<digest>")
        p.add_argument("--fingerprint", type=parse_fingerprint, help="with --first: of this fingerprint")
        p.add_argument("--first", action="store_true", help="inspect the fingerprint's first page (by key)")
        return
    p.add_argument("--fingerprint", type=parse_fingerprint, help=fp_help)
    if name in ("verify", "stats"):
        p.add_argument(
            "--progress",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="progress on stderr (default: when stderr is a terminal)",
        )
    if name == "verify":
        p.add_argument("--delete-bad", action="store_true", help="delete the corrupt pages found")
    if name == "gc":
        p.add_argument(
            "--older-than",
            type=parse_duration,
            metavar="DURATION",
            help="delete pages unused for longer than this: 90s, 30m, 12h, 7d",
        )
        p.add_argument(
            "--max-bytes",
            type=parse_byte_size,
            metavar="SIZE",
            help="then the least recently used until at most SIZE remain: 10GiB, 500MB, 1234",
        )
        p.add_argument("--dry-run", action="store_true", help="report what would be deleted; delete nothing")


def add_cache(subparsers: Any) -> None:
    """Register ``cache`` and its actions."""
    p = subparsers.add_parser(
        "cache",
        help="list, inspect, verify, garbage-collect and summarize a page cache",
        description="Maintain a disk, redis or nixl_peer page cache: ls, inspect, verify, gc, stats. "
        "Exit status: 0 ok, 1 corrupt page found, 2 bad input, 3 backend unreachable.",
    )
    actions = p.add_subparsers(dest="cache_action", required=True, metavar="ACTION")
    parent = target_arguments()
    for name, (_, help_text) in _ACTIONS.items():
        action = actions.add_parser(name, parents=[parent], help=help_text, description=help_text)
        _add_action_arguments(name, action)
    p.set_defaults(handler=cmd_cache)


def cmd_cache(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Open the target, run the action, map failures to exit statuses (module docstring)."""
    out = sys.stdout if out is None else out
    if not getattr(args, "verbose", False):
        logging.getLogger("hybrid_offload.backends").setLevel(logging.WARNING)
        # NIXL logs INFO lines to stdout from its own handler (set up at import, reading this)
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    where = f"hybrid-offload cache {args.cache_action}"
    try:
        args.secret = cache_secret(args)
        backend = open_for_maintenance(target_config(args))
        with backend:
            return _ACTIONS[args.cache_action][0](backend, args, out)
    except BackendUnavailableError as exc:
        print(f"{where}: backend unavailable: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except NotImplementedError as exc:
        print(f"{where}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:  # CacheCliError, ConfigError, BackendConfigError, InvalidKeyError
        print(f"{where}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
