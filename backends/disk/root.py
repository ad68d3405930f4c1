"""The disk backend's root directory: how the ``path`` option is spelled and which root is trusted.

* **Spelling.** ``path`` may start with ``~`` (the home directory) or ``$XDG_CACHE_HOME`` /
  ``${XDG_CACHE_HOME}`` (that variable when set to an absolute path, else ``~/.cache``, as the
  XDG base-directory spec says). No other ``$`` expansion: a ``$`` elsewhere is an error.
* **Trust.** The root is used only if it is a real directory (not a symbolic link), owned by the
  process's effective uid and not writable by group or others; a missing root is created
  ``0o700``. Anyone else able to write there could plant or read pages.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat

from ..base import BackendConfigError

__all__ = ["check_writable_root", "expand_path", "open_dir_below", "page_problem", "root_problem"]

_XDG = re.compile(r"\A\$(?:XDG_CACHE_HOME|\{XDG_CACHE_HOME\})(?=/|\Z)")


def expand_path(path: str) -> str:
    """``path`` with a leading ``~`` or ``$XDG_CACHE_HOME`` expanded; BackendConfigError names
    the key ``path`` for any other ``$`` or a ``~user`` that does not exist."""
    match = _XDG.match(path)
    if match:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
        path = base + path[match.end() :]
    elif path.startswith("~"):
        expanded = os.path.expanduser(path)
        if expanded.startswith("~"):
            raise BackendConfigError(
                f"backend type 'disk': option 'path': cannot expand {path!r} (no such user or home)"
            )
        path = expanded
    if "$" in path:
        raise BackendConfigError(
            f"backend type 'disk': option 'path': only a leading ~ or $XDG_CACHE_HOME is expanded, "
            f"got {path!r}"
        )
    return path


def root_problem(root: str) -> str | None:
    """Why ``root`` (an absolute path) must not hold pages, or None if it may (follows nothing)."""
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        return f"{root!r} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{root!r} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{root!r} is owned by uid {st.st_uid}, not by this process (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{root!r} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def check_writable_root(root: str, backend: str) -> None:
    """Create ``root`` if missing and write a probe file: a path that cannot hold pages, or an
    untrusted one, is a configuration error (naming ``path``) at start-up, not a runtime
    failure of every store."""
    probe = os.path.join(root, f".probe.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        problem = root_problem(root)
        if problem is not None:
            raise BackendConfigError(f"disk backend {backend!r}: option 'path': {problem}")
        os.close(os.open(probe, flags, 0o600))
        os.unlink(probe)
    except OSError as exc:
        raise BackendConfigError(
            f"disk backend {backend!r}: option 'path': {root!r} is not a writable directory: {exc}"
        ) from exc


def page_problem(st: os.stat_result, max_size: int) -> str | None:
    """Why a page file (its ``fstat``/``lstat``) must not be read, or None: it must be a regular
    file of this process's uid, not writable by group or others, at most ``max_size`` bytes."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "writable by group or others"
    if st.st_size > max_size:
        return f"{st.st_size} bytes, more than the capacity"
    return None


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir_below(root: str, parts: tuple[str, ...], create: bool) -> int:
    """A descriptor of ``root/parts...``, each component opened relative to its parent with
    ``O_NOFOLLOW`` (a symbolic link anywhere below the root raises ``OSError``, ELOOP/ENOTDIR);
    missing components are made ``0o700`` when ``create``. The caller closes it."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=fd)
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd
