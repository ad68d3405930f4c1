"""The backend contract suite: a class any backend's tests subclass (like fsspec's
``fsspec/tests/abstract``), ours and third parties' alike.

The contract is the docstring of :mod:`hybrid_offload.backends.base`; each test below checks one
clause of it and fails if the backend breaks that clause. A backend opts in with a test module
that subclasses :class:`BackendContract` and says how to make the backend::

    from hybrid_offload.backends import BackendConfig, create_backend
    from hybrid_offload.testing.backend_contract import BackendContract

    class TestFooContract(BackendContract):
        def make_backend(self, tmp_path, capacity_bytes):
            return create_backend(BackendConfig("my_pkg.foo:FooBackend", "t", capacity_bytes))

        def reopen(self, backend, tmp_path):  # only if pages survive a restart
            return create_backend(backend.config)

Optional clauses (listing, restarts, a shared index) are skipped where the backend says it does
not offer them. This module imports pytest (the only one of :mod:`hybrid_offload.testing` that
does); for pytest's detailed assertion messages, call
``pytest.register_assert_rewrite("hybrid_offload.testing.backend_contract")`` in a
``conftest.py`` before the test modules import it.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hybrid_offload.backends import (
    Backend,
    BackendClosedError,
    BackendStats,
    InvalidKeyError,
    PageInfo,
)
from hybrid_offload.testing.backend_pages import assert_pages, check_versioned, key, page, versioned_page

__all__ = ["BAD_KEYS", "DEFAULT_CAPACITY", "BackendContract", "key", "page"]

MiB = 1 << 20
DEFAULT_CAPACITY = 64 * MiB

#: keys every backend refuses before any I/O (:class:`~hybrid_offload.backends.InvalidKeyError`)
BAD_KEYS: list[Any] = [
    "../x",
    "a/b",
    "ABCDEF01-0123456789ABCDEF",
    "",
    123,
    None,
    b"12345678-12345678",
    "1234567-12345678",
    "12345678-12345678\n",
    "12345678_12345678",
    "12345678-12345678/../../x",
    " 12345678-12345678",
    "12345678-" + "0" * 65,
]


class BackendContract:
    """Contract tests; subclasses implement :meth:`make_backend` (and :meth:`reopen`)."""

    def make_backend(self, tmp_path: Path, capacity_bytes: int) -> Backend:
        """A fresh, empty backend; ``tmp_path`` is an empty directory private to it."""
        raise NotImplementedError

    def reopen(self, backend: Backend, tmp_path: Path) -> Backend | None:
        """A new instance on ``backend``'s storage (same config and ``tmp_path``), or None
        if the backend's pages do not survive a restart."""
        return None

    # -- fixtures --------------------------------------------------------------------------

    @pytest.fixture
    def open_backend(self, tmp_path: Path) -> Iterator[Callable[..., Backend]]:
        """Factory ``open_backend(capacity_bytes=64 MiB)``; closes everything it made."""
        opened: list[Backend] = []
        self._storage: dict[int, Path] = {}  # id(backend) -> its tmp_path

        def factory(capacity_bytes: int = DEFAULT_CAPACITY) -> Backend:
            storage = tmp_path / f"backend{len(opened)}"
            storage.mkdir()
            backend = self.make_backend(storage, capacity_bytes)
            self._storage[id(backend)] = storage
            opened.append(backend)
            return backend

        yield factory
        for backend in opened:
            backend.close()

    @pytest.fixture
    def backend(self, open_backend: Callable[..., Backend]) -> Backend:
        return open_backend()

    def _reopen(self, backend: Backend) -> Backend | None:
        return self.reopen(backend, self._storage[id(backend)])

    # -- round trips -----------------------------------------------------------------------

    def test_round_trip_many_pages(self, backend: Backend) -> None:
        rng = random.Random(1)
        sizes = [0, 1, 2, 7, 4095, 4096, 4097, 65536, 100_000, MiB - 1, MiB, MiB + 3]
        sizes += [rng.randrange(0, 70_000) for _ in range(28)]
        pages = {key(i): page(i, size) for i, size in enumerate(sizes)}
        items = list(pages.items())
        half = len(items) // 2
        assert backend.put_batch(items[:half]) == [True] * half  # one big batch
        for item in items[half:]:  # and single-page batches
            assert backend.put_batch([item]) == [True]
        got = backend.get_batch(list(pages))
        assert all(type(data) is bytes for data in got)
        assert_pages(got, list(pages.values()))
        assert backend.contains_batch(list(pages)) == [True] * len(pages)
        assert backend.used_bytes() == sum(sizes)

    def test_put_copies_caller_buffers(self, backend: Backend) -> None:
        original = page(5, 3000)
        as_bytearray = bytearray(original)
        as_view = memoryview(bytearray(original))
        assert backend.put_batch([(key(1), as_bytearray), (key(2), as_view)]) == [True, True]
        as_bytearray[:] = b"\0" * len(as_bytearray)
        as_view[:] = b"\1" * len(as_view)
        assert_pages(backend.get_batch([key(1), key(2)]), [original, original])

    def test_answers_per_key_in_input_order(self, backend: Backend) -> None:
        stored = {i: page(i, 100 + i) for i in range(0, 20, 2)}
        backend.put_batch([(key(i), data) for i, data in stored.items()])
        query = [3, 0, 3, 18, 100, 2, 0, 7, 4, 4, 19]
        keys = [key(i) for i in query]
        assert_pages(backend.get_batch(keys), [stored.get(i) for i in query])
        assert backend.contains_batch(keys) == [i in stored for i in query]
        buffers = [memoryview(bytearray(200)) for _ in query]
        sizes = backend.get_into(keys, buffers)
        assert sizes == [len(stored[i]) if i in stored else None for i in query]
        for i, buf, size in zip(query, buffers, sizes, strict=True):
            if size is not None:
                assert_pages(bytes(buf[:size]), stored[i], f"page {i} by get_into")

    def test_empty_batches(self, backend: Backend) -> None:
        assert backend.put_batch([]) == []
        assert backend.get_batch([]) == []
        assert backend.get_into([], []) == []
        assert backend.contains_batch([]) == []
        assert backend.delete_batch([]) == 0
        assert backend.used_bytes() == 0

    def test_get_into_buffer_sizes(self, backend: Backend) -> None:
        sizes = [0, 10, 4096, MiB]
        pages = [page(i, size) for i, size in enumerate(sizes)]
        keys = [key(i) for i in range(len(sizes))]
        backend.put_batch(list(zip(keys, pages, strict=True)))

        exact = [memoryview(bytearray(size)) for size in sizes]
        assert backend.get_into(keys, exact) == sizes
        assert_pages([bytes(buf) for buf in exact], pages)

        larger = [memoryview(bytearray(b"\xab" * (size + 100))) for size in sizes]
        assert backend.get_into(keys, larger) == sizes
        for data, buf in zip(pages, larger, strict=True):
            assert_pages(bytes(buf[: len(data)]), data)
            assert_pages(bytes(buf[len(data) :]), b"\xab" * 100, "bytes past the page")  # untouched

        smaller = [memoryview(bytearray(size - 1)) for size in sizes[1:]]
        assert backend.get_into(keys[1:], smaller) == [None] * len(smaller)
        assert backend.get_into([key(99)], [memoryview(bytearray(10))]) == [None]
        with pytest.raises(ValueError):
            backend.get_into(keys, exact[:-1])
        frozen = pages[2]
        with pytest.raises(ValueError, match="read-only"):  # before any I/O: nothing written
            backend.get_into(keys[2:3], [memoryview(frozen)])
        assert_pages(frozen, page(2, sizes[2]), "the read-only buffer")

    def test_contains_and_delete(self, backend: Backend) -> None:
        keys = [key(i) for i in range(4)]
        backend.put_batch([(k, page(i, 500)) for i, k in enumerate(keys)])
        assert backend.contains_batch(keys) == [True] * 4
        assert backend.delete_batch([keys[0], key(77), keys[2], keys[0]]) == 2
        assert backend.contains_batch(keys) == [False, True, False, True]
        assert_pages(backend.get_batch(keys), [None, page(1, 500), None, page(3, 500)])
        assert backend.used_bytes() == 1000
        assert backend.delete_batch(keys) == 2
        assert backend.used_bytes() == 0

    def test_overwrite_replaces_bytes(self, backend: Backend) -> None:
        for version, size in enumerate([1000, 500, 2000, 0]):
            assert backend.put_batch([(key(1), page(version, size))]) == [True]
            assert_pages(backend.get_batch([key(1)]), [page(version, size)])
            assert backend.used_bytes() == size

    @pytest.mark.parametrize("bad", BAD_KEYS, ids=repr)
    def test_invalid_keys_rejected_before_any_io(
        self, open_backend: Callable[..., Backend], tmp_path: Path, bad: Any
    ) -> None:
        backend = open_backend()
        good = key(1)
        buf = memoryview(bytearray(10))
        calls: list[Callable[[], object]] = [
            lambda: backend.put_batch([(good, b"x" * 10), (bad, b"y" * 10)]),
            lambda: backend.get_batch([good, bad]),
            lambda: backend.get_into([good, bad], [buf, buf]),
            lambda: backend.contains_batch([good, bad]),
            lambda: backend.delete_batch([good, bad]),
        ]
        for call in calls:
            with pytest.raises(InvalidKeyError):
                call()
        assert issubclass(InvalidKeyError, ValueError)
        assert backend.contains_batch([good]) == [False]
        assert backend.used_bytes() == 0
        assert [p for p in tmp_path.rglob("*") if not p.is_dir()] == []

    # -- pages in place (copies where the backend does not lend in place) -----------------

    def test_lease_lends_pages_in_key_order(self, backend: Backend) -> None:
        pages = {key(i): page(i, 100 + 37 * i) for i in range(5)}
        backend.put_batch(list(pages.items()))
        asked = [key(3), key(99), key(0), key(4)]
        lease = backend.lease_batch(asked)
        try:
            lent = [None if v is None else bytes(v) for v in lease.views]
            assert_pages(lent, [pages[key(3)], None, pages[key(0)], pages[key(4)]])
            assert all(v is None or v.readonly for v in lease.views)
            if backend.in_place:
                assert lease.memory is not None
                for view, offset in zip(lease.views, lease.offsets, strict=True):
                    if view is not None:
                        assert offset is not None
                        assert_pages(bytes(lease.memory[offset : offset + view.nbytes]), bytes(view))
        finally:
            lease.release()
            lease.release()  # idempotent

    def test_leased_bytes_stay_while_the_page_goes(self, open_backend: Callable[..., Backend]) -> None:
        """Deleting, replacing or evicting a leased page never changes the lent bytes."""
        backend = open_backend(4000)
        backend.put_batch([(key(0), page(0, 1000)), (key(1), page(1, 1000))])
        lease = backend.lease_batch([key(0), key(1)])
        backend.delete_batch([key(0)])
        backend.put_batch([(key(1), page(11, 1000))])
        backend.put_batch([(key(i), page(i, 1000)) for i in range(2, 9)])  # evicts everything older
        assert_pages([bytes(v) for v in lease.views if v is not None], [page(0, 1000), page(1, 1000)])
        lease.release()
        assert backend.used_bytes() <= 4000

    def test_reservation_is_invisible_until_committed(self, backend: Backend) -> None:
        res = backend.reserve_batch([key(1), key(2), key(3)], [500, 0, 700])
        for i, view in zip((1, 2, 3), res.views, strict=True):
            assert view is not None and view.nbytes == len(page(i, 500 if i == 1 else (0 if i == 2 else 700)))
            view[:] = page(i, view.nbytes)
        assert backend.contains_batch([key(1), key(3)]) == [False, False]
        assert res.commit([True, True, False]) == [True, True, False]
        assert res.commit() == [False, False, False]  # only the first commit counts
        assert_pages(backend.get_batch([key(1), key(2), key(3)]), [page(1, 500), b"", None])

    def test_reservation_commits_in_the_order_given(self, open_backend: Callable[..., Backend]) -> None:
        """The last key published ends most recent: eviction follows the commit order."""
        backend = open_backend(4000)
        keys = [key(i) for i in range(4)]
        res = backend.reserve_batch(keys, [1000] * 4)
        for i, view in enumerate(res.views):
            assert view is not None
            view[:] = page(i, 1000)
        assert res.commit(order=[3, 2, 1, 0]) == [True] * 4  # key 3 oldest, key 0 newest
        backend.put_batch([(key(9), page(9, 1000))])
        if backend.touch_refreshes:  # an LRU this process orders (others may order by time)
            assert backend.contains_batch(keys) == [True, True, True, False]

    def test_reservation_abort_and_refusal(self, open_backend: Callable[..., Backend]) -> None:
        backend = open_backend(4000)
        backend.put_batch([(key(0), page(0, 1000))])
        res = backend.reserve_batch([key(0), key(1)], [1000, 4001])
        assert res.views[1] is None  # larger than the capacity: refused
        assert res.views[0] is not None
        res.views[0][:] = page(9, 1000)
        res.abort()
        assert_pages(backend.get_batch([key(0), key(1)]), [page(0, 1000), None])  # the old version stays
        with pytest.raises(InvalidKeyError):
            backend.reserve_batch(["../x"], [10])
        with pytest.raises(ValueError):
            backend.reserve_batch([key(2)], [10, 20])

    # -- capacity and eviction -------------------------------------------------------------

    def test_used_bytes_never_exceeds_capacity(self, open_backend: Callable[..., Backend]) -> None:
        capacity = 20_000
        backend = open_backend(capacity)
        rng = random.Random(7)
        latest: dict[int, bytes] = {}
        for step in range(120):
            ids = [rng.randrange(60) for _ in range(rng.randint(1, 8))]
            items = [(i, page(step * 100 + i, rng.randrange(0, 5000))) for i in ids]
            assert backend.put_batch([(key(i), data) for i, data in items]) == [True] * len(ids)
            latest.update(items)
            assert backend.used_bytes() <= capacity
        got = backend.get_batch([key(i) for i in latest])
        present = [data for data in got if data is not None]
        assert present, "the most recent put should still be stored"
        assert sum(map(len, present)) == backend.used_bytes()
        for i, data in zip(latest, got, strict=True):
            if data is not None:
                assert_pages(data, latest[i], f"page {i}")

    def test_lru_evicts_least_recently_used(self, open_backend: Callable[..., Backend]) -> None:
        backend = open_backend(4000)
        k = [key(i) for i in range(7)]
        for i in range(4):
            backend.put_batch([(k[i], page(i, 1000))])
        backend.get_batch([k[0]])  # a get refreshes k0: k1 is now least recently used
        backend.put_batch([(k[4], page(4, 1000))])
        assert backend.contains_batch(k[:5]) == [True, False, True, True, True]
        backend.put_batch([(k[2], page(22, 1000))])  # a re-put refreshes k2: k3 is next
        backend.put_batch([(k[5], page(5, 1000))])
        assert backend.contains_batch(k[:6]) == [True, False, True, False, True, True]
        backend.contains_batch([k[0]])  # contains does not refresh: k0 goes next
        backend.put_batch([(k[6], page(6, 1000))])
        assert backend.contains_batch(k) == [False, False, True, False, True, True, True]
        assert backend.used_bytes() == 4000

    def test_touch_refreshes_recency_in_order(self, open_backend: Callable[..., Backend]) -> None:
        backend = open_backend(4000)
        k = [key(i) for i in range(6)]
        for i in range(4):
            backend.put_batch([(k[i], page(i, 1000))])
        backend.touch_batch([k[5], k[1], k[0]])  # k5 absent: ignored; k1 then k0 most recent
        with pytest.raises(InvalidKeyError):
            backend.touch_batch(["../x"])
        backend.put_batch([(k[4], page(4, 1000))])
        if not backend.touch_refreshes:
            assert backend.contains_batch(k[:2]) == [False, True]  # a no-op: k0 was oldest
            return
        assert backend.contains_batch(k) == [True, True, False, True, True, False]
        backend.put_batch([(k[5], page(5, 1000))])
        assert backend.contains_batch(k) == [True, True, False, False, True, True]
        assert_pages(backend.get_batch([k[0], k[1]]), [page(0, 1000), page(1, 1000)])

    def test_page_larger_than_capacity_refused(self, open_backend: Callable[..., Backend]) -> None:
        backend = open_backend(4000)
        keys = [key(i) for i in range(3)]
        backend.put_batch([(k, page(i, 1000)) for i, k in enumerate(keys)])
        assert backend.put_batch([(key(10), page(10, 4001))]) == [False]
        assert backend.put_batch([(keys[0], page(11, 4001))]) == [False]  # re-put too large
        assert_pages(backend.get_batch(keys), [page(i, 1000) for i in range(3)])
        assert backend.used_bytes() == 3000
        mixed = [(key(20), page(20, 500)), (key(21), page(21, 5000)), (key(22), page(22, 500))]
        assert backend.put_batch(mixed) == [True, False, True]
        assert backend.contains_batch([key(21)]) == [False]
        assert backend.stats.put_refused == 3
        assert backend.put_batch([(key(30), page(30, 4000))]) == [True]  # exactly fits
        assert backend.used_bytes() == 4000
        assert_pages(backend.get_batch([key(30)]), [page(30, 4000)])

    # -- counters, threads, lifecycle ------------------------------------------------------

    def test_stats_counters(self, open_backend: Callable[..., Backend]) -> None:
        backend = open_backend(3000)
        assert backend.stats == BackendStats()
        backend.put_batch([(key(0), page(0, 1000)), (key(1), page(1, 1000))])
        backend.put_batch([(key(2), page(2, 3001))])
        backend.get_batch([key(0), key(9), key(1)])
        backend.get_into([key(0), key(8)], [memoryview(bytearray(1000))] * 2)
        backend.put_batch([(key(3), page(3, 1000)), (key(4), page(4, 1000))])
        assert backend.stats == BackendStats(
            puts=4,
            put_bytes=4000,
            put_refused=1,
            gets=5,
            hits=3,
            get_bytes=3000,
            evictions=1,
            evicted_bytes=1000,
            errors=0,
        )

    def test_thread_safety(self, open_backend: Callable[..., Backend]) -> None:
        capacity = 20_000
        backend = open_backend(capacity)
        n_keys, n_threads = 32, 8
        barrier = threading.Barrier(n_threads)
        failures: list[BaseException] = []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                barrier.wait()
                for _ in range(150):
                    ids = [rng.randrange(n_keys) for _ in range(rng.randint(1, 6))]
                    keys = [key(i) for i in ids]
                    op = rng.random()
                    if op < 0.4:
                        items = [(key(i), versioned_page(i, rng.randrange(10**6))) for i in ids]
                        assert all(isinstance(ok, bool) for ok in backend.put_batch(items))
                    elif op < 0.65:
                        for i, data in zip(ids, backend.get_batch(keys), strict=True):
                            if data is not None:
                                check_versioned(i, data)
                    elif op < 0.8:
                        bufs = [memoryview(bytearray(4096)) for _ in ids]
                        sizes = backend.get_into(keys, bufs)
                        for i, buf, size in zip(ids, bufs, sizes, strict=True):
                            if size is not None:
                                check_versioned(i, bytes(buf[:size]))
                    elif op < 0.95:
                        assert len(backend.contains_batch(keys)) == len(keys)
                    else:
                        backend.delete_batch(keys)
                    assert backend.used_bytes() <= capacity
            except BaseException as exc:  # reported by the main thread
                failures.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        assert not failures, f"{len(failures)} of {n_threads} threads failed; first: {failures[0]!r}"
        keys = [key(i) for i in range(n_keys)]
        got = backend.get_batch(keys)
        for i, data in enumerate(got):
            if data is not None:
                check_versioned(i, data)
        assert backend.contains_batch(keys) == [data is not None for data in got]
        assert sum(len(data) for data in got if data is not None) == backend.used_bytes()
        assert backend.used_bytes() <= capacity
        assert backend.stats.evictions > 0
        assert backend.stats.errors == 0

    def test_close_idempotent_then_calls_raise(self, backend: Backend) -> None:
        backend.put_batch([(key(1), b"data")])
        backend.close()
        backend.close()
        buf = memoryview(bytearray(10))
        calls: list[Callable[[], object]] = [
            lambda: backend.put_batch([(key(2), b"x")]),
            lambda: backend.get_batch([key(1)]),
            lambda: backend.get_into([key(1)], [buf]),
            lambda: backend.contains_batch([key(1)]),
            lambda: backend.delete_batch([key(1)]),
            backend.used_bytes,
        ]
        for call in calls:
            with pytest.raises(BackendClosedError):
                call()

    def test_context_manager_closes(self, backend: Backend) -> None:
        with backend as entered:
            assert entered is backend
            entered.put_batch([(key(1), b"data")])
        with pytest.raises(BackendClosedError):
            backend.used_bytes()

    # -- restarts and index mirrors --------------------------------------------------------

    def test_reopen_sees_pages(self, backend: Backend) -> None:
        pages = {key(i): page(i, 1000 * i) for i in range(6)}
        backend.put_batch(list(pages.items()))
        backend.close()
        reopened = self._reopen(backend)
        if reopened is None:
            pytest.skip(f"{type(backend).__name__}: pages do not survive a restart")
        with reopened:
            assert reopened.contains_batch(list(pages)) == [True] * len(pages)
            assert_pages(reopened.get_batch(list(pages)), list(pages.values()))
            assert reopened.used_bytes() == sum(map(len, pages.values()))

    def test_shared_index_second_instance_sees_pages(self, backend: Backend) -> None:
        if not backend.shared_index:
            pytest.skip("shared_index = False: other instances do not see this one's pages")
        other = self._reopen(backend)
        assert other is not None, "a shared_index backend must implement reopen()"
        with other:
            backend.put_batch([(key(1), page(1, 100))])
            assert other.contains_batch([key(1)]) == [True]
            assert_pages(other.get_batch([key(1)]), [page(1, 100)])
            backend.delete_batch([key(1)])
            assert other.contains_batch([key(1)]) == [False]
            assert other.get_batch([key(1)]) == [None]

    def test_take_evicted_reports_evictions_and_deletes(self, open_backend: Callable[..., Backend]) -> None:
        backend = open_backend(3000)
        if backend.shared_index:
            pytest.skip("shared_index = True: no index mirror to feed")
        k = [key(i) for i in range(6)]
        backend.put_batch([(k[i], page(i, 1000)) for i in range(3)])
        assert backend.take_evicted() == []
        backend.put_batch([(k[3], page(3, 1000))])
        assert backend.take_evicted() == [k[0]]
        assert backend.take_evicted() == []
        backend.delete_batch([k[1], k[5]])
        backend.put_batch([(k[4], page(4, 2000))])  # evicts k2 (k3, k4 fill it exactly)
        assert sorted(backend.take_evicted()) == sorted([k[1], k[2]])
        backend.put_batch([(k[3], page(3, 1000))])  # a re-put is not an eviction
        assert backend.take_evicted() == []

    # -- listing (optional: backends whose scan raises NotImplementedError skip these) -----

    def _scan(self, backend: Backend, prefix: str = "") -> dict[str, PageInfo]:
        """``scan(prefix)`` as key -> PageInfo; skips the test if the backend cannot list."""
        try:
            listed = list(backend.scan(prefix))
        except NotImplementedError as exc:
            pytest.skip(f"{type(backend).__name__} does not implement scan: {exc}")
        assert all(isinstance(info, PageInfo) for info in listed)
        by_key = {info.key: info for info in listed}
        assert len(by_key) == len(listed), "scan listed a key twice"
        return by_key

    def test_scan_lists_exactly_the_pages_with_sizes(self, backend: Backend) -> None:
        assert self._scan(backend) == {}
        before = time.time()
        pages = {key(i, ns): page(i, 100 * i) for i in range(12) for ns in (0x5EED0001, 0xABCD0002)}
        assert backend.put_batch(list(pages.items())) == [True] * len(pages)
        listed = self._scan(backend)
        assert {k: info.size for k, info in listed.items()} == {k: len(v) for k, v in pages.items()}
        for info in listed.values():  # redis idle times have 1 s resolution
            assert info.mtime is None or before - 2 <= info.mtime <= time.time() + 2

    def test_scan_omits_deleted_pages(self, backend: Backend) -> None:
        keys = [key(i) for i in range(6)]
        backend.put_batch([(k, page(i, 300)) for i, k in enumerate(keys)])
        assert backend.delete_batch(keys[::2]) == 3
        assert set(self._scan(backend)) == set(keys[1::2])
        backend.delete_batch(keys)
        assert self._scan(backend) == {}

    def test_scan_prefix_filters(self, backend: Backend) -> None:
        ours = [key(i, 0x5EED0001) for i in range(8)]
        theirs = [key(i, 0x5EED0002) for i in range(8)]
        backend.put_batch([(k, page(i, 50)) for i, k in enumerate(ours + theirs)])
        assert set(self._scan(backend, "5eed0001")) == set(ours)
        assert set(self._scan(backend, "5eed0001-")) == set(ours)
        assert set(self._scan(backend, "5eed")) == set(ours + theirs)
        digest_prefix = ours[3][: len("5eed0001-") + 3]
        assert set(self._scan(backend, digest_prefix)) == {k for k in ours if k.startswith(digest_prefix)}
        assert set(self._scan(backend, ours[5])) == {ours[5]}
        assert self._scan(backend, "5eed0003") == {}
        assert self._scan(backend, "5eed000").keys() == set(ours + theirs)

    @pytest.mark.parametrize("bad", ["A", "5eed0001/", "../x", "5eed-00-1", "x", " 5eed"], ids=repr)
    def test_scan_rejects_bad_prefixes(self, backend: Backend, bad: str) -> None:
        self._scan(backend)  # skips if the backend cannot list
        with pytest.raises(InvalidKeyError):
            list(backend.scan(bad))

    def test_scan_does_not_refresh_recency(self, open_backend: Callable[..., Backend]) -> None:
        backend = open_backend(3000)
        k = [key(i) for i in range(4)]
        for i in range(3):
            backend.put_batch([(k[i], page(i, 1000))])
        assert set(self._scan(backend)) == set(k[:3])
        backend.put_batch([(k[3], page(3, 1000))])  # evicts k0: the scan did not refresh it
        assert backend.contains_batch(k) == [False, True, True, True]
        assert set(self._scan(backend)) == set(k[1:])

    def test_scan_after_close_raises(self, backend: Backend) -> None:
        self._scan(backend)
        backend.close()
        with pytest.raises(BackendClosedError):
            list(backend.scan())
