"""The cache peer process: one NIXL-registered memory pool, a page index, a TCP control channel.

Role: hold pages for :class:`~hybrid_offload.backends.nixl_peer.client.NixlPeerBackend` clients.
Page bytes move with NIXL (UCX) READ/WRITE straight between this pool and each client's
registered staging buffer; this process never touches them. It only answers the control
protocol (:mod:`.protocol`) and keeps the index (:mod:`~hybrid_offload.backends.page_pool`).

* **NIXL.** One agent (uuid name, UCX, progress thread ON: this process never polls, and
  initiators would otherwise get connection refused). The pool is one ``numpy.uint8`` array,
  registered once; HELLO replies carry the agent metadata and the pool's base address.
* **Control channel.** A thread per connection (blocking sockets); one lock guards the index.
  The handshake (HELLO, PROVE: :mod:`.auth`) must come first, name an address this peer
  answers to (``advertise``, else its port on the connection's local address) and prove the
  token, else ERROR and the connection closes; every later frame must carry its session MAC.
  A malformed or oversized message gets ERROR and closes that connection only. Before HELLO a
  frame may be no larger than HELLO can be; bodies are read as they arrive.
* **Untrusted clients** (:mod:`.connections`): connections are capped in all and before HELLO,
  closed without HELLO after ``handshake_timeout_s`` and when idle for ``idle_timeout_s``.
  ``accept()`` failing for lack of file descriptors (EMFILE/ENFILE) pauses accepting briefly;
  the peer keeps serving. Lease and reservation ids belong to their connection, at most
  ``max_pending_per_connection`` of each open (:mod:`~hybrid_offload.backends.page_pool`).
* **Exposure** (:mod:`.exposure`): off loopback a token (or ``insecure``) is required, and the
  UCX data path is confined to the listen address's interface.
* **Listing.** SCAN copies the index under the lock (a C-speed list copy) and selects the
  reply's key-ordered slice outside it, so listing a large pool does not stall data traffic.
* **Leases and reservations**: when their connection closes they are released / aborted at
  once; a reaper thread also expires them after ``lease_timeout_s`` / ``alloc_timeout_s`` (a
  client that hangs between ALLOC and COMMIT does not leak pool space).
* **Lifecycle.** :meth:`PeerServer.serve_forever` prints the ready line once it accepts;
  SIGTERM / SIGINT stop it; :meth:`PeerServer.close` deregisters the pool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import resource
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hybrid_offload.compat import check_versions, nixl_agent
from hybrid_offload.core.secrets import Secret

from ..page_pool import ALIGN, NotOwnedError, PageIndex, PendingLimitError, scan_pages
from . import protocol as p
from .auth import Session, challenge, check_client, peer_session, welcome_mac
from .connections import Connection, ConnectionTable, Limits
from .exposure import check_bind, names_this_peer, ucx_env

__all__ = ["PeerOptions", "PeerServer", "default_pool_bytes", "run_peer"]

logger = logging.getLogger(__name__)

_MiB = 1 << 20
#: accept() errors that mean "out of descriptors or memory now": pause, then accept again
_ACCEPT_PAUSE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_ACCEPT_PAUSE_S = 0.1
_REPORT_EVERY_S = 10.0
_FD_RESERVE = 64  # descriptors the peer needs besides its connections (UCX, logs, listener)


def default_pool_bytes(capacity_bytes: int) -> int:
    """Pool size with slack above capacity: +25 %, at least +64 MiB (alignment, reservations)."""
    return capacity_bytes + max(capacity_bytes // 4, 64 * _MiB)


@dataclass(frozen=True)
class PeerOptions:
    """The peer's settings; each is the ``hybrid-offload peer`` option of the same name."""

    host: str
    port: int
    capacity_bytes: int
    token: Secret | None = None
    insecure: bool = False
    pool_bytes: int | None = None
    lease_timeout_s: float = 30.0
    alloc_timeout_s: float = 30.0
    progress_delay_us: int = 100
    max_connections: int = Limits.max_connections
    max_unauthenticated: int = Limits.max_unauthenticated
    handshake_timeout_s: float = Limits.handshake_timeout_s
    idle_timeout_s: float = Limits.idle_timeout_s
    max_pending_per_connection: int = 64
    #: ``host:port`` addresses clients dial besides the listen address (NAT, port forwards)
    advertise: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        positive = ("lease_timeout_s", "alloc_timeout_s", "max_connections", "max_unauthenticated",
                    "handshake_timeout_s", "idle_timeout_s", "max_pending_per_connection")  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value!r}")

    @property
    def listen(self) -> str:
        return f"{self.host}:{self.port}"


class PeerServer:
    """See the module docstring. ``start()`` binds and registers; ``serve_forever()`` accepts."""

    def __init__(self, options: PeerOptions, *, clock: Callable[[], float] = time.monotonic) -> None:
        """Check the options (ValueError naming the option) and allocate the pool."""
        has_token = options.token is not None
        check_bind(options.listen, options.host, has_token=has_token, insecure=options.insecure)
        self.options = options
        pool_bytes = options.pool_bytes or default_pool_bytes(options.capacity_bytes)
        pool_bytes = max(ALIGN, pool_bytes - pool_bytes % ALIGN)
        if pool_bytes < options.capacity_bytes:
            raise ValueError("--pool-bytes must be at least --capacity-bytes")
        self._lock = threading.Lock()
        self._index = PageIndex(
            options.capacity_bytes,
            pool_bytes,
            lease_timeout_s=options.lease_timeout_s,
            alloc_timeout_s=options.alloc_timeout_s,
            max_pending=options.max_pending_per_connection,
            clock=clock,
        )
        limits = Limits(options.max_connections, options.max_unauthenticated,
                        options.handshake_timeout_s, options.idle_timeout_s)  # fmt: skip
        self._table = ConnectionTable(limits, clock)
        self._pool = np.zeros(pool_bytes, dtype=np.uint8)
        self._token = b"" if options.token is None else options.token.value
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._agent: object | None = None
        self._reg: object | None = None
        self._metadata = b""
        self.agent_name = f"hybrid-offload-peer-{uuid.uuid4().hex}"
        self._threads: list[threading.Thread] = []
        self._dropped: Counter[str] = Counter()  # connections closed by the limits, by reason
        self._dropped_lock = threading.Lock()
        self._next_report = 0.0

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Register the pool with NIXL and bind the listener (raises on failure)."""
        check_versions("nixl", what="hybrid-offload peer")
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and self.options.max_connections + _FD_RESERVE > soft:
            logger.warning(
                "--max-connections %d is near the open-file limit %d: accepts will pause when "
                "descriptors run out (raise ulimit -n)", self.options.max_connections, soft
            )
        env, exposure = ucx_env(self.options.host)
        if self.options.token is None and self.options.insecure:
            logger.warning("serving %s WITHOUT a token (--insecure)", self.options.listen)
        logger.info("%s", exposure)
        # The peer never polls its own transfers: the progress thread serves initiators.
        agent = nixl_agent(
            self.agent_name, progress_thread=True, progress_delay_us=self.options.progress_delay_us, env=env
        )
        self._reg = agent.register_memory([(self._pool.ctypes.data, self._pool.nbytes, 0, "")], "DRAM")
        self._metadata = agent.get_agent_metadata()
        self._agent = agent
        listener = socket.create_server((self.options.host, self.options.port), reuse_port=False)
        listener.settimeout(0.2)
        self._listener = listener
        reaper = threading.Thread(target=self._reap, name="peer-reaper", daemon=True)
        reaper.start()
        self._threads.append(reaper)

    @property
    def address(self) -> str:
        assert self._listener is not None
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def stop(self) -> None:
        self._stop.set()

    def serve_forever(self, on_ready: Callable[[str], None] | None = None) -> None:
        assert self._listener is not None, "start() first"
        if on_ready is not None:
            on_ready(self.address)
        paused = False
        while not self._stop.is_set():
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    break
                if exc.errno in _ACCEPT_PAUSE_ERRNOS:
                    if not paused:
                        logger.warning("accept: %s; pausing accepts, still serving", exc.strerror)
                    paused = True
                    self._stop.wait(_ACCEPT_PAUSE_S)
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR):
                    continue
                raise
            if paused:
                logger.info("accepting again")
                paused = False
            self._admit(sock, f"{addr[0]}:{addr[1]}")

    def _admit(self, sock: socket.socket, address: str) -> None:
        """Serve ``sock`` in its own thread, within the connection limits."""
        conn = Connection(sock, address, self._table.now())
        admitted, pushed = self._table.admit(conn)
        if pushed is not None:
            logger.debug("client %s: no HELLO yet, dropped for a newer connection", pushed.address)
            self._note_dropped("pushed out without HELLO")
            _shutdown(pushed.sock)
        if not admitted:
            logger.debug("client %s refused: %d connections open", address, self.options.max_connections)
            self._note_dropped("refused over --max-connections")
            sock.setblocking(False)  # never stall the accept loop on a client that does not read
            busy = p.Error(p.ErrorCode.BUSY, f"too many connections (max {self.options.max_connections})")
            self._send(conn, busy, 0)
            with contextlib.suppress(OSError):
                sock.close()
            return
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        thread = threading.Thread(target=self._serve, args=(conn,), name="peer-conn", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no more threads: this connection only
            logger.warning("client %s refused: cannot start a thread", address)
            self._table.remove(conn)
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        """Stop accepting, close client connections, deregister the pool; idempotent."""
        self._stop.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        for conn in self._table.connections():
            _shutdown(conn.sock)
        if self._agent is not None and self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)  # type: ignore[attr-defined]
            except Exception:  # best effort at exit
                logger.debug("deregister_memory failed", exc_info=True)
            self._reg = None

    # -- connections ------------------------------------------------------------------------

    def _reap(self) -> None:
        o = self.options
        shortest = min(o.lease_timeout_s, o.alloc_timeout_s, o.handshake_timeout_s, o.idle_timeout_s)
        period = min(0.25, max(0.05, shortest / 4))
        while not self._stop.wait(period):
            with self._lock:
                leases, allocs = self._index.expire()
            if leases or allocs:
                logger.info("expired %d lease(s) and %d reservation(s)", leases, allocs)
            for conn, reason in self._table.expired():
                logger.debug("client %s: %s; closing", conn.address, reason)
                self._note_dropped(reason)
                _shutdown(conn.sock)
            self._report_dropped()

    def _note_dropped(self, reason: str) -> None:
        with self._dropped_lock:
            self._dropped[reason] += 1

    def _report_dropped(self) -> None:
        """One log line per interval: a flood of connections must not flood the log."""
        now = self._table.now()
        with self._dropped_lock:
            if not self._dropped or now < self._next_report:
                return
            dropped, self._dropped = self._dropped, Counter()
            self._next_report = now + _REPORT_EVERY_S
        logger.warning("connections closed: %s", ", ".join(f"{n} {r}" for r, n in dropped.items()))

    def _serve(self, conn: Connection) -> None:
        session: Session | None = None  # once the handshake is done
        opened: tuple[p.Hello, bytes] | None = None  # (HELLO, our nonce) once it was answered
        try:
            while not self._stop.is_set():
                try:
                    max_body = p.MAX_BODY if session else p.MAX_HELLO_BODY
                    request, request_id = p.recv_message(conn.sock, max_body, session)
                    if opened is None:
                        opened = self._challenge(conn, request, request_id)
                        if opened is None:
                            return
                        continue
                except p.ProtocolError as exc:
                    if session:
                        logger.warning("client %s: %s; closing", conn.address, exc)
                    else:  # unauthenticated: counted into the rate-limited report
                        logger.debug("client %s: %s; closing", conn.address, exc)
                        self._note_dropped("malformed handshake")
                        self._report_dropped()
                    self._send(conn, p.Error(exc.code, str(exc)), 0, session)
                    return
                if session is None:
                    session = self._greet(conn, request, request_id, *opened)
                    if session is None:
                        return
                    continue
                self._table.touch(conn)
                try:
                    reply = self._dispatch(conn, request)
                except Exception as exc:  # a bug: answer, drop this connection, keep serving
                    logger.exception("client %s: internal error", conn.address)
                    internal = p.Error(p.ErrorCode.INTERNAL, f"internal error: {exc}")
                    self._send(conn, internal, request_id, session)
                    return
                self._send(conn, reply, request_id, session)
        except (OSError, ConnectionError):
            logger.debug("client %s disconnected", conn.address)
        finally:
            with self._lock:
                self._index.drop_owner(conn)
            self._table.remove(conn)
            with contextlib.suppress(OSError):
                conn.sock.close()

    def _send(
        self, conn: Connection, message: p.Message, request_id: int, session: Session | None = None
    ) -> None:
        with contextlib.suppress(OSError):
            p.send_message(conn.sock, message, request_id, session)

    def _challenge(
        self, conn: Connection, request: p.Message, request_id: int
    ) -> tuple[p.Hello, bytes] | None:
        """Answer HELLO with our nonce and proof: ``(HELLO, our nonce)``, or None when the first
        message is not HELLO or names an address this peer does not answer to (answered with
        ERROR)."""
        if not isinstance(request, p.Hello):
            self._send(conn, p.Error(p.ErrorCode.HELLO_REQUIRED, "first message must be HELLO"), request_id)
            return None
        if not self._answers_to(conn, request.dialed):
            logger.debug("client %s dialed %r: not this peer; closing", conn.address, request.dialed[:200])
            self._note_dropped("another peer's address")
            self._report_dropped()
            refusal = f"this peer does not answer at {request.dialed[:200]!r} (see its --advertise)"
            self._send(conn, p.Error(p.ErrorCode.NOT_THIS_PEER, refusal), request_id)
            return None
        reply, nonce = challenge(self._token, request)
        self._send(conn, reply, request_id)
        return request, nonce

    def _answers_to(self, conn: Connection, dialed: str) -> bool:
        try:
            local = conn.sock.getsockname()
        except OSError:
            return False
        return names_this_peer(dialed, (str(local[0]), int(local[1])), frozenset(self.options.advertise))

    def _greet(
        self, conn: Connection, request: p.Message, request_id: int, hello: p.Hello, nonce: bytes
    ) -> Session | None:
        if not isinstance(request, p.Prove):
            out_of_turn = p.Error(p.ErrorCode.HELLO_REQUIRED, "HELLO must be followed by PROVE")
            self._send(conn, out_of_turn, request_id)
            return None
        if not check_client(self._token, hello, nonce, request):
            # no client-controlled text is logged, and the warning is the rate-limited report of
            # closed connections (a flood of handshakes must not flood the log)
            logger.debug("client %s: wrong token; closing", conn.address)
            self._note_dropped("wrong token")
            self._report_dropped()
            self._send(conn, p.Error(p.ErrorCode.AUTH_FAILED, "wrong token"), request_id)
            return None
        self._table.greeted(conn)  # before the reply: the client may connect again at once
        reply = p.HelloReply(
            self.agent_name,
            self._metadata,
            int(self._pool.ctypes.data),
            int(self._pool.nbytes),
            self.options.capacity_bytes,
        )
        reply = dataclasses.replace(reply, mac=welcome_mac(self._token, hello, nonce, reply))
        self._send(conn, reply, request_id)
        return peer_session(self._token, hello, nonce, reply)

    def _scan(self, request: p.Scan) -> p.ScanReply:
        """Copy the index under the lock, pick the reply's slice outside it."""
        with self._lock:
            snapshot = self._index.pages_snapshot()
            now = self._index.now()
        limit = min(max(request.limit, 1), p.SCAN_MAX_ENTRIES)
        entries, more = scan_pages(snapshot, request.prefix, request.after, limit, now)
        return p.ScanReply([(key, size, round(idle * 1000)) for key, size, idle in entries], more)

    def _dispatch(self, conn: Connection, request: p.Message) -> p.Message:
        if isinstance(request, p.Scan):
            return self._scan(request)
        try:
            with self._lock:
                return self._dispatch_locked(conn, request)
        except PendingLimitError as exc:
            return p.Error(p.ErrorCode.BUSY, str(exc))
        except NotOwnedError as exc:
            return p.Error(p.ErrorCode.UNKNOWN_LEASE, str(exc))

    def _dispatch_locked(self, conn: Connection, request: p.Message) -> p.Message:
        index = self._index
        if isinstance(request, p.Lookup):
            return p.LookupReply(index.lookup(request.keys))
        if isinstance(request, p.Get):
            lease_id, extents = index.get(request.keys, conn)
            return p.GetReply(lease_id, extents)
        if isinstance(request, p.Release):
            return p.ReleaseReply(index.release(request.lease_id, conn))
        if isinstance(request, p.Alloc):
            alloc_id, offsets = index.alloc(request.keys, request.sizes, conn)
            return p.AllocReply(alloc_id, offsets)
        if isinstance(request, p.Commit):
            result = index.commit(request.alloc_id, request.success, conn)
            if result is None:
                msg = f"alloc {request.alloc_id} is unknown, expired or another connection's"
                return p.Error(p.ErrorCode.UNKNOWN_ALLOC, msg)
            return p.CommitReply(*result)
        if isinstance(request, p.Delete):
            return p.DeleteReply(index.delete(request.keys))
        if isinstance(request, p.Used):
            s = index.stats()
            return p.UsedReply(s.used, s.reserved, s.free, s.pages)
        return p.Error(p.ErrorCode.MALFORMED, f"unexpected message {type(request).__name__}")


def _shutdown(sock: socket.socket) -> None:
    """Wake the thread blocked reading ``sock``: it sees end of file and closes it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def run_peer(options: PeerOptions) -> int:
    """Run a peer until SIGTERM/SIGINT; prints the ready line on stdout. Returns the exit code."""
    server = PeerServer(options)

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("signal %d: stopping", signum)
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    try:
        server.serve_forever(
            on_ready=lambda addr: print(f"hybrid-offload peer listening on {addr}", flush=True)
        )
    finally:
        server.close()
    logger.info("peer stopped")
    return 0
