"""The ``nixl_peer`` client's data path: its NIXL agent, staging buffer and batched transfers.

Role: move a call's pieces (:mod:`.rounds`) between this process's memory and the peers'
pools with one batched NIXL READ or WRITE per peer, all peers' transfers in flight together;
the control channel (GET/ALLOC, leases, COMMIT) is the client's (:mod:`.client`).

* **Zero copy.** Where a call's buffers lie in at most 8 regions (a connector's load or store
  rows are one block), those regions are registered for the call and the bytes move straight
  between them and the pools. Otherwise, or with ``zero_copy`` off, through the registered
  staging buffer, in rounds that fill it. ``counts`` counts both kinds of call. A direct
  call's timeout is ``timeout_s`` per staging buffer's worth of bytes.
* **Failures.** A transfer that fails or times out gets its peer's connection dropped and
  the peer marked down (``on_failure``); its keys are misses. One that NIXL reported ended
  (``ERR``) touches nothing more. One still in progress at the deadline, or whose state NIXL
  could not tell, may still write into or read from its memory later (UCX completes it at a
  later progress call): that memory is kept, never reused, freed or deregistered until
  :meth:`DataPath.close`. A staging buffer is replaced; a caller's buffers are referenced,
  zero copy is turned off for good, and a READ raises BackendUnavailableError, so that the
  caller does not reuse them either. After ``MAX_KEPT`` such transfers every call raises.
* **Threading.** One lock serializes the agent, staging and remote agents (the client agent
  has no progress thread: it polls its own transfers).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hybrid_offload.compat import check_versions, nixl_agent

from ..base import BackendUnavailableError, BuffersInUseError
from . import protocol as p
from . import rounds
from .peers import PeerState
from .rounds import Piece, direct_regions, plan_rounds

__all__ = ["MAX_DIRECT_REGIONS", "DataPath"]

logger = logging.getLogger(__name__)

MAX_DIRECT_REGIONS = 8  # more regions than this: through staging (one registration each)
MAX_KEPT = 4  # memory kept for transfers that did not stop; past it, no more transfers


class DataPath:
    """NIXL transfers of one client (see the module docstring)."""

    def __init__(
        self, name: str, agent_name: str, peers: list[PeerState], *, staging_bytes: int,
        timeout: float, zero_copy: bool, on_failure: Callable[[int, str], None],
        check_open: Callable[[], None],
    ) -> None:  # fmt: skip
        self.name, self.agent_name, self._peers = name, agent_name, peers
        self._staging_bytes, self._timeout = staging_bytes, timeout
        self._max_regions = MAX_DIRECT_REGIONS if zero_copy else 0
        self._on_failure, self._check_open = on_failure, check_open
        self.lock = threading.Lock()
        self._agent: Any = None
        self._staging: np.ndarray | None = None
        self._staging_view: memoryview | None = None
        self._staging_reg: Any = None
        self._kept: list[tuple[Any, Any]] = []  # (registration, memory) of transfers that did not stop
        #: calls moved directly between the caller's buffers and the pools, or staged
        self.counts = {"direct": 0, "staged": 0}

    @property
    def agent_made(self) -> bool:
        """Whether this client made its NIXL agent (its first data operation or prepare)."""
        return self._agent is not None

    def _ensure_agent(self) -> Any:
        """Create the agent and register staging (the lock held)."""
        if self._agent is None:
            check_versions("nixl", what=f"nixl_peer backend {self.name!r}")
            self._agent = nixl_agent(self.agent_name, progress_thread=False)
        self._ensure_staging()
        return self._agent

    def _ensure_staging(self) -> None:
        if self._staging is None:
            staging = np.zeros(self._staging_bytes, dtype=np.uint8)
            reg = self._agent.register_memory([(staging.ctypes.data, staging.nbytes, 0, "")], "DRAM")
            self._staging, self._staging_view, self._staging_reg = staging, staging.data, reg

    def prepare(self, peer: PeerState, hello: p.HelloReply) -> None:
        """Make the agent, register staging and load ``hello``'s agent metadata (the first
        transfer otherwise pays for all of it)."""
        with self.lock:
            self._check_open()
            self._ensure_remote(peer, hello)

    def _ensure_remote(self, peer: PeerState, hello: p.HelloReply) -> None:
        """Load ``hello``'s agent metadata once per peer incarnation (the lock held)."""
        if peer.remote_agent == hello.agent_name:
            return
        agent = self._ensure_agent()
        if peer.remote_agent is not None:
            with contextlib.suppress(Exception):
                agent.remove_remote_agent(peer.remote_agent)
            peer.remote_agent = None
        agent.add_remote_agent(hello.metadata)
        peer.remote_agent = hello.agent_name

    def _forget_remote(self, peer: PeerState) -> None:
        if peer.remote_agent is not None and self._agent is not None:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(peer.remote_agent)
        peer.remote_agent = None

    def _post(self, op: str, pieces: list[Piece], failed: set[int], base: int) -> dict[int, Any]:
        """Start one transfer per peer of a round (local addresses: ``base + piece.local``);
        returns peer -> handle."""
        agent = self._agent
        by_peer: dict[int, list[Piece]] = {}
        for piece in pieces:
            by_peer.setdefault(piece.peer, []).append(piece)
        handles: dict[int, Any] = {}
        for n, group in by_peer.items():
            peer = self._peers[n]
            try:
                self._ensure_remote(peer, group[0].hello)
                local = np.array([(base + x.local, x.view.nbytes, 0) for x in group], np.uint64)
                remote = np.array([(x.remote, x.view.nbytes, 0) for x in group], np.uint64)
                handle = agent.initialize_xfer(
                    op,
                    agent.get_xfer_descs(local, "DRAM"),
                    agent.get_xfer_descs(remote, "DRAM"),
                    group[0].hello.agent_name,
                )
                handles[n] = handle
                if agent.transfer(handle) == "ERR":
                    raise RuntimeError("transfer could not be posted")
            except Exception as exc:
                self._transfer_failed(n, f"NIXL {op}: {type(exc).__name__}: {exc}", failed)
        return handles

    def _transfer_failed(self, n: int, reason: str, failed: set[int]) -> None:
        failed.add(n)
        self._forget_remote(self._peers[n])
        self._on_failure(n, reason)

    def _wait(self, handles: dict[int, Any], failed: set[int], timeout: float) -> bool:
        """Poll until every handle is done or failed, or ``timeout`` passed; release them.
        False when a transfer may still be moving bytes: one still in progress at the deadline
        or whose state NIXL could not tell (UCX completes such operations at a later progress
        call, whatever becomes of the peer; measured: a timed-out READ wrote into its
        destination during the next call)."""
        agent = self._agent
        deadline = time.monotonic() + timeout
        stopped = True
        pending = dict(handles)
        while pending:
            for n, handle in list(pending.items()):
                try:
                    state = agent.check_xfer_state(handle)
                except Exception as exc:
                    state, error = "?", f"{type(exc).__name__}: {exc}"
                else:
                    error = "transfer failed"
                if state == "PROC" and time.monotonic() <= deadline:
                    continue
                del pending[n]
                with contextlib.suppress(Exception):
                    handle.release()
                if state == "DONE":
                    continue
                stopped = stopped and state == "ERR"  # ERR: the operation ended, with an error
                if n not in failed:
                    timed_out = f"NIXL transfer timed out after {timeout:.3g}s"
                    self._transfer_failed(n, timed_out if state == "PROC" else f"NIXL: {error}", failed)
        return stopped

    def _keep(self, registration: Any, memory: Any) -> None:
        """Never reuse, free or deregister ``memory`` (until close): a transfer that did not
        stop may still move its bytes."""
        self._kept.append((registration, memory))

    def move(self, op: str, pieces: list[Piece]) -> set[int]:
        """Move all pieces (READ: pool -> views, WRITE: views -> pool); returns failed peers.
        Raises BackendUnavailableError where NIXL cannot be used, BuffersInUseError where a
        failed transfer straight from or into the caller's buffers did not stop."""
        failed: set[int] = set()
        if not pieces:
            return failed
        with self.lock:
            self._check_open()
            if len(self._kept) >= MAX_KEPT:
                raise BackendUnavailableError(
                    f"nixl_peer {self.name!r}: {len(self._kept)} transfers did not stop; no more "
                    "transfers until the backend is reopened"
                )
            try:
                self._ensure_agent()
            except Exception as exc:
                msg = f"nixl_peer {self.name!r}: cannot create NIXL agent: {exc}"
                raise BackendUnavailableError(msg) from exc
            pieces = [x for x in pieces if x.view.nbytes]
            if self._transfer_directly(op, pieces, failed):
                return failed
            self.counts["staged"] += 1
            for round_ in plan_rounds(pieces, self._staging_bytes):
                round_ = [x for x in round_ if x.peer not in failed]
                staging = self._staging_view
                assert staging is not None and self._staging is not None
                if op == "WRITE":
                    for x in round_:
                        staging[x.local : x.local + x.view.nbytes] = x.view
                handles = self._post(op, round_, failed, self._staging.ctypes.data)
                if not self._wait(handles, failed, self._timeout):
                    self._keep(self._staging_reg, self._staging)  # a new staging buffer from here on
                    self._staging = self._staging_view = self._staging_reg = None
                    self._ensure_staging()
                if op == "READ":
                    for x in round_:
                        if x.peer not in failed:
                            x.view[:] = staging[x.local : x.local + x.view.nbytes]
        return failed

    def _transfer_directly(self, op: str, pieces: list[Piece], failed: set[int]) -> bool:
        """Move the pieces straight between the caller's buffers and the pools, registering
        the few regions they lie in for this call (xfer lock held). False, moving nothing,
        when they lie in more than ``MAX_DIRECT_REGIONS`` regions or NIXL refuses one."""
        if not pieces:
            return True
        if not self._max_regions:
            return False
        for x in pieces:
            x.local = rounds.address(x.view)
        regions = direct_regions([(x.local, x.view.nbytes) for x in pieces], self._max_regions)
        if regions is None:
            return False
        try:
            registration = self._agent.register_memory([(a, n, 0, "") for a, n in regions], "DRAM")
        except Exception as exc:
            logger.debug("nixl_peer %r: direct transfer not registered: %s", self.name, exc)
            return False
        self.counts["direct"] += 1
        # as long as the staging rounds the same bytes would take
        timeout = self._timeout * max(1, -(-sum(x.view.nbytes for x in pieces) // self._staging_bytes))
        stopped = False
        try:
            stopped = self._wait(self._post(op, pieces, failed, 0), failed, timeout)
        finally:
            if stopped:
                with contextlib.suppress(Exception):
                    self._agent.deregister_memory(registration)
            else:
                self._keep(registration, [x.view for x in pieces])
                self._max_regions = 0  # no more memory kept for this client: staging from now on
                logger.warning("nixl_peer %r: a failed transfer did not stop; its buffers are kept "
                               "and transfers go through staging from now on", self.name)  # fmt: skip
        if not stopped:
            what = "destination buffers may still be written" if op == "READ" else (
                "source buffers may still be read")
            raise BuffersInUseError(f"nixl_peer {self.name!r}: a failed {op} did not stop; its {what}")
        return True

    def close(self, timeout: float) -> None:
        """Forget remote agents, deregister staging and kept memory; bounded by ``timeout``."""
        if not self.lock.acquire(timeout=timeout):
            logger.warning("nixl_peer %r: close() gave up waiting for a transfer", self.name)
            return
        try:
            for peer in self._peers:
                self._forget_remote(peer)
            for registration in [self._staging_reg, *(reg for reg, _ in self._kept)]:
                if self._agent is not None and registration is not None:
                    with contextlib.suppress(Exception):
                        self._agent.deregister_memory(registration)
            self._kept.clear()
            self._agent = self._staging_reg = self._staging_view = self._staging = None
        finally:
            self.lock.release()
