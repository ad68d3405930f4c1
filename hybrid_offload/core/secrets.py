"""Secrets (a Redis password, a peer token, the page-signing key) come from a file or from the
environment, never from a command line or a config value (vLLM's ``--kv-transfer-config`` is a
command-line argument, visible to every local user in ``ps``).

Convention for a secret option ``X``: ``X_file`` (a path; one trailing newline is stripped) or
``X_env`` (the name of an environment variable), not both; a literal ``X`` is refused by the
component that owns it, with :func:`literal_secret_error`. A :class:`Secret` never shows its
value in ``repr``/``str`` (logs, tracebacks, config dumps).

Pure: no vLLM, no torch.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: a secret file longer than this is refused (a token or key is tens of bytes)
MAX_SECRET_BYTES = 4096
_CREATE_HINT = (
    " (hybrid-offload serve and hybrid-offload peer create a missing one; by hand: "
    "umask 077; openssl rand -hex 32 > FILE)"
)

__all__ = [
    "Secret", "SecretError", "create_secret_file", "literal_secret_error", "read_secret",
    "secret_from_options",
]


class SecretError(ValueError):
    """A secret option is malformed, or its file or variable cannot be read."""


@dataclass(frozen=True)
class Secret:
    """Secret bytes that print as ``***``."""

    value: bytes = field(repr=False)

    def __repr__(self) -> str:
        return "Secret(***)"

    __str__ = __repr__

    def text(self) -> str:
        return self.value.decode()

    def subkey(self, purpose: str) -> bytes:
        """A key for one use of a cache secret (``"chain"``: page keys, ``"page"``: page
        signatures), HMAC-SHA256 of the purpose under the secret: no output of one use is
        valid for another."""
        return hmac.digest(self.value, b"hybrid-offload/" + purpose.encode(), "sha256")


def literal_secret_error(what: str, option: str) -> SecretError:
    """The error for a secret given literally (it would end up on a command line)."""
    return SecretError(
        f"{what}: a literal {option!r} is refused (it would be visible on command lines and in "
        f"logs); give {option + '_file'!r} (a file holding it) or {option + '_env'!r} (the name "
        "of an environment variable holding it)"
    )


def read_secret(*, file: str | None = None, env: str | None = None, what: str) -> Secret | None:
    """The secret from ``file`` (a leading ``~`` expanded) or from the variable named ``env``
    (None when neither is given).

    Raises :class:`SecretError` naming ``what`` when both are given, the variable is unset or
    empty, or the file is missing, empty, not a regular file, owned by a user other than this
    one or root, or writable by group or others (whoever can write it chooses the secret), or
    when the directory it is named in is writable by group or others (``/tmp`` too, sticky or
    not: another user could put a link there, before the file exists, to a file whose content
    they know), or the directory of the file a link leads to is (without the sticky bit). A
    file readable by others is accepted with a warning: Kubernetes mounts secrets 0644 by
    default (set ``defaultMode: 0400``). A symlink is followed (Kubernetes secret files are
    symlinks); the checks apply to the file it names, as opened.
    """
    if file is not None and env is not None:
        raise SecretError(f"{what}: give a file or an environment variable, not both")
    if file is not None:
        path = os.path.expanduser(file)
        _check_secret_dirs(file, path, what)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            hint = _CREATE_HINT if exc.errno == errno.ENOENT else ""
            raise SecretError(f"{what}: cannot read secret file {file!r}: {exc.strerror}{hint}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            _check_secret_file(file, st, what)
            value = f.read(MAX_SECRET_BYTES + 1)
        if len(value) > MAX_SECRET_BYTES:
            raise SecretError(f"{what}: secret file {file!r} is larger than {MAX_SECRET_BYTES} bytes")
        value = value[:-1] if value.endswith(b"\n") else value
        value = value[:-1] if value.endswith(b"\r") else value
        if not value:
            raise SecretError(f"{what}: secret file {file!r} is empty")
        return Secret(value)
    if env is not None:
        value_s = os.environ.get(env)
        if not value_s:
            raise SecretError(f"{what}: environment variable {env!r} is unset or empty")
        return Secret(value_s.encode())
    return None


def _check_secret_dirs(file: str, path: str, what: str) -> None:
    """The directory ``file`` is named in must be writable by its owner only; the directory of
    the file it leads to (through links), by its owner or, with the sticky bit, by whoever
    (a file there can only be replaced by its owner, and the file's owner is checked)."""
    named = os.path.dirname(os.path.abspath(path))
    target = os.path.dirname(os.path.realpath(path))
    for directory, sticky_ok in ((named, False), (target, True)):
        try:
            st = os.stat(directory)
        except OSError:
            continue  # the file's open says what is wrong
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (sticky_ok and st.st_mode & stat.S_ISVTX):
            raise SecretError(
                f"{what}: secret file {file!r} is in {directory!r}, a directory other users can "
                "write: one of them could replace it, or put a link there to a file whose content "
                "they know. Keep secret files in a directory only you can write (e.g. "
                "~/.config/hybrid-offload, 0700)"
            )


def _check_secret_file(file: str, st: os.stat_result, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise SecretError(f"{what}: secret file {file!r} is not a regular file")
    if st.st_uid not in (os.geteuid(), 0):
        raise SecretError(
            f"{what}: secret file {file!r} belongs to uid {st.st_uid}: a secret file must belong to "
            "the user running hybrid-offload (or root)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SecretError(f"{what}: secret file {file!r} is writable by group or others (chmod 600 it)")
    if st.st_mode & stat.S_IROTH:
        logger.warning("%s: secret file %r is readable by every user (chmod 600 it)", what, file)


def create_secret_file(file: str) -> bool:
    """Create ``file`` (a leading ``~`` expanded) holding a new random secret (32 bytes, hex),
    mode 0600, in a directory created 0700, unless it exists; whether it was created. The file
    appears whole or not at all (written and synced under a temporary name, then hard-linked to
    ``file``, which fails where it exists): two processes racing get the same file and never
    read a half-written one, and a crash leaves no empty file. Raises :class:`SecretError` when
    it cannot."""
    path = os.path.expanduser(file)
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SecretError(f"cannot create secret file {file!r}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        return False
    except OSError as exc:
        raise SecretError(f"cannot create secret file {file!r}: {exc.strerror}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return True


def secret_from_options(options: Mapping[str, Any], option: str, *, what: str) -> Secret | None:
    """Read secret ``option`` from a backend's options (``option_file`` / ``option_env``);
    a literal ``option`` raises :class:`SecretError`."""
    if options.get(option) is not None:
        raise literal_secret_error(what, option)
    file, env = options.get(f"{option}_file"), options.get(f"{option}_env")
    for key, value in ((f"{option}_file", file), (f"{option}_env", env)):
        if value is not None and (not isinstance(value, str) or not value):
            raise SecretError(f"{what}: {key!r} must be a non-empty string, got {value!r}")
    return read_secret(file=file, env=env, what=what)
