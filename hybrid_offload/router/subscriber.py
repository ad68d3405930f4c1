"""Subscribe to one engine's KV events (vLLM's ZMQ publisher) and feed a :class:`CacheIndex`.

vLLM binds a wildcard ``endpoint`` (``tcp://*:5557``) and connects to any other: a subscriber
connects to an engine that binds and binds the address an engine was told to connect to
(``bind``; default: bind when ``endpoint`` is a wildcard or its port is 0). Messages are
(topic, 8-byte big-endian sequence, payload). The sequence counts from 0 per engine process:

* the next number: applied;
* a gap: the missing batches are asked from the engine's replay socket (``replay_endpoint``,
  vLLM's ROUTER: request ``[b"", start]``, replies ``[b"", topic, seq, payload]`` until a
  sequence of -1) and applied in order; if it cannot give them all, the engine's own entries
  are dropped (:meth:`CacheIndex.reset_engine`) and the index goes on from the current batch;
* a number not above the last: the engine restarted; its entries are dropped;
* the first batch after a start: earlier ones are asked from the replay socket (a router
  started after the engine learns what it already holds).

One thread owns the sockets: :meth:`poll` from the caller's, or :meth:`start` for a daemon one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from hybrid_offload.router.events import Event, MalformedBatchError, decode_batch
from hybrid_offload.router.index import CacheIndex

END_SEQ = -1


@dataclass
class SubscriberStats:
    """Counters, plain data: batches and events applied, gaps seen, batches replayed, resyncs
    (entries dropped for missing events), restarts, malformed payloads skipped."""

    batches: int = 0
    events: int = 0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    restarts: int = 0
    malformed: int = 0


class EventSubscriber:
    def __init__(
        self,
        index: CacheIndex,
        engine: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        bind: bool | None = None,
        on_events: Callable[[list[Event]], None] | None = None,
        replay_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.Context | None = None,
    ) -> None:
        """``on_events``: also called with each applied batch's events (tools, tests)."""
        self.index, self.engine = index, engine
        self.stats = SubscriberStats()
        self._on_events = on_events
        self._replay_timeout = replay_timeout_s
        self._clock = clock
        self._ctx = context or zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if bind if bind is not None else ("*" in endpoint or endpoint.endswith(":0")):
            self._sub.bind(endpoint)
            endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._sub.connect(endpoint)
        #: where the engine publishes (the bound address when this side binds, port resolved)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._replay: zmq.Socket | None = None
        self._last: int | None = None
        self._thread: threading.Thread | None = None
        self._running = False

    # ---- driving ------------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply what arrives within ``timeout_s`` (all that is queued); batches applied."""
        done = 0
        wait = int(timeout_s * 1000)
        while self._sub.poll(wait):
            wait = 0
            _topic, seq, payload = self._sub.recv_multipart()
            done += self._receive(int.from_bytes(seq, "big", signed=True), payload)
        return done

    def start(self) -> None:
        """Poll on a daemon thread until :meth:`stop`."""
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=f"kv-events-{self.engine}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while self._running:
            self.poll(0.1)

    def stop(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def close(self) -> None:
        self.stop()
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ---- sequence -----------------------------------------------------------------------
    def _receive(self, seq: int, payload: bytes) -> int:
        last = self._last
        if last is None:
            if seq > 0:
                self._replay_range(0, seq)  # what the engine published before we listened
        elif seq <= last:
            self.stats.restarts += 1
            self.index.reset_engine(self.engine)
        elif seq > last + 1:
            self.stats.gaps += 1
            if not self._replay_range(last + 1, seq):
                self.stats.resyncs += 1
                self.index.reset_engine(self.engine)
        return self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> int:
        self._last = seq
        try:
            _ts, events = decode_batch(payload)
        except MalformedBatchError:
            self.stats.malformed += 1
            return 0
        self.index.apply(self.engine, events)
        self.stats.batches += 1
        self.stats.events += len(events)
        if self._on_events is not None:
            self._on_events(events)
        return 1

    def _replay_range(self, start: int, end: int) -> bool:
        """Apply the batches ``start <= seq < end`` from the replay socket; whether all came."""
        if self.replay_endpoint is None:
            return False
        if self._replay is None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.connect(self.replay_endpoint)
        self._replay.send_multipart([b"", start.to_bytes(8, "big")])
        expected = start
        deadline = self._clock() + self._replay_timeout
        while True:
            left = deadline - self._clock()
            if left <= 0 or not self._replay.poll(int(left * 1000)):
                self._drop_replay()  # a late answer must not be read as the next one's
                return False
            frames = self._replay.recv_multipart()
            if len(frames) != 4:
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                return expected >= end
            if expected <= seq < end and seq == expected:
                self._apply(seq, frames[3])
                self.stats.replayed += 1
                expected += 1
            elif expected < seq < end:
                self._drop_replay()  # the engine's buffer no longer has ``expected``
                return False

    def _drop_replay(self) -> None:
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
