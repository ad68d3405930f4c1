"""Backend's public methods check once and call the subclass's ``_`` methods (backends/base.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import pytest

from hybrid_offload.backends.base import (
    Backend,
    BackendClosedError,
    BackendConfig,
    Buffer,
    InvalidKeyError,
)

KEY = "5eed0001-00112233"


class DictBackend(Backend):
    """The least a backend implements: the abstract ``_`` methods, over a dict."""

    type_name: ClassVar[str] = "test_dict"

    def __init__(self) -> None:
        super().__init__(BackendConfig("test_dict", "t", 1 << 20))
        self.pages: dict[str, bytes] = {}
        self.calls: list[str] = []
        self.closes = 0

    def _put_batch(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        self.calls.append("put")
        self.pages.update((key, bytes(buf)) for key, buf in items)
        return [True] * len(items)

    def _get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        self.calls.append("get")
        return [self.pages.get(key) for key in keys]

    def _contains_batch(self, keys: Sequence[str]) -> list[bool]:
        self.calls.append("contains")
        return [key in self.pages for key in keys]

    def _delete_batch(self, keys: Sequence[str]) -> int:
        self.calls.append("delete")
        return sum(self.pages.pop(key, None) is not None for key in keys)

    def _used_bytes(self) -> int:
        self.calls.append("used")
        return sum(map(len, self.pages.values()))

    def _close(self) -> None:
        self.closes += 1


CALLS: list[tuple[str, Any]] = [
    ("put_batch", lambda keys: ([(k, b"x") for k in keys],)),
    ("get_batch", lambda keys: (keys,)),
    ("get_into", lambda keys: (keys, [memoryview(bytearray(4)) for _ in keys])),
    ("get_prefix", lambda keys: (keys, 2, [4] * len(keys))),
    ("contains_batch", lambda keys: (keys,)),
    ("delete_batch", lambda keys: (keys,)),
    ("touch_batch", lambda keys: (keys,)),
]


@pytest.mark.parametrize(("method", "args"), CALLS)
def test_bad_keys_are_refused_before_the_subclass_is_called(method: str, args: Any) -> None:
    backend = DictBackend()
    with pytest.raises(InvalidKeyError):
        getattr(backend, method)(*args([KEY, "../etc"]))
    assert backend.calls == []


@pytest.mark.parametrize(("method", "args"), [*CALLS, ("used_bytes", lambda keys: ())])
def test_every_call_after_close_raises_closed(method: str, args: Any) -> None:
    backend = DictBackend()
    backend.close()
    with pytest.raises(BackendClosedError, match="test_dict backend 't' is closed"):
        getattr(backend, method)(*args([KEY]))
    assert backend.calls == []


def test_close_runs_the_subclass_close_once() -> None:
    backend = DictBackend()
    with backend:
        pass
    backend.close()
    assert backend.closes == 1


def test_defaults_fill_in_get_into_get_prefix_touch_and_scan() -> None:
    backend = DictBackend()
    backend.put_batch([(KEY, b"abc")])
    buffers = [memoryview(bytearray(4)), memoryview(bytearray(2))]
    assert backend.get_into([KEY, KEY], buffers) == [3, None]  # too large for its buffer: a miss
    assert bytes(buffers[0][:3]) == b"abc"
    assert backend.get_prefix([KEY], 2, [3]) == [b"ab"]
    backend.touch_batch([KEY])
    with pytest.raises(ValueError, match="differ in length"):
        backend.get_into([KEY], [])
    with pytest.raises(ValueError, match="differ in length"):
        backend.get_prefix([KEY], 2, [])
    assert backend.calls == ["put", "get", "get"]
    scan = backend.scan("5eed")  # a generator: errors come from next()
    with pytest.raises(NotImplementedError, match="test_dict"):
        next(scan)
    with pytest.raises(InvalidKeyError):
        next(backend.scan("NOT HEX"))
