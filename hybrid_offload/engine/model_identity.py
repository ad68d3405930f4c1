"""What identifies a model's weights (and a LoRA adapter's), for the fingerprint that scopes page
keys: a page computed with other weights must never be served.

* A Hugging Face hub snapshot (a repo id found in the hub cache, or a path inside
  ``.../snapshots/<commit>/``) is named by its commit: the same on every machine. Only where
  every weight and code file of it is a link into the blobs of the same repo
  (``../../blobs/<etag>``, the etag being the sha256 of an LFS file or the git blob sha1 of
  another), and a blob written (or a link made) after this process started holds the bytes
  its name says (:func:`blob_matches_name`); otherwise its files are identified by content,
  as a local directory's.
* A local directory is named by the content of its weight files and of its Python files
  (``trust_remote_code`` model code): per file the relative name, the size and the sha256 of
  every byte (:mod:`~hybrid_offload.core.file_digest`: hashed once per file version, then
  cached). Any changed byte changes the identity (a partial fine-tune, a merged adapter);
  copies of the same files share it, whatever their file times.
* Otherwise (weights streamed from elsewhere) the identity says so (``unidentified``), and the
  caller warns.

**Bound to what was loaded.** The identity is taken when the connector is created: after vLLM
loaded the weights and profiled, minutes later. Where a weight, code or ``config.json`` file, a
directory holding one (a file renamed into place), or a symbolic link on the way to one
(``current -> v2`` swapped) changed (mtime or ctime) since this process started, or a repo
id's ref moved to another snapshot meanwhile, the files may hold other bytes than the engine
runs; the identity is then ``{"unbound": why, "nonce": <random>}`` (also where a file cannot
be read): unique to each call, so no page of this engine is ever served to another engine or a
restart, nor theirs to it (when in doubt, miss); no request fails. This process's own start
(:func:`process_start_ns`) is early enough: vLLM reads the weights and the model code after it,
in this process (the worker) or in processes it starts later (the engine core, holding the
scheduler's connector, starts its workers). An earlier bound (the API server's, which forks
the engine core) would flag a model the launcher built before it started vLLM
(``hybrid-offload serve`` builds its demo model, then execs the server under the same pid). On
a file system made from an image the times come from the image (see
:mod:`~hybrid_offload.core.file_digest`): such a file system is read-only, but another image
mounted over the path while the engine starts goes unseen.

A LoRA adapter (:func:`adapter_identity`) is named the same way by its top-level files (where
vLLM loads them from) and its JSON files (``adapter_config.json``: rank, alpha, targets); a hub
snapshot of an adapter only where every blob holds what its name says. A file that cannot be
read raises :class:`OSError` to :func:`adapter_identity`'s caller (a request skips the cache);
when the adapter was loaded is the caller's to bind (see ``connector/scheduler/scope.py``).

Pure: no vLLM, no torch.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_offload.core.file_digest import CHUNK_BYTES, file_sha256, file_sha256_many

logger = logging.getLogger(__name__)

__all__ = [
    "CODE_SUFFIXES", "WEIGHT_SUFFIXES", "adapter_identity", "blob_matches_name", "changed_since",
    "hub_commit", "process_start_ns", "weights_identity",
]  # fmt: skip

#: files whose bytes are weights
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".msgpack", ".h5")
#: files whose bytes are model code (``trust_remote_code``)
CODE_SUFFIXES = (".py",)
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: symbolic links followed before a path counts as a loop (Linux's MAXSYMLINKS)
_MAX_LINKS = 40


def process_start_ns(pid: int | str = "self") -> int:
    """When process ``pid`` started (ns since the epoch, the clock of file times), at the end of
    the clock tick it started in: its start in ticks since boot (``/proc/<pid>/stat`` field 22),
    plus one, plus the boot time (now less ``CLOCK_BOOTTIME``). Never earlier than the true
    start, so a file written just before the process started (a model built, then an engine
    spawned) is never taken for one changed after it; a file written in the process's first
    tick (10 ms) counts as before it, which is safe: vLLM reads no weights that early. Raises
    OSError, ValueError or IndexError where ``/proc`` does not say."""
    text = Path(f"/proc/{pid}/stat").read_text()
    ticks = int(text[text.rindex(")") + 2 :].split()[19])  # fields after "(comm)" start at 3
    boot = time.time_ns() - time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    return boot + -(-(ticks + 1) * 10**9 // os.sysconf("SC_CLK_TCK"))


@dataclass(frozen=True)
class _Snapshot:
    """A hub snapshot: its commit, its directory (resolved), and the refs file that named the
    commit where a repo id (not a path or a commit) was resolved."""

    commit: str
    directory: Path
    ref: Path | None = None

    @property
    def repo(self) -> Path:
        return self.directory.parent.parent


def _hub_snapshot(model: str, revision: str | None = None) -> _Snapshot | None:
    """The snapshot ``model`` lies in (a path) or names (a repo id whose ``config.json`` is in
    the local hub cache at ``revision``); None otherwise."""
    path = Path(model)
    for part in (path.resolve(strict=False), path):
        for p in (part, *part.parents):
            if p.parent.name == "snapshots" and _COMMIT.fullmatch(p.name):
                return _Snapshot(p.name, p.resolve(strict=False))
    if path.exists():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except (ValueError, OSError, ImportError):
        return None
    if not isinstance(found, str) or not _COMMIT.fullmatch(Path(found).parent.name):
        return None
    directory = Path(found).parent.resolve(strict=False)
    ref = None
    if not (revision and _COMMIT.fullmatch(revision)):
        candidate = directory.parent.parent / "refs" / (revision or "main")
        ref = candidate if candidate.is_file() else None
    return _Snapshot(directory.name, directory, ref)


def hub_commit(model: str, revision: str | None = None) -> str | None:
    """The hub commit of ``model``: a path inside a snapshot directory, or a repo id whose
    ``config.json`` is in the local hub cache at ``revision``; None otherwise. Says nothing of
    whether the snapshot's files are the commit's (:func:`weights_identity` checks)."""
    snapshot = _hub_snapshot(model, revision)
    return None if snapshot is None else snapshot.commit


def _path_links(path: Path) -> list[os.stat_result]:
    """``lstat`` of every symbolic link met while resolving ``path`` (a directory link on the
    way, a file link, links to links). Raises OSError on a loop; stops where a part is
    missing (reading the file then raises)."""
    out: list[os.stat_result] = []
    todo = list(reversed(path.parts))
    current = os.getcwd() if not path.is_absolute() else "/"
    while todo:
        part = todo.pop()
        if part == "/":  # an absolute link target starts over
            current = "/"
            continue
        if part == ".":
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, part)
        try:
            st = os.lstat(candidate)
        except OSError:
            return out
        if stat.S_ISLNK(st.st_mode):
            out.append(st)
            if len(out) > _MAX_LINKS:
                raise OSError(errno.ELOOP, "too many levels of symbolic links", str(path))
            todo.extend(reversed(Path(os.readlink(candidate)).parts))
        else:
            current = candidate
    return out


def changed_since(paths: list[Path], since_ns: int) -> list[Path]:
    """Those of ``paths`` whose file, or a symbolic link on the way to it, has an mtime or ctime
    at or after ``since_ns`` (ns since the epoch). A ctime cannot be set back, so a write, a
    rename onto the path, a link swapped or a ``touch`` since then is found (where the kernel
    sets the times, not on an image file system). Raises OSError when one is missing."""
    out: list[Path] = []
    for path in paths:
        stats = [*_path_links(path), os.stat(path)]
        if any(max(st.st_mtime_ns, st.st_ctime_ns) >= since_ns for st in stats):
            out.append(path)
    return out


def _git_blob_sha1(path: Path) -> str:
    """git's blob id of the file: sha1 of ``blob <size>\\0`` and its bytes."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def blob_matches_name(blob: Path) -> bool:
    """Whether a hub blob holds the bytes its name (the file's etag) says: the sha256 of an LFS
    file (64 hex digits, through the digest cache) or the git blob sha1 of another (40). Raises
    OSError when it cannot be read."""
    if _SHA256.fullmatch(blob.name):
        return file_sha256(blob) == blob.name
    if _COMMIT.fullmatch(blob.name):
        return _git_blob_sha1(blob) == blob.name
    return False


def _repo_blob(file: Path, repo: Path) -> Path | None:
    """The blob ``file`` (a snapshot entry) links to: ``<repo>/blobs/<etag>``, itself a regular
    file or a link into the hub cache's shared store (``<cache>/blobs/<xx>/<sha256>``); None
    where ``file`` is anything else (a copy, a link elsewhere)."""
    try:
        if not file.is_symlink():
            return None
        hop = Path(os.path.normpath(os.path.join(os.path.realpath(file.parent), os.readlink(file))))
        blobs = os.path.realpath(repo / "blobs")
        named = _SHA256.fullmatch(hop.name) or _COMMIT.fullmatch(hop.name)
        if os.path.realpath(hop.parent) != blobs or not named:
            return None
        st = os.lstat(hop)
        if stat.S_ISREG(st.st_mode):
            return hop
        if not stat.S_ISLNK(st.st_mode):
            return None
        shared = Path(os.path.realpath(hop))
        store = os.path.realpath(repo.parent / "blobs")
        if str(shared.parent.parent) != store or not _SHA256.fullmatch(shared.name) or not shared.is_file():
            return None
        return hop
    except OSError:
        return None


def _hub_untrusted(snapshot: _Snapshot, files: list[Path], since_ns: int | None) -> str | None:
    """Why the commit does not name ``files`` (entries of the snapshot), None where it does:
    each is a link into the repo's blobs, and each blob whose link or bytes changed at or after
    ``since_ns`` (every blob, where None) holds what its name says."""
    for file in files:
        blob = _repo_blob(file, snapshot.repo)
        if blob is None:
            return f"{file} is not a link into {snapshot.repo / 'blobs'}"
        try:
            check = since_ns is None or bool(changed_since([file, blob], since_ns))
            if check and not blob_matches_name(blob):
                return f"{file}: blob {blob.name} does not hold the bytes its name says"
        except OSError as exc:
            return f"{file}: {exc.strerror}"
    return None


def _snapshot_moved(snapshot: _Snapshot, root: Path, since_ns: int) -> str | None:
    """Why the engine may have loaded another snapshot than ``snapshot`` (None where it cannot
    have): a symbolic link on the path to it changed at or after ``since_ns`` (``current ->
    snapshots/<commit>`` swapped), or the refs file that named it did while the repo holds
    other snapshots too (a new revision downloaded meanwhile). Raises OSError."""
    if any(max(st.st_mtime_ns, st.st_ctime_ns) >= since_ns for st in _path_links(root)):
        return f"a link on the path {root} changed after the engine started"
    if snapshot.ref is None:
        return None
    others = sum(1 for d in snapshot.directory.parent.iterdir() if d.is_dir()) > 1
    if others and changed_since([snapshot.ref], since_ns):
        return f"{snapshot.ref} moved after the engine started: it may have loaded another snapshot"
    return None


def _file_entries(files: list[Path], root: Path) -> list[dict[str, Any]]:
    """Name, size and full sha256 per file. Raises OSError when a file cannot be read."""
    digests = file_sha256_many(files)
    return [
        {"name": f.relative_to(root).as_posix(), "size": f.stat().st_size, "sha256": d}
        for f, d in zip(files, digests, strict=True)
    ]


def _weight_files(directory: Path, *, recursive: bool = True,
                  suffixes: tuple[str, ...] = WEIGHT_SUFFIXES) -> list[Path]:
    """Files named ``*<suffix>`` in ``directory`` (and its subdirectories when ``recursive``;
    sorted, hidden entries skipped)."""
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if recursive else []
        out.extend(Path(dirpath, f) for f in filenames
                   if not f.startswith(".") and f.endswith(suffixes))
    return sorted(out)


def _unbound(model: str, why: str) -> dict[str, Any]:
    """The identity of weights that cannot be bound to what the engine loaded: unique to this
    call (see the module docstring). Logged here, with the remedy."""
    logger.warning(
        "hybrid-offload cannot tell which bytes of %r this engine loaded (%s): its pages get an "
        "identity of their own, never shared with another engine or a restart. Restart the "
        "engine once the files are final, or set kv_connector_extra_config.model_version.",
        model, why,
    )  # fmt: skip
    return {"unbound": why, "nonce": secrets.token_hex(16)}


def weights_identity(
    model: str, revision: str | None = None, *, started_ns: int | None = None
) -> dict[str, Any]:
    """A JSON-able identity of the weights ``model`` names (see the module docstring):
    ``{"hub_commit"}``, ``{"files", "code"}`` (a directory), ``{"files"}`` (one weight file),
    ``{"unidentified"}`` (nothing local) or ``{"unbound", "nonce"}``. ``started_ns``: when the
    engine process started (default :func:`process_start_ns`); a file changed at or after it
    makes the weights unbound."""
    try:
        start = process_start_ns() if started_ns is None else started_ns
    except (OSError, ValueError, IndexError) as exc:
        return _unbound(model, f"this process's start time is unknown: {exc}")
    snapshot = _hub_snapshot(model, revision)
    root = Path(model) if snapshot is None or Path(model).exists() else snapshot.directory
    if root.is_dir():
        weights = _weight_files(root)
        code = _weight_files(root, suffixes=CODE_SUFFIXES)
    elif root.is_file() and root.suffix in WEIGHT_SUFFIXES:  # a single GGUF file
        weights, code = [root], []
    else:
        weights, code = [], []
    if not weights:
        return {"hub_commit": snapshot.commit} if snapshot is not None else {"unidentified": str(model)}
    config = [root / "config.json"] if (root / "config.json").is_file() else []
    if snapshot is not None:
        why = _hub_untrusted(snapshot, [*weights, *code, *config], start)
        if why is None:
            try:
                moved = _snapshot_moved(snapshot, root, start)
            except OSError as exc:
                return _unbound(model, f"{exc.filename or model}: {exc.strerror}")
            return _unbound(model, moved) if moved else {"hub_commit": snapshot.commit}
        logger.info("hybrid-offload identifies %r by its files' content, not its hub commit: %s", model, why)
    return _content_identity(model, root, weights, code, [*config], start)


def _content_identity(
    model: str, root: Path, weights: list[Path], code: list[Path], config: list[Path], start: int
) -> dict[str, Any]:
    """:func:`weights_identity` from the files' bytes, bound to them as loaded: unbound where
    one of them (or ``config``, or a directory holding one: a file renamed into place changes
    it on every file system) changed at or after ``start``, before or while it was read."""
    dirs = sorted({f.parent for f in [*weights, *code]}) if root.is_dir() else []
    checked = [*weights, *code, *config, *dirs]
    try:
        if changed := changed_since(checked, start):
            return _unbound(model, f"{changed[0]} changed after the engine started")
        identity = {"files": _file_entries(weights, root if root.is_dir() else root.parent)}
        if root.is_dir():
            identity["code"] = _file_entries(code, root)
        if changed := changed_since(checked, start):  # while it was read
            return _unbound(model, f"{changed[0]} changed after the engine started")
    except OSError as exc:
        return _unbound(model, f"{exc.filename or model}: {exc.strerror}")
    return identity


def adapter_identity(path: str) -> dict[str, Any]:
    """A JSON-able identity of a LoRA adapter at ``path``: its JSON and weight files as for a
    model, top level only; a hub snapshot's commit only where every blob of those files holds
    the bytes its name says. Raises OSError when a file of it cannot be read."""
    if "\x00" in path:
        return {"unidentified": path}
    directory = Path(path)
    snapshot = _hub_snapshot(path)
    if not directory.is_dir():  # a repo id in the hub cache, or nothing vLLM could load
        return {"hub_commit": snapshot.commit} if snapshot is not None else {"unidentified": path}
    files = _weight_files(directory, recursive=False, suffixes=(".json", *WEIGHT_SUFFIXES))
    if snapshot is not None and _hub_untrusted(snapshot, files, None) is None:
        return {"hub_commit": snapshot.commit}
    return {"files": _file_entries(files, directory)}
