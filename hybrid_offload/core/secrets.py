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

import hmac
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["Secret", "SecretError", "literal_secret_error", "read_secret", "secret_from_options"]


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
    """The secret from ``file`` or from the variable named ``env`` (None when neither is given).

    Raises :class:`SecretError` naming ``what`` when both are given, the file is missing, not a
    regular file, world-writable or empty, or the variable is unset or empty.
    """
    if file is not None and env is not None:
        raise SecretError(f"{what}: give a file or an environment variable, not both")
    if file is not None:
        try:
            st = os.stat(file)
        except OSError as exc:
            raise SecretError(f"{what}: cannot read secret file {file!r}: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"{what}: secret file {file!r} is not a regular file")
        if st.st_mode & stat.S_IWOTH:
            raise SecretError(f"{what}: secret file {file!r} is world-writable")
        if st.st_mode & stat.S_IROTH:
            logger.warning("%s: secret file %r is readable by every user (chmod 600 it)", what, file)
        with open(file, "rb") as f:
            value = f.read()
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
