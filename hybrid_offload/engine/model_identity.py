"""What identifies a model's weights (and a LoRA adapter's), for the fingerprint that scopes page
keys: a page computed with other weights must never be served.

* A Hugging Face hub snapshot (a repo id found in the hub cache, or a path inside
  ``.../snapshots/<commit>/``) is named by its commit: the same on every machine.
* A local directory is named by its weight files: per file the name, size, modification time
  (ns), for safetensors a digest of its header (tensor names, dtypes, shapes, offsets), and a
  digest of a sample of its bytes (``SAMPLES`` blocks of ``SAMPLE_BYTES`` spread evenly over
  the file). A file rewritten in place changes its modification time; other weights of the
  same shapes (a fine-tune) change nearly every block, so images built with normalized file
  times still differ. Reading costs about ``SAMPLES x SAMPLE_BYTES`` per file. Copies whose
  modification times differ (``cp`` without ``-p``) do not share pages: fleets that share a
  tier use hub snapshots or set ``model_version``.
* Otherwise (weights streamed from elsewhere) the identity says so, and the caller warns.

A LoRA adapter (:func:`adapter_identity`) is named by the full digest of its JSON files and
its weight files like a model's, top level only (where vLLM loads them from). A file that
cannot be read raises :class:`OSError`: the caller decides (a request skips the cache).

Pure: no vLLM, no torch.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from pathlib import Path
from typing import Any

__all__ = ["SAMPLES", "SAMPLE_BYTES", "WEIGHT_SUFFIXES", "adapter_identity", "hub_commit", "weights_identity"]

#: files whose bytes are weights
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".msgpack", ".h5")
#: a safetensors header longer than this is not trusted (the format caps it at 100 MB)
MAX_SAFETENSORS_HEADER = 100_000_000
_COMMIT = re.compile(r"[0-9a-f]{40}")
#: bytes sampled per weight file: SAMPLES blocks of SAMPLE_BYTES, evenly spread
SAMPLES = 16
SAMPLE_BYTES = 4096


def hub_commit(model: str, revision: str | None = None) -> str | None:
    """The hub commit of ``model``: a path inside a snapshot directory, or a repo id whose
    ``config.json`` is in the local hub cache at ``revision``; None otherwise."""
    path = Path(model)
    for part in (path.resolve(strict=False), path):
        parents = [part, *part.parents]
        for p in parents:
            if p.parent.name == "snapshots" and _COMMIT.fullmatch(p.name):
                return p.name
    if path.exists():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except (ValueError, OSError, ImportError):
        return None
    if isinstance(found, str) and _COMMIT.fullmatch(Path(found).parent.name):
        return Path(found).parent.name
    return None


def _safetensors_header_digest(path: Path) -> str:
    """sha256 of a safetensors file's length-prefixed JSON header ("bad" if it has none)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                return "bad"
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_SAFETENSORS_HEADER:
                return "bad"
            return hashlib.sha256(prefix + f.read(n)).hexdigest()
    except OSError as exc:
        return f"unreadable:{exc.errno}"


def _sample_digest(path: Path, size: int) -> str:
    """sha256 of ``SAMPLES`` blocks of ``SAMPLE_BYTES`` at evenly spread offsets (the whole file
    when it is smaller than that)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SAMPLES * SAMPLE_BYTES:
            h.update(f.read())
        else:
            for i in range(SAMPLES):
                h.update(os.pread(f.fileno(), SAMPLE_BYTES, (size - SAMPLE_BYTES) * i // (SAMPLES - 1)))
    return h.hexdigest()


def _file_entry(path: Path, root: Path, *, content: bool) -> dict[str, Any]:
    """Raises OSError when the file cannot be read."""
    st = path.stat()
    entry: dict[str, Any] = {
        "name": path.relative_to(root).as_posix(),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }
    if content:
        entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        return entry
    if path.suffix == ".safetensors":
        entry["header"] = _safetensors_header_digest(path)
    entry["sample"] = _sample_digest(path, st.st_size)
    return entry


def _weight_files(directory: Path, *, recursive: bool = True) -> list[Path]:
    """Weight files in ``directory`` (and its subdirectories when ``recursive``; sorted, hidden
    entries skipped)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if recursive else []
        out.extend(Path(dirpath, f) for f in filenames
                   if not f.startswith(".") and f.endswith(WEIGHT_SUFFIXES))
    return sorted(out)


def weights_identity(model: str, revision: str | None = None) -> dict[str, Any]:
    """A JSON-able identity of the weights ``model`` names (see the module docstring)."""
    commit = hub_commit(model, revision)
    if commit is not None:
        return {"hub_commit": commit}
    directory = Path(model)
    if directory.is_dir():
        files = _weight_files(directory)
        if files:
            try:
                return {"files": [_file_entry(f, directory, content=False) for f in files]}
            except OSError as exc:
                return {"unidentified": f"{model}: {exc.strerror}"}
    elif directory.is_file() and directory.suffix in WEIGHT_SUFFIXES:  # a single GGUF file
        try:
            return {"files": [_file_entry(directory, directory.parent, content=False)]}
        except OSError as exc:
            return {"unidentified": f"{model}: {exc.strerror}"}
    return {"unidentified": str(model)}


def adapter_identity(path: str) -> dict[str, Any]:
    """A JSON-able identity of a LoRA adapter at ``path``: its weight files as for a model, plus
    the full digest of its small JSON files (``adapter_config.json``: rank, alpha, targets); top
    level only. Raises OSError when a file of it cannot be read."""
    if "\x00" in path:
        return {"unidentified": path}
    commit = hub_commit(path)
    if commit is not None:
        return {"hub_commit": commit}
    directory = Path(path)
    if not directory.is_dir():
        return {"unidentified": path}
    files = sorted(f for f in directory.iterdir() if f.is_file() and f.suffix == ".json")
    return {
        "files": [_file_entry(f, directory, content=True) for f in files]
        + [_file_entry(f, directory, content=False) for f in _weight_files(directory, recursive=False)]
    }
