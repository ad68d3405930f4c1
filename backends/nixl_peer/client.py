"""``nixl_peer`` backend: pages held by cache peer processes, page bytes moved with NIXL (UCX).

Role: a shared, remote page store. Each configured peer (``hybrid-offload peer``) owns one
NIXL-registered memory pool and an index; this client asks it over a small TCP control
protocol (:mod:`.protocol`) where pages are, and moves the bytes itself with one batched NIXL
READ (load) or WRITE (store) per peer between the peer's pool and the caller's buffers.

Contract beyond :mod:`hybrid_offload.backends.base`:

* **Options.** ``peers`` (required, list of ``"host:port"``), ``token_file`` / ``token_env``
  (the peers' shared secret, from a file or an environment variable; a literal ``token`` is
  refused: configs end up on command lines; without one the client refuses to start unless
  ``insecure: true`` says every user who can reach the peers is trusted, as the peer's own
  ``--insecure`` does), ``staging_bytes`` (64 MiB), ``timeout_s`` (2.0:
  every socket wait, and a transfer per staging buffer's worth of bytes),
  ``retry_backoff_s`` (0.5, doubling up to ``max_backoff_s`` = 30 after each failure of a peer).
* **Placement.** Keys are spread over peers by consistent hashing (:mod:`.ring`, xxh3, virtual
  nodes): every process with the same ``peers`` list agrees, and a peer joining or leaving moves
  only its share. Keys are never rerouted: a down peer's keys are misses and its puts refused.
* **Visibility** (``shared_index = True``): the index lives in the peer, so vLLM's scheduler
  process sees the worker's pages. That process only calls ``contains_batch``: the control
  connection is made on first use, while the NIXL agent, the staging registration and the
  metadata exchange are made lazily on the first data operation, once per peer incarnation
  (a restarted peer has a new agent name: the client re-loads its metadata).
* **Loads.** GET (pins the extents under a lease, refreshes LRU: one round trip) -> one batched
  NIXL READ per peer -> RELEASE (not awaited). **Stores.** ALLOC (reserves extents, refuses
  pages larger than the peer's capacity) -> one batched WRITE per peer -> COMMIT with per-page
  success flags (pages become visible atomically; the reply carries the evictions counted in
  ``stats``). The transfers of a call are in flight together, one per peer.
* **Data path** (:mod:`.data_path`). ``zero_copy`` (true): where a call's buffers lie in a
  few regions (a connector's load or store rows are one block), they are registered for the
  call and the bytes move straight between them and the peers' pools; otherwise, or with
  ``zero_copy: false`` (fabrics where registering memory per call costs more than a copy, e.g.
  RDMA pinning), through the registered staging buffer. ``transfers`` counts both kinds. A
  failed transfer is stopped before the call returns; one that cannot be stopped keeps its
  memory until ``close()``, and a load raises BackendUnavailableError (its buffers may still be
  written: the caller must not reuse them).
* **Failures.** A refused connection, socket error, timeout or NIXL error (a dead peer raises
  ``nixlRemoteDisconnectError``) marks that peer down for the backoff, counts ``stats.errors``
  and turns its keys into misses / refused puts (counted in ``put_refused``). When every
  configured peer is down the call raises :class:`BackendUnavailableError`. A peer that answers
  again is re-handshaken. Construction never contacts a peer. The handshake proves the token
  both ways without sending it (:mod:`.auth`): a wrong token is refused by the peer, and a
  process at the peer's address that cannot prove the token is refused by the client; both
  are reported as down with the reason. The handshake also binds the address dialed: another
  peer relayed to from that address cannot answer for it, and one agent answering at two
  addresses is refused; every later control frame carries a session MAC.
* **Threading.** One lock per peer serializes its control socket; the data path's lock the
  NIXL agent and the staging buffer. Counters have their own lock.
* **Listing.** ``scan`` pages through each peer with SCAN; ``mtime`` is the peer's last commit
  or GET, sent as an age (clocks need not agree). Pages a peer holds for keys the ring no longer
  gives it (``peers`` changed; unreachable, its LRU evicts them) are not listed. A peer down or
  too old to know SCAN raises :class:`BackendUnavailableError`: no peer is silently left out.
* ``close()`` is idempotent and bounded: it closes sockets, forgets remote agents and
  deregisters the staging buffer and any memory kept for transfers that did not stop.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

from hybrid_offload.core.secrets import Secret, SecretError, secret_from_options

from ..base import (
    Backend,
    BackendConfig,
    BackendConfigError,
    BackendUnavailableError,
    Buffer,
    PageInfo,
)
from . import protocol as p
from .auth import PeerAuthError
from .data_path import DataPath
from .peers import PeerDownError as _PeerDownError
from .peers import PeerState as _Peer
from .peers import parse_address
from .ring import HashRing
from .rounds import Piece

__all__ = ["NixlPeerBackend", "parse_address"]

logger = logging.getLogger(__name__)

_MiB = 1 << 20
_KEYS_PER_REQUEST = 8192  # keeps every control message far below protocol.MAX_BODY
#: errors after which a peer closes the connection (a framing, MAC or internal failure)
_CLOSING = frozenset({p.ErrorCode.MALFORMED, p.ErrorCode.UNSUPPORTED_VERSION, p.ErrorCode.TOO_LARGE,
                      p.ErrorCode.AUTH_FAILED, p.ErrorCode.INTERNAL})  # fmt: skip


class NixlPeerBackend(Backend):
    """Client of one or more cache peers (see the module docstring)."""

    type_name: ClassVar[str] = "nixl_peer"
    shared_index: ClassVar[bool] = True
    hit_source: ClassVar[str] = "p2p"
    option_defaults: ClassVar[dict[str, Any]] = {
        "peers": None,
        "token": None,
        "token_file": None,
        "token_env": None,
        "staging_bytes": 64 * _MiB,
        "timeout_s": 2.0,
        "retry_backoff_s": 0.5,
        "max_backoff_s": 30.0,
        "zero_copy": True,
        "insecure": False,
    }

    @classmethod
    def validate_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        opts = super().validate_options(options)
        peers = opts["peers"]
        if isinstance(peers, str) or not isinstance(peers, list | tuple) or not peers:
            raise BackendConfigError("'peers' must be a non-empty list of 'host:port' strings")
        for address in peers:
            try:
                parse_address(address)
            except ValueError as exc:
                raise BackendConfigError(f"'peers': {exc}") from exc
        if len(set(peers)) != len(peers):
            raise BackendConfigError(f"'peers' lists a peer twice: {peers}")
        if not isinstance(opts["insecure"], bool):
            raise BackendConfigError(f"'insecure' must be true or false, got {opts['insecure']!r}")
        if cls._token_of(opts) is None and not opts["insecure"]:
            raise BackendConfigError(
                "no 'token_file' or 'token_env': without the peers' token anyone who can reach them "
                "could answer as a peer (and read or write every page). Give the token the peers "
                "use (hybrid-offload peer --token-file), or set 'insecure': true where every user "
                "who can reach the peers is trusted"
            )
        staging = opts["staging_bytes"]
        if isinstance(staging, bool) or not isinstance(staging, int) or staging < 4096:
            raise BackendConfigError(f"'staging_bytes' must be an integer >= 4096, got {staging!r}")
        for name in ("timeout_s", "retry_backoff_s", "max_backoff_s"):
            value = opts[name]
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise BackendConfigError(f"{name!r} must be a number > 0, got {value!r}")
        if not isinstance(opts["zero_copy"], bool):
            raise BackendConfigError(f"'zero_copy' must be true or false, got {opts['zero_copy']!r}")
        if opts["max_backoff_s"] < opts["retry_backoff_s"]:
            raise BackendConfigError("'max_backoff_s' must be >= 'retry_backoff_s'")
        return {**opts, "peers": list(peers)}

    @staticmethod
    def _token_of(opts: dict[str, Any]) -> Secret | None:
        """The token from ``token_file`` / ``token_env``; BackendConfigError naming the key."""
        key = "token_file" if opts.get("token_file") is not None else "token_env"
        try:
            return secret_from_options(opts, "token", what=f"nixl_peer option {key!r}")
        except SecretError as exc:
            raise BackendConfigError(str(exc)) from None

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        opts = self.validate_options(dict(config.options))
        self._timeout = float(opts["timeout_s"])
        self._backoff0 = float(opts["retry_backoff_s"])
        self._backoff_max = float(opts["max_backoff_s"])
        token = self._token_of(opts)
        if token is None:
            logger.warning("nixl_peer backend %r runs WITHOUT a token (insecure: true)", config.name)
        self._token = Secret(b"") if token is None else token
        self._peers = [_Peer(address, self._backoff0, self._backoff_max) for address in opts["peers"]]
        self._ring = HashRing(opts["peers"])
        self.agent_name = f"hybrid-offload-client-{uuid.uuid4().hex}"
        self._stats_lock = threading.Lock()
        self._data = DataPath(
            self.name, self.agent_name, self._peers, staging_bytes=int(opts["staging_bytes"]),
            timeout=self._timeout, zero_copy=opts["zero_copy"], on_failure=self._peer_failed,
            check_open=self._check_open,
        )  # fmt: skip

    # -- control channel ----------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    def _mark_down(self, peer: _Peer, reason: str) -> None:
        """Call with ``peer.lock`` held."""
        peer.disconnect()
        peer.last_error = reason
        peer.health.record_failure("call", reason)
        self._count(errors=1)

    def _call(
        self, peer: _Peer, request: p.Message, *, retry: bool = True, wait: bool = True
    ) -> tuple[Any, p.HelloReply]:
        """Send ``request``; ``(reply, hello of the connection used)``. Raises _PeerDownError.

        ``wait=False`` only sends (reply None), on the current connection, never reconnecting.
        """
        with peer.lock:
            self._check_open()
            if peer.is_down():
                raise _PeerDownError(f"{peer.address}: backing off after: {peer.last_error}")
            if not wait and peer.sock is None:
                raise _PeerDownError(f"{peer.address}: not connected")
            for attempt in range(2):
                fresh = peer.sock is None
                try:
                    if fresh:
                        peer.connect(self._token.value, self.agent_name, self._timeout)
                        self._check_one_address(peer)
                    reply = peer.exchange(request, wait=wait)
                    if not wait:
                        return None, peer.hello  # type: ignore[return-value]
                except (OSError, p.ProtocolError) as exc:
                    peer.disconnect()
                    if fresh or not retry or attempt or isinstance(exc, TimeoutError):
                        reason = f"{type(exc).__name__}: {exc}"
                        self._mark_down(peer, reason)
                        raise _PeerDownError(f"{peer.address}: {reason}") from exc
                    continue  # a stale connection (peer restarted?): one fresh try
                assert peer.hello is not None and reply is not None
                peer.health.record_success()
                if isinstance(reply, p.Error):
                    if reply.code in _CLOSING:  # the peer closed this connection after it
                        peer.disconnect()
                    raise _PeerDownError(f"{peer.address}: error {reply.code}: {reply.message}")
                if reply.TYPE != request.TYPE | 0x80:
                    peer.disconnect()
                    raise _PeerDownError(f"{peer.address}: unexpected {type(reply).__name__}")
                return reply, peer.hello
        raise AssertionError("unreachable")

    def _check_one_address(self, peer: _Peer) -> None:
        """Refuse the agent ``peer`` just greeted when it already answered at another of our
        addresses (a relay, or one peer listed twice): PeerAuthError."""
        assert peer.hello is not None
        name = peer.hello.agent_name
        for other in self._peers:
            hello = other.hello
            if other is not peer and hello is not None and hello.agent_name == name:
                peer.hello = None
                raise PeerAuthError(
                    f"agent {name} answers at both {other.address} and {peer.address}: a relay, "
                    "or one peer listed twice under two addresses"
                )

    def _per_peer(self, keys: Sequence[str]) -> list[tuple[int, _Peer, list[int]]]:
        """``(peer index, peer, key positions)``, at most ``_KEYS_PER_REQUEST`` keys each."""
        step = _KEYS_PER_REQUEST
        return [
            (n, self._peers[n], idxs[i : i + step])
            for n, idxs in self._ring.group(keys).items()
            for i in range(0, len(idxs), step)
        ]

    def _check_count(self, peer: _Peer, got: int, want: int) -> None:
        if got != want:
            with peer.lock:
                self._mark_down(peer, f"answered {got} items for {want} keys")
            raise _PeerDownError(f"{peer.address}: answered {got} items for {want} keys")

    def _raise_if_all_down(self, what: str) -> None:
        """Raise when every peer's last call failed: a backoff that already ran out while
        this call went on must not turn an outage into a silent miss."""
        if all(peer.health.is_down for peer in self._peers):
            reasons = "; ".join(f"{peer.address}: {peer.last_error}" for peer in self._peers)
            raise BackendUnavailableError(f"nixl_peer {self.name!r}: {what}: all peers down ({reasons})")

    # -- NIXL -----------------------------------------------------------------------------------

    def _peer_failed(self, n: int, reason: str) -> None:
        """A transfer with peer ``n`` failed (the data path's ``on_failure``)."""
        peer = self._peers[n]
        with peer.lock:
            self._mark_down(peer, reason)

    def prepare_data_path(self) -> None:
        """Create the NIXL agent, register staging and exchange metadata with every reachable
        peer (the first transfer otherwise pays for all of it)."""
        self._check_open()
        for peer in self._peers:
            try:
                _, hello = self._call(peer, p.Used())
            except _PeerDownError as exc:
                logger.info("nixl_peer %r: %s not prepared: %s", self.name, peer.address, exc)
                continue
            self._data.prepare(peer, hello)
        self._raise_if_all_down("connect")

    @property
    def transfers(self) -> dict[str, int]:
        """Calls whose bytes moved directly between the caller's buffers and the pools, and
        calls that went through staging (:mod:`.data_path`)."""
        return self._data.counts

    # -- Backend API ----------------------------------------------------------------------------

    def _load(
        self, keys: Sequence[str], dest_for: Callable[[int, int], memoryview | None]
    ) -> list[int | None]:
        """GET -> READ -> RELEASE; ``dest_for(pos, length)`` gives the destination or None."""
        sizes: list[int | None] = [None] * len(keys)
        if not keys:
            return sizes
        leases: list[tuple[_Peer, int]] = []
        pieces: list[Piece] = []
        for n, peer, idxs in self._per_peer(keys):
            try:
                reply, hello = self._call(peer, p.Get([keys[i] for i in idxs]))
                self._check_count(peer, len(reply.extents), len(idxs))
            except _PeerDownError:
                continue
            if reply.lease_id:
                leases.append((peer, reply.lease_id))
            for i, extent in zip(idxs, reply.extents, strict=True):
                if extent is None:
                    continue
                dest = dest_for(i, extent[1])
                if dest is not None:
                    sizes[i] = extent[1]
                    pieces.append(Piece(i, n, hello, hello.pool_base + extent[0], dest[: extent[1]]))
        try:
            failed = self._data.move("READ", pieces)
        finally:
            for peer, lease_id in leases:
                with contextlib.suppress(_PeerDownError):
                    self._call(peer, p.Release(lease_id), retry=False, wait=False)
        for n, _peer, idxs in self._per_peer(keys) if failed else []:
            if n in failed:
                for i in idxs:
                    sizes[i] = None
        hits = [s for s in sizes if s is not None]
        self._count(gets=len(keys), hits=len(hits), get_bytes=sum(hits))
        if not hits:
            self._raise_if_all_down("get")
        return sizes

    def _get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        views = [memoryview(buf).cast("B") for buf in buffers]

        def dest_for(i: int, length: int) -> memoryview | None:
            return views[i] if length <= views[i].nbytes else None

        return self._load(keys, dest_for)

    def _get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        out: dict[int, bytearray] = {}

        def dest_for(i: int, length: int) -> memoryview:
            out[i] = bytearray(length)
            return memoryview(out[i])

        sizes = self._load(keys, dest_for)
        return [None if size is None else bytes(out[i]) for i, size in enumerate(sizes)]

    def _put_batch(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        keys = [key for key, _ in items]
        results = [False] * len(items)
        if not items:
            return results
        views = [memoryview(buf).cast("B") for _, buf in items]
        allocs: list[tuple[int, _Peer, list[int], int, list[int | None]]] = []
        pieces: list[Piece] = []
        for n, peer, idxs in self._per_peer(keys):
            try:
                request = p.Alloc([keys[i] for i in idxs], [views[i].nbytes for i in idxs])
                reply, hello = self._call(peer, request)
                self._check_count(peer, len(reply.offsets), len(idxs))
            except _PeerDownError:
                continue
            allocs.append((n, peer, idxs, reply.alloc_id, reply.offsets))
            for i, offset in zip(idxs, reply.offsets, strict=True):
                if offset is not None and views[i].nbytes:
                    pieces.append(Piece(i, n, hello, hello.pool_base + offset, views[i]))
        failed = self._data.move("WRITE", pieces)
        puts = put_bytes = evictions = evicted_bytes = 0
        for n, peer, idxs, alloc_id, offsets in allocs:
            flags = [offset is not None and n not in failed for offset in offsets]
            try:
                reply, _ = self._call(peer, p.Commit(alloc_id, flags), retry=False)
            except _PeerDownError:
                continue
            for i, ok in zip(idxs, flags, strict=True):
                results[i] = ok
            puts += sum(flags)
            put_bytes += sum(views[i].nbytes for i, ok in zip(idxs, flags, strict=True) if ok)
            evictions += reply.evictions
            evicted_bytes += reply.evicted_bytes
        self._count(puts=puts, put_bytes=put_bytes, put_refused=len(items) - puts,
                    evictions=evictions, evicted_bytes=evicted_bytes)  # fmt: skip
        if not puts:
            self._raise_if_all_down("put")
        return results

    def _ask(self, keys: Sequence[str], make: Callable[[list[str]], p.Message], what: str) -> list[Any]:
        """Send ``make(keys of a peer)`` to each key's peer; ``[(positions, reply)]`` of those
        that answered. Raises BackendUnavailableError if none did and all peers are down."""
        answers = []
        for _, peer, idxs in self._per_peer(keys):
            with contextlib.suppress(_PeerDownError):
                answers.append((idxs, self._call(peer, make([keys[i] for i in idxs]))[0]))
        if keys and not answers:
            self._raise_if_all_down(what)
        return answers

    def _contains_batch(self, keys: Sequence[str]) -> list[bool]:
        """LOOKUP on each key's peer (no LRU refresh); a down peer's keys are False."""
        present = [False] * len(keys)
        for idxs, reply in self._ask(keys, p.Lookup, "contains"):
            if len(reply.present) == len(idxs):
                for i, found in zip(idxs, reply.present, strict=True):
                    present[i] = found
        return present

    def _delete_batch(self, keys: Sequence[str]) -> int:
        return sum(reply.deleted for _, reply in self._ask(keys, p.Delete, "delete"))

    def _used_bytes(self) -> int:
        """Sum of USED over the peers that answer; raises if none does."""
        usage = [u for u in self.peer_usage().values() if u is not None]
        if not usage:
            self._raise_if_all_down("used_bytes")
        return sum(u.used for u in usage)

    def peer_usage(self) -> dict[str, p.UsedReply | None]:
        """Per peer address: its USED reply (used, reserved, free, pages), None if down."""
        self._check_open()
        usage: dict[str, p.UsedReply | None] = {}
        for peer in self._peers:
            try:
                usage[peer.address] = self._call(peer, p.Used())[0]
            except _PeerDownError:
                usage[peer.address] = None
        return usage

    scan_batch: ClassVar[int] = p.SCAN_MAX_ENTRIES  # keys per SCAN request

    def _scan(self, prefix: str) -> Iterator[PageInfo]:
        """Each peer's pages whose key starts with ``prefix`` (see "Listing" above)."""
        for peer in self._peers:
            reply = p.ScanReply([("", 0, 0)], True)
            while reply.more and reply.entries:
                try:
                    reply, _ = self._call(peer, p.Scan(prefix, reply.entries[-1][0], self.scan_batch))
                except _PeerDownError as exc:
                    old = " (too old for SCAN?)" if "unknown message type" in str(exc) else ""
                    raise BackendUnavailableError(f"nixl_peer {self.name!r}: scan: {exc}{old}") from exc
                now = time.time()
                for key, size, idle_ms in reply.entries:
                    if self._ring.node_for(key) == peer.address:
                        yield PageInfo(key, size, now - idle_ms / 1000)

    def peer_for(self, key: str) -> str:
        """The address of the peer that owns ``key``."""
        return self._ring.node_for(key)

    def _close(self) -> None:
        """Close sockets, forget remote agents, deregister staging; bounded."""
        for peer in self._peers:
            if peer.lock.acquire(timeout=2 * self._timeout):
                try:
                    peer.disconnect()
                finally:
                    peer.lock.release()
        self._data.close(2 * self._timeout)
