"""``FaultyBackend``: any backend, with faults injected on demand (tests, chaos runs).

Two ways to get one:

* wrap a backend you hold: ``faulty = FaultyBackend(backend)``;
* configure one wherever a backend is configured (the connector's ``backends`` list, a
  :class:`~hybrid_offload.backends.BackendConfig`), by class path (:data:`FAULTY`)::

      {"type": "hybrid_offload.testing.faulty:FaultyBackend", "name": "flaky",
       "capacity_bytes": "1GiB", "inner": {"type": "disk", "path": "/tmp/cache"},
       "fail": ["put_batch"], "fail_with": "unavailable", "delay_s": {"get_into": 0.5},
       "in_place": false}

  ``inner`` is the wrapped backend's ``type`` and options (it gets this entry's ``name`` and
  ``capacity_bytes``); ``fail``: calls that fail from the start (until :meth:`~FaultyBackend.heal`),
  with ``fail_with`` (:data:`FAIL_WITH`: the medium gone, or a bug: what no backend should raise);
  ``delay_s``: seconds each call of an op waits first; ``in_place: false``: callers copy even
  from a backend that lends in place (loads go through staging, as from a disk or a server).
  :func:`faulty_config` builds such a config from the inner one; :func:`faulty_in` finds the
  instance under the connector's wrappers, so a test flips its switches after it was opened.

Switches are per instance (thread-safe; the wrapped backend's class is never changed):
:meth:`~FaultyBackend.fail`, :meth:`~FaultyBackend.corrupt_reads`, :meth:`~FaultyBackend.hold`
and :meth:`~FaultyBackend.release`, :meth:`~FaultyBackend.delay`, :meth:`~FaultyBackend.heal`;
``calls`` counts the data calls that reached the wrapper. With no switch on, it keeps the
backend contract (``tests/contract/test_wrapped_contract.py``).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hybrid_offload.backends import (
    Backend,
    BackendConfig,
    BackendConfigError,
    BackendUnavailableError,
    PageLease,
    backend_class,
    create_backend,
)
from hybrid_offload.backends.wrappers import DATA_CALLS, BackendWrapper

__all__ = ["FAULTY", "FaultyBackend", "faulty_config", "faulty_in"]

#: the ``type`` that configures a :class:`FaultyBackend`
FAULTY = f"{__name__}:FaultyBackend"
#: the calls whose pages :meth:`FaultyBackend.corrupt_reads` corrupts
READS = ("get_into", "get_batch", "lease_batch")
_FLAGS = ("shared_index", "hit_source", "touch_refreshes", "in_place")
#: the options of a configured :class:`FaultyBackend` and their defaults
OPTION_DEFAULTS: dict[str, Any] = {"inner": None, "fail": [], "fail_with": "unavailable", "delay_s": {},
                                   "in_place": None}  # fmt: skip
#: ``fail_with`` -> what a configured failing call raises
FAIL_WITH: dict[str, Callable[[str], Exception]] = {
    "unavailable": lambda op: BackendUnavailableError(f"injected {op} failure"),
    "bug": lambda op: RuntimeError(f"injected bug in {op}"),  # not a BackendError: a broken backend
}


class FaultyBackend(BackendWrapper):
    """A backend whose data calls fail, return corrupted pages, wait or block, on demand.

    ``inner`` is the backend to wrap, or a validated config of this type (its ``inner`` option
    is then created, and its ``fail``, ``delay_s`` and ``in_place`` switched on). ``sleep``
    serves ``delay_s`` (tests inject it).
    """

    def __init__(
        self, inner: Backend | BackendConfig, *, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        config, options = None, OPTION_DEFAULTS
        if isinstance(inner, BackendConfig):
            config, options = inner, FaultyBackend.validate_options(dict(inner.options))
            inner = create_backend(_inner_config(config, options["inner"]))
        super().__init__(inner)
        self._config = config
        self._sleep = sleep
        self._lock = threading.Lock()
        self._failures: dict[str, tuple[int | None, Exception]] = {}
        self._corrupt = 0
        self._held: dict[str, threading.Event] = {}
        self._delays: dict[str, float] = dict(options["delay_s"])
        #: data calls that reached this wrapper, per method name
        self.calls: dict[str, int] = {}
        for op in options["fail"]:
            self.fail(op, times=None, error=FAIL_WITH[options["fail_with"]](op))
        if options["in_place"] is False:
            self.in_place = False

    # -- configured by type ------------------------------------------------------------------

    @classmethod
    def validate_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """Defaults filled in, ``inner`` validated by its own type; raises
        :class:`~hybrid_offload.backends.BackendConfigError` naming a bad key."""
        unknown = sorted(set(options) - set(OPTION_DEFAULTS))
        if unknown:
            raise BackendConfigError(f"faulty: unknown key(s) {unknown} (allowed: {sorted(OPTION_DEFAULTS)})")
        out = {**OPTION_DEFAULTS, **options}
        inner = out["inner"]
        if not isinstance(inner, Mapping) or not isinstance(inner.get("type"), str):
            raise BackendConfigError(f"faulty: 'inner' must be a mapping with a 'type', got {inner!r}")
        spec = {k: v for k, v in inner.items() if k != "type"}
        try:
            out["inner"] = {"type": inner["type"], **backend_class(inner["type"]).validate_options(spec)}
        except BackendConfigError as exc:
            raise BackendConfigError(f"faulty: 'inner': {exc}") from exc
        if isinstance(out["fail"], str) or not isinstance(out["fail"], Iterable):
            raise BackendConfigError(f"faulty: 'fail' must be a list of calls, got {out['fail']!r}")
        out["fail"] = [_checked_op(op, "fail") for op in out["fail"]]
        fail_with = out["fail_with"]
        if not isinstance(fail_with, str) or fail_with not in FAIL_WITH:
            choices = ", ".join(FAIL_WITH)
            raise BackendConfigError(f"faulty: 'fail_with' must be one of {choices}, got {fail_with!r}")
        delays = out["delay_s"]
        if not isinstance(delays, Mapping) or not all(
            isinstance(s, int | float) and not isinstance(s, bool) and s >= 0 for s in delays.values()
        ):
            raise BackendConfigError(f"faulty: 'delay_s' must map calls to seconds >= 0, got {delays!r}")
        out["delay_s"] = {_checked_op(op, "delay_s"): float(s) for op, s in delays.items()}
        if out["in_place"] not in (None, False):
            raise BackendConfigError(f"faulty: 'in_place' can only be false, got {out['in_place']!r}")
        return out

    @classmethod
    def implementation(cls, options: dict[str, Any]) -> type[FaultyBackend]:
        """A subclass with the class flags (``shared_index``, ``hit_source``...) of the class
        serving ``inner``: what the scheduler reads before it opens anything."""
        options = cls.validate_options(dict(options))
        spec = {k: v for k, v in options["inner"].items() if k != "type"}
        served = backend_class(options["inner"]["type"]).implementation(spec)
        return _serving(served, options["in_place"] is False)

    @property
    def config(self) -> Any:
        """This wrapper's config where it was configured, else the wrapped backend's."""
        return self._config if self._config is not None else self.inner.config

    # -- the switches ------------------------------------------------------------------------

    def fail(self, *ops: str, times: int | None = 1, error: Exception | None = None) -> None:
        """The next ``times`` calls of each of ``ops`` (default: every data call, the medium is
        gone) raise ``error`` (default :class:`~hybrid_offload.backends.BackendUnavailableError`)
        without reaching the backend; ``times=None``: until :meth:`heal`."""
        for op in ops or DATA_CALLS:
            _checked_op(op, "fail", ValueError)
        with self._lock:
            for op in ops or DATA_CALLS:
                self._failures[op] = (times, error or FAIL_WITH["unavailable"](op))

    def corrupt_reads(self, *, times: int = 1) -> None:
        """The next ``times`` reads (:data:`READS`) flip one byte in the middle of every page
        they return (a lease in place: in the backend's own memory, where it stays corrupt)."""
        with self._lock:
            self._corrupt = times

    def hold(self, op: str) -> threading.Event:
        """Block calls of ``op`` until the returned event is set (or :meth:`release`), so "does
        not block the caller" is checked without timing."""
        _checked_op(op, "hold", ValueError)
        with self._lock:
            return self._held.setdefault(op, threading.Event())

    def release(self, op: str) -> None:
        with self._lock:
            event = self._held.pop(op, None)
        if event is not None:
            event.set()

    def delay(self, op: str, seconds: float) -> None:
        """Every call of ``op`` waits ``seconds`` first (0: no more)."""
        _checked_op(op, "delay", ValueError)
        with self._lock:
            self._delays[op] = seconds

    def heal(self) -> None:
        """No more injected failures, corruption or delays (held calls stay held)."""
        with self._lock:
            self._failures.clear()
            self._corrupt = 0
            self._delays.clear()

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            self.calls[op] = self.calls.get(op, 0) + 1
            held, delay = self._held.get(op), self._delays.get(op, 0.0)
            times, error = self._failures.get(op, (0, None))
            if times is None or times > 0:
                if times is not None:
                    self._failures[op] = (times - 1, error)  # type: ignore[assignment]
            else:
                error = None
            corrupt = op in READS and self._corrupt > 0
            if corrupt:
                self._corrupt -= 1
        if held is not None:
            held.wait()
        if delay > 0:
            self._sleep(delay)
        if error is not None:
            raise error
        result = super()._call(op, *args)
        if corrupt:
            _corrupt(op, args, result)
        return result


def faulty_config(
    inner: BackendConfig,
    *,
    fail: Iterable[str] = (),
    fail_with: str = "unavailable",
    delay_s: Mapping[str, float] | None = None,
    in_place: bool | None = None,
) -> BackendConfig:
    """The config of a :class:`FaultyBackend` around ``inner`` (same name and capacity)."""
    options = {"inner": {"type": inner.type, **inner.options}, "fail": list(fail), "fail_with": fail_with,
               "delay_s": dict(delay_s or {}), "in_place": in_place}  # fmt: skip
    return BackendConfig(FAULTY, inner.name, inner.capacity_bytes, options=options)


def faulty_in(backend: Backend) -> FaultyBackend:
    """The :class:`FaultyBackend` in ``backend``'s chain of wrappers (``backend`` itself, or
    under the connector's instruments and health gate); ``LookupError`` if there is none."""
    current: Any = backend
    while not isinstance(current, FaultyBackend):
        if not isinstance(current, BackendWrapper):
            raise LookupError(f"no FaultyBackend in {backend!r}")
        current = current.inner
    return current


def _checked_op(op: Any, key: str, error: type[Exception] = BackendConfigError) -> str:
    if op not in DATA_CALLS:
        raise error(f"faulty: {key}: unknown call {op!r} (one of {', '.join(DATA_CALLS)})")
    return op


def _inner_config(config: BackendConfig, inner: Mapping[str, Any]) -> BackendConfig:
    options = {k: v for k, v in inner.items() if k != "type"}
    return BackendConfig(inner["type"], config.name, config.capacity_bytes, options=options)


@functools.cache
def _serving(served: type[Backend], copies: bool) -> type[FaultyBackend]:
    """The :class:`FaultyBackend` subclass that reports ``served``'s class flags."""
    flags = {flag: getattr(served, flag) for flag in _FLAGS}
    flags["in_place"] = flags["in_place"] and not copies
    return type(f"Faulty{served.__name__}", (FaultyBackend,), flags)


def _corrupt(op: str, args: tuple[Any, ...], result: Any) -> None:
    """Flip the middle byte of every page a read returned: in the caller's buffers
    (``get_into``), in the returned bytes (``get_batch``), in the lender's memory where a lease
    lends in place, else in the lease's copies."""
    if op == "lease_batch":
        lease: PageLease = result
        for i, view in enumerate(lease.views):
            if view is None or view.nbytes == 0:
                continue
            offset = lease.offsets[i]
            if lease.memory is not None and offset is not None:
                lease.memory[offset + view.nbytes // 2] ^= 0xFF
            else:
                flipped = bytearray(view)
                flipped[len(flipped) // 2] ^= 0xFF
                lease.views[i] = memoryview(bytes(flipped))
        return
    for i, got in enumerate(result):
        if not got:  # a miss, or an empty page: nothing to flip
            continue
        if op == "get_into":  # bytes written into the caller's buffer
            memoryview(args[1][i]).cast("B")[got // 2] ^= 0xFF
        else:
            flipped = bytearray(got)
            flipped[len(flipped) // 2] ^= 0xFF
            result[i] = bytes(flipped)
