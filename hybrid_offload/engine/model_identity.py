"""What identifies a model's weights (and a LoRA adapter's), for the fingerprint that scopes page
keys: a page computed with other weights must never be served.

* A Hugging Face hub snapshot (a repo id found in the hub cache, or a path inside
  ``.../snapshots/<commit>/``) is named by its commit: the same on every machine.
* A local directory is named by the content of its weight files and of its Python files
  (``trust_remote_code`` model code): per file the relative name, the size and the sha256 of
  every byte (:mod:`~hybrid_offload.core.file_digest`: hashed once per file version, then
  cached). Any changed byte changes the identity (a partial fine-tune, a merged adapter);
  copies of the same files share it, whatever their file times.
* Otherwise (weights streamed from elsewhere) the identity says so, and the caller warns.

A LoRA adapter (:func:`adapter_identity`) is named the same way by its top-level files (where
vLLM loads them from) and its JSON files (``adapter_config.json``: rank, alpha, targets). A
file that cannot be read raises :class:`OSError` to :func:`adapter_identity`'s caller (a
request skips the cache); :func:`weights_identity` reports it as unidentified.

Pure: no vLLM, no torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from hybrid_offload.core.file_digest import file_sha256_many

__all__ = ["CODE_SUFFIXES", "WEIGHT_SUFFIXES", "adapter_identity", "hub_commit", "weights_identity"]

#: files whose bytes are weights
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".msgpack", ".h5")
#: files whose bytes are model code (``trust_remote_code``)
CODE_SUFFIXES = (".py",)
_COMMIT = re.compile(r"[0-9a-f]{40}")


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
    out = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if recursive else []
        out.extend(Path(dirpath, f) for f in filenames
                   if not f.startswith(".") and f.endswith(suffixes))
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
                return {"files": _file_entries(files, directory),
                        "code": _file_entries(_weight_files(directory, suffixes=CODE_SUFFIXES), directory)}
            except OSError as exc:
                return {"unidentified": f"{model}: {exc.strerror}"}
    elif directory.is_file() and directory.suffix in WEIGHT_SUFFIXES:  # a single GGUF file
        try:
            return {"files": _file_entries([directory], directory.parent)}
        except OSError as exc:
            return {"unidentified": f"{model}: {exc.strerror}"}
    return {"unidentified": str(model)}


def adapter_identity(path: str) -> dict[str, Any]:
    """A JSON-able identity of a LoRA adapter at ``path``: its JSON and weight files as for a
    model, top level only. Raises OSError when a file of it cannot be read."""
    if "\x00" in path:
        return {"unidentified": path}
    commit = hub_commit(path)
    if commit is not None:
        return {"hub_commit": commit}
    directory = Path(path)
    if not directory.is_dir():
        return {"unidentified": path}
    files = _weight_files(directory, recursive=False, suffixes=(".json", *WEIGHT_SUFFIXES))
    return {"files": _file_entries(files, directory)}
