"""Subscribe to one engine's KV events (vLLM's ZMQ publisher) and feed a :class:`CacheIndex`.

**Sockets.** vLLM 0.32's ``ZmqEventPublisher`` BINDS its PUB socket to a wildcard (``tcp://*:P``,
``[::]``), ``ipc://`` or ``inproc://`` endpoint and CONNECTS it to any other
(``tcp://127.0.0.1:P``); it always binds its ROUTER replay socket. So a subscriber connects where
the engine binds (a wildcard host read as this host: ``127.0.0.1`` / ``[::1]``) and binds the
address an engine connects to. ``bind=None`` decides from ``endpoint`` *written as in the
engine's* ``kv_events_config``; pass ``bind=False`` with the engine's host to reach a wildcard
engine elsewhere. A subscriber that binds ``tcp://HOST:0`` gets a port (:attr:`endpoint`) to give
the engine. The replay endpoint is always connected.

**Sequence.** Messages are ``(topic, seq, payload)``, ``seq`` 8 bytes big-endian, counted from 0
per engine process. With ``last`` the last applied number:

* ``seq == last + 1``: applied.
* ``seq > last + 1`` (a gap): batches ``[last + 1, seq)`` are asked from the replay socket
  (DEALER ``[b"", start]``; replies ``[b"", topic, seq, payload]`` until ``seq == -1``) within
  ``replay_timeout_s`` and applied in order, then the current one. The request starts at
  ``last`` and the engine's copy of it must equal ours: else the engine restarted (new process,
  buffer from 0) while we missed its first batches, and is reset and replayed from 0. A replay
  that is unavailable or incomplete: :meth:`CacheIndex.reset_engine` (``resyncs``), then the
  contiguous run of replayed batches just before ``seq`` (if any) and the current one.
* ``seq <= last``: the engine restarted (``restarts``; the same batch again is a duplicate,
  ignored): reset, and what the new process published before ``seq`` is replayed from 0.
* the first batch with ``seq > 0``: a router started after the engine; ``[0, seq)`` is replayed
  (the engine keeps ``buffer_steps``, 10 000 by default; less: a resync).
* the first batch after the SUB socket lost a connection (a ZMQ monitor event): the engine may
  have restarted and its new stream reached ``last + 1`` unseen, so batch ``last`` is checked
  as on a gap (without a replay socket: a resync).

**A stream it cannot trust.** Whoever can reach the endpoint can publish (see the security
model in docs/operations.md: publish on ``ipc://`` in a directory only the engine's user can
enter). So nothing a message holds stops the subscriber: where it binds (others connect to
publish), messages over :data:`MAX_MESSAGE_BYTES` are refused by ZMQ (``MAXMSGSIZE``: that
sender's connection is dropped; where it connects to the engine, the engine is the only
sender, and ZMQ would not connect again after such a drop); a payload that does not decode
(nested too deep, wrong types, over a decoding limit of :mod:`.events`) is counted
``malformed``; a gap of more than :data:`MAX_GAP` batches is not asked of the replay socket, it
is a resync; any other error while applying a batch is counted in ``errors`` and resyncs the
engine (its entries may hold half the batch), and polling goes on. What the index keeps of a
stream is bounded there (:mod:`.index`: media, groups, entries; the hash block size re-learnt).

One thread owns the sockets: call :meth:`poll` from yours, or :meth:`start` one (a daemon) and
:meth:`stop` it. The index has its own lock (queries come from the router's thread).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from hybrid_offload.router.events import MAX_PAYLOAD_BYTES, Event, MalformedBatchError, decode_batch
from hybrid_offload.router.index import CacheIndex

logger = logging.getLogger(__name__)

END_SEQ = -1
#: the largest message taken from an engine's sockets (a step's batch is far smaller)
MAX_MESSAGE_BYTES = MAX_PAYLOAD_BYTES
#: a gap of more batches than this is a resync without asking the replay socket (vLLM keeps
#: ``buffer_steps``, 10,000 by default): a forged sequence number must not size a request
MAX_GAP = 1 << 20
_WILDCARD = re.compile(r"^(tcp://)(\*|\[::\]|::|0\.0\.0\.0)(:\d+)$")


def engine_binds(endpoint: str) -> bool:
    """Whether vLLM's publisher binds ``endpoint`` (its ``ZmqEventPublisher._is_bind_endpoint``)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def reachable(endpoint: str) -> str:
    """``endpoint`` to connect to: a wildcard host becomes this host's loopback."""
    m = _WILDCARD.match(endpoint)
    if m is None:
        return endpoint
    host = "[::1]" if ":" in m.group(2) else "127.0.0.1"
    return f"{m.group(1)}{host}{m.group(3)}"


@dataclass
class SubscriberStats:
    """Counters, plain data: ``batches`` / ``events`` applied (replayed ones included), ``gaps``
    seen, ``replayed`` batches, ``resyncs`` (the engine's entries dropped: events lost),
    ``restarts`` of the engine, ``malformed`` messages skipped, ``duplicates`` ignored,
    ``errors``: batches that failed otherwise (the engine resynced)."""

    batches: int = 0
    events: int = 0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    restarts: int = 0
    malformed: int = 0
    duplicates: int = 0
    errors: int = 0


class EventSubscriber:
    """``index`` learns ``engine``'s events from ``endpoint`` (see the module docstring).

    ``on_events``: also called with each applied batch's events (tools, tests); ``clock``: the
    replay deadline's; ``context``: a ZMQ context (default: the process's)."""

    def __init__(
        self,
        index: CacheIndex,
        engine: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        bind: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        replay_timeout_s: float = 2.0,
        on_events: Callable[[list[Event]], None] | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.index, self.engine = index, engine
        self.stats = SubscriberStats()
        self._on_events = on_events
        self._clock, self._replay_timeout = clock, replay_timeout_s
        self._ctx = context or zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._logged: set[str] = set()
        try:
            if bind if bind is not None else not engine_binds(endpoint):
                self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # any local user may connect
                self._sub.bind(endpoint)
                endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                endpoint = reachable(endpoint)
                if endpoint.startswith("tcp://["):
                    self._sub.setsockopt(zmq.IPV6, 1)
                self._sub.connect(endpoint)
        except zmq.ZMQError:
            self._sub.close(linger=0)
            raise
        #: where the engine publishes (this side's bound address, its port resolved)
        self.endpoint = endpoint
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._suspect = False  # a connection dropped since the last batch
        #: the engine's replay socket (None: no replay)
        self.replay_endpoint = None if replay_endpoint is None else reachable(replay_endpoint)
        self._replay: zmq.Socket | None = None
        self._last: int | None = None
        self._last_payload = b""
        self._thread: threading.Thread | None = None
        self._running = threading.Event()

    # ---- driving ------------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> int:
        """Process what arrives within ``timeout_s`` (then all that is queued); batches applied."""
        done = 0
        wait = max(0, int(timeout_s * 1000))
        while self._sub.poll(wait):
            wait = 0
            while self._monitor.poll(0):  # connections lost before this message
                self._monitor.recv_multipart()
                self._suspect = True
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.stats.malformed += 1
                continue
            try:
                done += self._receive(int.from_bytes(frames[1], "big"), frames[2])
            except Exception as exc:  # nothing a message holds may stop the subscriber
                self._failed(exc)
        return done

    def _failed(self, exc: Exception) -> None:
        """A batch failed other than by not decoding: the engine's entries may hold part of
        it, so they are dropped (a resync); logged once per kind of error."""
        self.stats.errors += 1
        self.stats.resyncs += 1
        self.index.reset_engine(self.engine)
        kind = type(exc).__name__
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("KV events of %s: a batch failed (%s: %.200s); the engine's entries were "
                           "dropped and are learnt again", self.engine, kind, exc)  # fmt: skip

    def start(self) -> None:
        """Poll on a daemon thread until :meth:`stop`."""
        if self._thread is not None:
            return
        self._running.set()
        self._thread = threading.Thread(target=self._loop, name=f"kv-events-{self.engine}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while self._running.is_set():
            self.poll(0.1)

    def stop(self) -> None:
        self._running.clear()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def close(self) -> None:
        """Stop, and close the sockets."""
        self.stop()
        self._sub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)
        self._drop_replay()

    # ---- sequence -----------------------------------------------------------------------
    def _receive(self, seq: int, payload: bytes) -> int:
        last, suspect, self._suspect = self._last, self._suspect, False
        if last is None:
            if seq > 0:  # the engine published before we listened
                return self._recover(None, seq, payload)
        elif seq <= last:
            if seq == last and payload == self._last_payload:
                self.stats.duplicates += 1
                return 0
            self.stats.restarts += 1
            self.index.reset_engine(self.engine)
            self._last = None
            return self._recover(None, seq, payload) if seq > 0 else self._apply(seq, payload)
        elif seq > last + 1 or suspect:
            self.stats.gaps += int(seq > last + 1)
            return self._recover(last, seq, payload)
        return self._apply(seq, payload)

    def _recover(self, last: int | None, seq: int, payload: bytes) -> int:
        """Replay ``(last, seq)`` (``[0, seq)`` when ``last`` is None), then apply ``seq``."""
        first = 0 if last is None else last + 1
        if seq - first > MAX_GAP:  # more than any engine keeps: nothing to ask, start over
            self.stats.resyncs += 1
            self.index.reset_engine(self.engine)
            return self._apply(seq, payload)
        got = self._fetch(0 if last is None else last, seq)
        if got and last is not None and got[0][0] == last:
            if got[0][1] != self._last_payload:  # the engine's batch ``last`` is another one
                self.stats.restarts += 1
                self.index.reset_engine(self.engine)
                self._last = None
                return self._recover(None, seq, payload)
            got = got[1:]
        if got is not None and [s for s, _ in got] == list(range(first, seq)):  # at most MAX_GAP
            run = got
        else:
            self.stats.resyncs += 1
            self.index.reset_engine(self.engine)
            run = self._tail_run(got or [], seq)
        done = 0
        for s, p in run:
            done += self._apply(s, p)
            self.stats.replayed += 1
        return done + self._apply(seq, payload)

    @staticmethod
    def _tail_run(got: list[tuple[int, bytes]], seq: int) -> list[tuple[int, bytes]]:
        """The batches of ``got`` that run without a hole up to ``seq - 1``."""
        i = len(got)
        while i > 0 and got[i - 1][0] == seq - (len(got) - i) - 1:
            i -= 1
        return got[i:]

    def _apply(self, seq: int, payload: bytes) -> int:
        self._last, self._last_payload = seq, payload
        try:
            batch = decode_batch(payload)
        except MalformedBatchError:
            self.stats.malformed += 1
            return 0
        index = self.index  # the owner may swap the index (a fresh one per experiment)
        index.apply(self.engine, batch.events)
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        if self._on_events is not None:
            self._on_events(list(batch.events))
        return 1

    def _fetch(self, start: int, end: int) -> list[tuple[int, bytes]] | None:
        """The engine's buffered batches ``start <= seq < end`` in order (None: no answer in
        time, or no replay socket)."""
        if self.replay_endpoint is None:
            return None
        if self._replay is None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # who binds first answers
            if self.replay_endpoint.startswith("tcp://["):
                self._replay.setsockopt(zmq.IPV6, 1)
            self._replay.connect(self.replay_endpoint)
        self._replay.send_multipart([b"", start.to_bytes(8, "big")])
        got: list[tuple[int, bytes]] = []
        deadline = self._clock() + self._replay_timeout
        while True:
            left = deadline - self._clock()
            if left <= 0 or not self._replay.poll(max(1, int(left * 1000))):
                self._drop_replay()  # a late answer must not be read as the next request's
                return None
            frames = self._replay.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                return got
            if start <= seq < end:
                got.append((seq, frames[3]))

    def _drop_replay(self) -> None:
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
