"""The cache peer against clients it should not trust (issue 14): connection floods, file-limit
exhaustion, frames that declare huge bodies, silent connections, ids used by another
connection, reservations that would evict committed pages, off-loopback binds and tokens.

Real peer processes (``hybrid_offload.testing.services.peer``), real sockets; the timeout test runs a real
:class:`PeerServer` in this process with an injected clock instead of sleeping.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybrid_offload.backends import BackendConfig, BackendConfigError, BackendUnavailableError, create_backend
from hybrid_offload.backends.nixl_peer import protocol as p
from hybrid_offload.backends.nixl_peer.auth import NONCE_BYTES, RawChannel, raw_handshake
from hybrid_offload.testing.backend_pages import key, page
from hybrid_offload.testing.deadlines import wait_until
from hybrid_offload.testing.services import PeerFactory
from hybrid_offload.testing.services.peer import READY

MiB = 1 << 20
KiB = 1 << 10
FAST = {"timeout_s": 2.0, "retry_backoff_s": 0.05, "max_backoff_s": 0.2}

def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _hello(address: str, token: str = "") -> RawChannel:
    return raw_handshake(_connect(address), token.encode(), "trust-test")


def _ask(channel: RawChannel, message: p.Message, request_id: int = 2) -> p.Message:
    return channel.ask(message, request_id)


def _closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    """True once the peer closed ``sock`` (after any ERROR it sent), False if it stays open."""
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * KiB
    raise AssertionError("no VmRSS")


def _cpu_s(pid: int) -> float:
    """CPU seconds ``pid`` has used (user + system): what a busy machine does not inflate."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def _accepted(pid: int, port: int) -> dict[int, int]:
    """The IPv4 connections ``pid`` has accepted on ``port``: unread bytes in each one's receive
    queue, by the client's port."""
    inodes = _socket_inodes(pid)
    unread = {}
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, queues = fields[1], fields[2], fields[4]
        if fields[9] in inodes and int(local.split(":")[1], 16) == port and fields[3] != "0A":
            unread[int(remote.split(":")[1], 16)] = int(queues.split(":")[1], 16)
    return unread


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _listening(pid: int) -> set[str]:
    """``"ip:port"`` of every TCP socket ``pid`` listens on (/proc, as ``ss -ltnp`` shows it)."""
    inodes = _socket_inodes(pid)
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
            found.add(f"{socket.inet_ntop(family, raw)}:{int(hex_port, 16)}")
    return found


def _non_loopback_ipv4() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.123", 9))  # no packet is sent: only picks a source address
        except OSError:
            return None
        ip = probe.getsockname()[0]
    return None if ip.startswith("127.") else ip


# -- H1: floods, file limits, huge declared bodies, silent connections ----------------------------


def test_file_limit_exhausted_by_bare_connections_peer_keeps_serving(
    peers: PeerFactory, clients: Any
) -> None:
    peer = peers(nofile=96, extra_args=["--max-unauthenticated", "500"])
    backend = clients([peer.address], **FAST)
    assert backend.put_batch([(key(1), page(1, 5000))]) == [True]
    flood = []
    try:
        for _ in range(150):  # more than the peer's file limit: its accept() hits EMFILE
            flood.append(_connect(peer.address))
        wait_until(lambda: "too many open files" in peer.log.lower(), "EMFILE logged")
        assert peer.proc is not None and peer.proc.poll() is None, peer.log[-2000:]
    finally:
        for sock in flood:
            sock.close()
    # the peer goes back to accepting once descriptors are free again
    wait_until(lambda: backend.get_batch([key(1)]) == [page(1, 5000)], "accepting again",
               ignore=(BackendUnavailableError,), poll_s=0.05)  # fmt: skip
    assert peer.proc.poll() is None


def test_connection_caps_total_and_before_hello(peers: PeerFactory, clients: Any) -> None:
    peer = peers(extra_args=["--max-connections", "6", "--max-unauthenticated", "3"])
    assert peer.proc is not None
    pid, port = peer.proc.pid, _port(peer.address)
    bare = [_connect(peer.address) for _ in range(3)]
    ports = {sock.getsockname()[1] for sock in bare}
    wait_until(lambda: ports <= set(_accepted(pid, port)), "the peer accepting them in order")
    newest = _connect(peer.address)  # a 4th connection without HELLO: the oldest one goes
    assert _closed_by_peer(bare[0])
    assert not _closed_by_peer(bare[1], timeout=0.3)
    for sock in [*bare, newest]:
        sock.close()
    greeted = [_hello(peer.address) for _ in range(6)]
    refused = _connect(peer.address)  # over the total cap: refused with an ERROR
    reply, _ = p.recv_message(refused)
    assert isinstance(reply, p.Error) and "too many connections" in reply.message
    assert _closed_by_peer(refused)
    assert isinstance(_ask(greeted[0], p.Used()), p.UsedReply)  # the others are served
    greeted.pop().sock.close()
    # a freed slot is taken by a real client
    wait_until(lambda: clients([peer.address], **FAST).put_batch([(key(1), b"ok")]) == [True],
               "a freed slot taken", ignore=(BackendUnavailableError,), poll_s=0.05)  # fmt: skip
    for channel in greeted:
        channel.sock.close()


def test_declared_huge_bodies_allocate_nothing_up_front(peers: PeerFactory, clients: Any) -> None:
    peer = peers()
    assert peer.proc is not None
    backend = clients([peer.address], **FAST)
    assert backend.put_batch([(key(1), page(1, 1000))]) == [True]
    rss0 = _rss(peer.proc.pid)
    header = p.HEADER.pack(p.MAGIC, p.VERSION, p.Hello.TYPE, 0, 1, p.MAX_BODY)
    pre_hello = [_connect(peer.address) for _ in range(24)]
    for sock in pre_hello:  # before HELLO: more than HELLO can be is refused at once
        sock.sendall(header)
    for sock in pre_hello:
        reply, _ = p.recv_message(sock)
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.TOO_LARGE
        sock.close()
    lookup = p.HEADER.pack(p.MAGIC, p.VERSION, p.Lookup.TYPE, p.FLAG_SEALED, 2, p.MAX_BODY)
    greeted = [_hello(peer.address).sock for _ in range(24)]
    for sock in greeted:  # after HELLO: allowed, but memory follows the bytes that arrive
        sock.sendall(lookup + b"\0" * 1000)
    pid, port = peer.proc.pid, _port(peer.address)
    ports = [sock.getsockname()[1] for sock in greeted]

    def unread() -> list[int | None]:
        accepted = _accepted(pid, port)
        return [accepted.get(client) for client in ports]

    wait_until(lambda: unread() == [0] * len(ports), "the peer reading every byte sent")
    grown = _rss(peer.proc.pid) - rss0
    assert grown < 48 * MiB, f"peer grew by {grown / MiB:.0f} MiB"
    for sock in greeted:
        sock.close()
    assert backend.get_batch([key(1)]) == [page(1, 1000)]


def test_handshake_and_idle_timeouts_with_injected_clock() -> None:
    from hybrid_offload.backends.nixl_peer.server import PeerOptions, PeerServer

    now = [1000.0]
    options = PeerOptions(
        host="127.0.0.1", port=0, capacity_bytes=MiB, handshake_timeout_s=5.0, idle_timeout_s=60.0,
        insecure=True,
    )
    server = PeerServer(options, clock=lambda: now[0])
    server.start()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    options = {"peers": [server.address], "insecure": True}
    backend = create_backend(BackendConfig("nixl_peer", "t", MiB, options=options))
    try:
        assert backend.contains_batch([key(1)]) == [False]
        silent, greeted = _connect(server.address), _hello(server.address)
        # both accepted before the clock moves (the third open connection is the backend's)
        wait_until(lambda: server._table.counts() == (3, 1), "the silent connection accepted")
        now[0] += 6  # past the handshake timeout, well within the idle timeout
        assert _closed_by_peer(silent)
        assert isinstance(_ask(greeted, p.Used()), p.UsedReply)  # activity: idle clock restarts
        now[0] += 59
        assert not _closed_by_peer(greeted.sock, timeout=0.5)
        now[0] += 2  # 61 s after its last request
        assert _closed_by_peer(greeted.sock)
        fresh = _hello(server.address)  # and the peer still serves
        assert isinstance(_ask(fresh, p.Used()), p.UsedReply)
        fresh.sock.close()
        # the idle client's connection was closed too: it reconnects on its next call, silently
        assert backend.contains_batch([key(1)]) == [False] and backend.stats.errors == 0
    finally:
        backend.close()
        server.stop()
        thread.join(timeout=10)
        server.close()


# -- M2: ownership, reservations, keys per message ----------------------------------------------


def test_ids_belong_to_their_connection(peers: PeerFactory) -> None:
    peer = peers()
    a, b = _hello(peer.address), _hello(peer.address)
    alloc = _ask(a, p.Alloc([key(1)], [100]))
    assert isinstance(alloc, p.AllocReply) and alloc.offsets[0] is not None
    stolen = _ask(b, p.Commit(alloc.alloc_id, [True]))
    assert isinstance(stolen, p.Error) and stolen.code == p.ErrorCode.UNKNOWN_ALLOC
    assert isinstance(_ask(a, p.Commit(alloc.alloc_id, [True]), 3), p.CommitReply)
    got = _ask(a, p.Get([key(1)]), 4)
    assert isinstance(got, p.GetReply) and got.lease_id
    foreign = _ask(b, p.Release(got.lease_id), 5)
    assert isinstance(foreign, p.Error) and foreign.code == p.ErrorCode.UNKNOWN_LEASE
    assert _ask(a, p.Release(got.lease_id), 6) == p.ReleaseReply(True)
    a.close()
    b.close()


def test_uncommitted_reservations_do_not_evict_committed_pages(peers: PeerFactory) -> None:
    size = 64 * KiB
    peer = peers(4 * MiB, extra_args=["--pool-bytes", str(5 * MiB)])  # 64 pages, 16 of slack
    writer = _hello(peer.address)
    keys = [key(i) for i in range(64)]
    alloc = _ask(writer, p.Alloc(keys, [size] * 64))
    assert isinstance(alloc, p.AllocReply) and None not in alloc.offsets
    assert _ask(writer, p.Commit(alloc.alloc_id, [True] * 64), 3) == p.CommitReply(64, 0, 0)
    hogs = [_hello(peer.address) for _ in range(2)]
    for n, hog in enumerate(hogs):  # reserve a whole pool's worth each, never commit
        other = [key(i, 0x5EED0002 + n) for i in range(64)]
        reply = _ask(hog, p.Alloc(other, [size] * 64))
        assert isinstance(reply, p.AllocReply)
    present = _ask(writer, p.Lookup(keys), 4)
    assert isinstance(present, p.LookupReply) and all(present.present), present.present.count(False)
    for hog in hogs:
        hog.close()
    with writer:
        assert _ask(writer, p.Used(), 5).pages == 64  # type: ignore[attr-defined]


def test_open_reservations_per_connection_are_capped(peers: PeerFactory) -> None:
    peer = peers(extra_args=["--max-pending-per-connection", "3"])
    channel = _hello(peer.address)
    for i in range(3):
        assert isinstance(_ask(channel, p.Alloc([key(i)], [10]), 10 + i), p.AllocReply)
    over = _ask(channel, p.Alloc([key(9)], [10]), 20)
    assert isinstance(over, p.Error) and "3 open reservations" in over.message
    channel.sock.close()


def test_too_many_keys_in_one_message_refused_quickly(peers: PeerFactory, clients: Any) -> None:
    peer = peers()
    backend = clients([peer.address], **FAST)
    assert backend.put_batch([(key(1), b"kept")]) == [True]
    channel = _hello(peer.address)
    n = 500_000  # short keys, so that the message stays under MAX_BODY
    keys = [f"5eed0001-{i:08x}" for i in range(n)]
    frame = p.encode(p.Alloc(keys, [1] * n), 2, channel.session)
    assert peer.proc is not None
    cpu0 = _cpu_s(peer.proc.pid)
    channel.sock.sendall(frame)
    reply, _ = channel.recv()
    assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.TOO_LARGE, reply
    assert _closed_by_peer(channel.sock)
    assert _cpu_s(peer.proc.pid) - cpu0 < 0.5, "the peer decoded the keys before refusing"  # ~1 s if it did
    assert backend.get_batch([key(1)]) == [b"kept"]
    assert backend.used_bytes() == 4


# -- M1 / L1: binds, UCX listeners, tokens --------------------------------------------------------


def _peer_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "hybrid_offload", "peer", "--capacity-bytes", "1MiB", *args]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
    )


def _refused(*args: str) -> str:
    """Run ``peer`` with ``args``; it must exit 2 before serving; returns its output."""
    proc = _peer_cli(*args)
    try:
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 2 and READY.search(out) is None, out
    return out


def test_a_peer_needs_a_token_or_insecure_on_loopback_too(tmp_path: Path) -> None:
    """Issue 31 M5: on loopback every local user can connect; a peer without a token lets each
    of them read and write every page. ``--token-file`` creates a missing token (0600)."""
    out = _refused("--listen", "0.0.0.0:0")
    assert "--listen 0.0.0.0:0" in out and "--token-file" in out and "--insecure" in out
    out = _refused("--listen", "127.0.0.1:0")
    assert "every local user" in out and "--token-file" in out and "--insecure" in out
    token = tmp_path / "secrets" / "peer-token"
    proc = _peer_cli("--listen", "127.0.0.1:0", "--token-file", str(token))
    try:
        assert proc.stdout is not None
        lines = []
        while not lines or not (READY.search(lines[-1]) or lines[-1] == ""):  # the ready line, or EOF
            lines.append(proc.stdout.readline())
        assert READY.search(lines[-1]), lines
        assert oct(token.stat().st_mode & 0o777) == "0o600" and len(token.read_text().strip()) == 64
    finally:
        proc.kill()
        proc.wait(timeout=10)
    literal = _refused("--listen", "127.0.0.1:0", "--token", "s3cret")
    assert "--token-file" in literal and "--token-env" in literal and "s3cret" not in literal
    assert "--max-connections must be > 0" in _refused("--listen", "127.0.0.1:0", "--max-connections", "0")
    assert "--token-env" in _refused("--listen", "127.0.0.1:0", "--token-env", "HOP_UNSET_TOKEN_VARIABLE")


def test_ucx_data_path_listens_only_on_the_listen_interface(peers: PeerFactory, clients: Any) -> None:
    if _non_loopback_ipv4() is None:
        pytest.skip("this machine has no non-loopback interface to leak onto")
    peer = peers()
    assert peer.proc is not None
    backend = clients([peer.address])
    assert backend.put_batch([(key(1), page(1, 3000))]) == [True]  # the data path works
    assert backend.get_batch([key(1)]) == [page(1, 3000)]
    listening = _listening(peer.proc.pid)
    assert len(listening) >= 2, listening  # the control port and UCX's
    assert all(address.startswith("127.") for address in listening), listening


@pytest.mark.parametrize("secured", [True, False], ids=["token", "insecure"])
def test_off_loopback_peer_confines_ucx_to_that_interface(tmp_path: Path, secured: bool) -> None:
    ip = _non_loopback_ipv4()
    if ip is None:
        pytest.skip("this machine has no non-loopback interface")
    token = tmp_path / "token"
    token.write_text("t0ken")
    proc = _peer_cli("--listen", f"{ip}:0", *(["--token-file", str(token)] if secured else ["--insecure"]))
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # bounded: the peer prints its ready line or exits
            lines.append(line)
            if READY.search(line) or len(lines) > 50:
                break
        assert READY.search(lines[-1]), "".join(lines)
        assert "UCX data path confined to" in "".join(lines)
        assert ("WITHOUT a token (--insecure)" in "".join(lines)) is not secured
        listening = _listening(proc.pid)
        assert len(listening) >= 2 and all(a.startswith(f"{ip}:") for a in listening), listening
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_tokens_from_file_or_env_never_literal_and_never_logged(
    peers: PeerFactory, clients: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "tok-7f3a9c-very-secret"
    peer = peers(token=secret)
    good = tmp_path / "token"
    good.write_text(secret + "\n")
    bad = tmp_path / "wrong"
    bad.write_text("not-it")
    monkeypatch.setenv("HOP_TEST_PEER_TOKEN", secret)
    by_file = clients([peer.address], token_file=str(good), **FAST)
    assert by_file.put_batch([(key(1), b"x")]) == [True]
    by_env = clients([peer.address], token_env="HOP_TEST_PEER_TOKEN", **FAST)
    assert by_env.get_batch([key(1)]) == [b"x"]
    wrong = clients([peer.address], token_file=str(bad), **FAST)
    with pytest.raises(BackendUnavailableError, match="wrong token"):
        wrong.get_batch([key(1)])
    with pytest.raises(BackendConfigError, match=r"'token'.*'token_file'.*'token_env'"):
        clients([peer.address], token=secret)
    with pytest.raises(BackendConfigError, match=r"'token_file'.*missing"):
        clients([peer.address], token_file=str(tmp_path / "missing"))
    assert secret not in repr(by_file.__dict__)
    assert secret not in peer.log


def test_wrong_tokens_neither_flood_nor_forge_the_peer_log(peers: PeerFactory) -> None:
    """Issue 31 M3: a client that is not authenticated controls its HELLO's name. 300 wrong
    HELLOs, each naming itself with a newline, a forged log line and 60 KiB of filler, must not
    write that name into the log (no forged line, no megabytes): they are counted into the
    rate-limited report of closed connections instead."""
    peer = peers(token="the-right-token")
    before = len(peer.log)
    forged = "WARNING hybrid_offload forged: all pages verified"
    name = "x\n" + forged + "\n" + "y" * (60 * KiB)
    for _ in range(300):
        sock = _connect(peer.address)
        try:
            p.send_message(sock, p.Hello(os.urandom(NONCE_BYTES), name, peer.address), 1)
            assert isinstance(p.recv_message(sock)[0], p.Challenge)
            p.send_message(sock, p.Prove(b"a guess at the token's proof".ljust(32)), 2)
            reply, _ = p.recv_message(sock)
            assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.AUTH_FAILED
        finally:
            sock.close()
    wait_until(lambda: "wrong token" in peer.log[before:], timeout_s=15, what="the wrong-token report")
    grown = peer.log[before:]
    assert forged not in grown.splitlines()
    assert not any(line.startswith("WARNING hybrid_offload forged") for line in grown.splitlines())
    assert len(grown) < 20 * KiB, f"{len(grown)} bytes of log for 300 wrong HELLOs"


class _Impostor:
    """A process holding an address clients expect their peer at (bound while the peer
    restarted), without the token: it records every byte clients send and answers as a peer
    would, handing out metadata of its own choosing to anyone who gets that far."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.received = bytearray()
        self.proved = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                sock, _ = self.listener.accept()
                with sock:
                    self._answer(sock)

    def _answer(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError, ConnectionError, p.ProtocolError):
            while True:
                header = sock.recv(p.HEADER.size, socket.MSG_WAITALL)
                msg_type, request_id, length = p.decode_header(header)
                body = sock.recv(length, socket.MSG_WAITALL) if length else b""
                self.received += header + body
                if msg_type == p.Hello.TYPE:
                    reply: p.Message = p.Challenge(os.urandom(NONCE_BYTES), os.urandom(32))
                else:
                    self.proved += 1
                    metadata = b"attacker-chosen nixl metadata"
                    reply = p.HelloReply("impostor", metadata, 0, 1 << 30, 1 << 30, b"")
                p.send_message(sock, reply, request_id)

    def close(self) -> None:
        self.listener.close()


def test_the_token_never_crosses_the_wire_and_an_impostor_is_refused(clients: Any, tmp_path: Path) -> None:
    """Issue 31 M2: whoever holds the peer's address learns nothing from a client and gets no
    further than HELLO: the client checks the peer's proof before it sends its own and before it
    uses anything the peer sent."""
    secret = "tok-4b1d-the-real-one"
    (tmp_path / "token").write_text(secret)
    impostor = _Impostor()
    try:
        backend = clients([impostor.address], token_file=str(tmp_path / "token"), **FAST)
        with pytest.raises(BackendUnavailableError, match="did not prove our token"):
            backend.get_batch([key(1)])
        with pytest.raises(BackendUnavailableError):
            backend.put_batch([(key(2), b"x")])
        wait_until(lambda: len(impostor.received) > 0, timeout_s=5, what="the client's HELLO")
        assert secret.encode() not in impostor.received
        assert impostor.proved == 0
    finally:
        impostor.close()


def _frame(sock: socket.socket) -> tuple[bytes, bytes, bytes]:
    """One whole frame off ``sock`` as it travels: ``(header, body, tag)``."""
    header = p._recv_exact(sock, p.HEADER.size)
    flags, length = p.HEADER.unpack(header)[3], p.HEADER.unpack(header)[5]
    body = p._recv_exact(sock, length) if length else b""
    return header, body, p._recv_exact(sock, p.TAG_BYTES) if flags & p.FLAG_SEALED else b""


Tamper = Callable[[bytes, bytes, bytes], list[bytes]]


def _with_length(header: bytes, length: int) -> bytes:
    return header[:12] + length.to_bytes(4, "big")


def _as_is(header: bytes, body: bytes, tag: bytes) -> list[bytes]:
    return [header + body + tag]


class _Relay:
    """A machine in the middle, listening at ``address`` (``at``: an address to take over):
    it passes each request to ``target`` through ``requests`` and each reply back through
    ``replies`` (both see whole frames and return the frames to send on). ``seen`` counts
    the requests it passed on."""

    def __init__(self, at: str = "127.0.0.1:0") -> None:
        host, port = at.rsplit(":", 1)
        self.listener = socket.create_server((host, int(port)))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen = 0

    def start(self, target: str, requests: Tamper = _as_is, replies: Tamper = _as_is) -> _Relay:
        def pipe(client: socket.socket) -> None:
            broken = (OSError, ConnectionError, p.ProtocolError)
            with client, _connect(target) as upstream, contextlib.suppress(*broken):
                while True:
                    for frame in requests(*_frame(client)):
                        upstream.sendall(frame)
                        self.seen += 1
                        client.sendall(b"".join(replies(*_frame(upstream))))

        def accept() -> None:
            with contextlib.suppress(OSError):
                while True:
                    threading.Thread(target=pipe, args=(self.listener.accept()[0],), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return self

    def close(self) -> None:
        self.listener.close()


def test_peer_metadata_altered_in_transit_is_never_loaded(
    peers: PeerFactory, clients: Any, tmp_path: Path
) -> None:
    """Issue 31 M2: the HELLO reply (the NIXL metadata the client loads into its agent) is bound
    to the handshake by a MAC: a relay that rewrites it is refused; one that does not (a port
    forward the peer advertises) is served."""
    relays = [_Relay(), _Relay()]
    peer = peers(token="tok-relay", extra_args=[a for r in relays for a in ("--advertise", r.address)])
    (tmp_path / "token").write_text("tok-relay")

    def swap_metadata(header: bytes, body: bytes, tag: bytes) -> list[bytes]:
        if p.HEADER.unpack(header)[2] == p.HelloReply.TYPE:
            reply = p.decode_body(p.HelloReply.TYPE, body)
            assert isinstance(reply, p.HelloReply)
            body = dataclasses.replace(reply, metadata=reply.metadata[:-1] + b"\x00").body()
            header = _with_length(header, len(body))
        return [header + body + tag]

    for relay, tamper, served in ((relays[0], _as_is, True), (relays[1], swap_metadata, False)):
        relay.start(peer.address, replies=tamper)
        try:
            backend = clients([relay.address], token_file=str(tmp_path / "token"), **FAST)
            if served:
                assert backend.put_batch([(key(1), b"through the relay")]) == [True]
                assert backend.get_batch([key(1)]) == [b"through the relay"]
            else:
                with pytest.raises(BackendUnavailableError, match="altered in transit"):
                    backend.get_batch([key(1)])
        finally:
            relay.close()


def _ring(peers: PeerFactory, clients: Any, tmp_path: Path) -> tuple[list[Any], Any, dict[str, list[str]]]:
    """Two peers with one token, a client over both and 40 pages: ``(peers, client, keys by
    peer address)``."""
    ring = [peers(token="tok-ring"), peers(token="tok-ring")]
    (tmp_path / "token").write_text("tok-ring")
    backend = clients([peer.address for peer in ring], token_file=str(tmp_path / "token"), **FAST)
    keys = [key(i) for i in range(40)]
    assert backend.put_batch([(k, k.encode()) for k in keys]) == [True] * len(keys)
    owned: dict[str, list[str]] = {peer.address: [] for peer in ring}
    for k in keys:
        owned[backend.peer_for(k)].append(k)
    assert all(owned.values())
    return ring, backend, owned


@pytest.mark.parametrize("rewrite", [False, True], ids=["as-is", "rewritten"])
def test_a_relay_at_a_down_peers_address_reaches_no_other_peer(
    peers: PeerFactory, clients: Any, tmp_path: Path, rewrite: bool
) -> None:
    """Issue 45 N1: peer A of a ring is down; a local user without the token takes A's address
    and relays the client's handshake to peer B. Relayed as it is, B refuses the address (it is
    not B's); rewritten to B's address, B's proof no longer covers the address the client
    dialed and the client refuses. Either way the client's requests for A's keys never reach
    B: they miss, A's pages never land in B, and B's pages are untouched."""
    (a, b), backend, owned = _ring(peers, clients, tmp_path)
    with _hello(b.address, "tok-ring") as channel:
        b_usage = channel.ask(p.Used())
    a.kill()

    def to_b(header: bytes, body: bytes, tag: bytes) -> list[bytes]:
        if rewrite and p.HEADER.unpack(header)[2] == p.Hello.TYPE:
            hello = p.decode_body(p.Hello.TYPE, body)
            assert isinstance(hello, p.Hello)
            body = dataclasses.replace(hello, dialed=b.address).body()
            header = _with_length(header, len(body))
        return [header + body + tag]

    relay = _Relay(at=a.address).start(b.address, requests=to_b)
    try:
        mine = owned[a.address]
        reason = "does not answer at" if not rewrite else "did not prove our token for " + a.address
        for _ in range(3):
            assert backend.get_batch(mine) == [None] * len(mine)
            assert backend.put_batch([(k, b"forged") for k in mine]) == [False] * len(mine)
            assert backend.contains_batch(mine) == [False] * len(mine)
            assert reason in backend._peers[0].last_error
        assert relay.seen <= 3 * 6  # HELLO (and PROVE) of each attempt, nothing after
        with _hello(b.address, "tok-ring") as channel:
            assert channel.ask(p.Used()) == b_usage  # nothing landed in B
        assert backend.get_batch(owned[b.address]) == [k.encode() for k in owned[b.address]]
    finally:
        relay.close()


def test_frames_altered_or_injected_after_the_handshake_close_the_connection(
    peers: PeerFactory, clients: Any, tmp_path: Path
) -> None:
    """Issue 45 N1: a machine in the middle of a connection that completed the handshake (a
    port forward the peer advertises) alters a DELETE's key, then injects a DELETE of its own:
    the peer checks each frame's session MAC, closes the connection and deletes nothing; the
    client reconnects and is served."""
    relay = _Relay()
    peer = peers(token="tok-mitm", extra_args=["--advertise", relay.address])
    (tmp_path / "token").write_text("tok-mitm")
    victim, other = key(1), key(2)
    attacks = ["alter", "inject"]
    tried: list[str] = []

    def mitm(header: bytes, body: bytes, tag: bytes) -> list[bytes]:
        if p.HEADER.unpack(header)[2] != p.Delete.TYPE or not attacks:
            return [header + body + tag]
        tried.append(attacks.pop(0))
        if tried[-1] == "alter":  # the client deletes `other`; the relay makes it `victim`
            return [header + body.replace(other.encode(), victim.encode()) + tag]
        forged = p.Delete([victim]).body()  # a DELETE of the victim before the client's own
        forged_header = p.HEADER.pack(p.MAGIC, p.VERSION, p.Delete.TYPE, p.FLAG_SEALED, 9, len(forged))
        return [forged_header + forged + tag, header + body + tag]

    relay.start(peer.address, requests=mitm)
    try:
        backend = clients([relay.address], token_file=str(tmp_path / "token"), **FAST)
        assert backend.put_batch([(victim, b"victim"), (other, b"other")]) == [True, True]

        def delete_other() -> bool:
            with contextlib.suppress(BackendUnavailableError):
                backend.delete_batch([other])
            return len(tried) == 2

        wait_until(delete_other, "both attacks tried", poll_s=0.05)
        direct = clients([peer.address], token_file=str(tmp_path / "token"), **FAST)
        assert direct.get_batch([victim]) == [b"victim"]

        def deleted() -> bool:
            backend.delete_batch([other])  # the client's own DELETE, now passed as it is
            return direct.get_batch([other]) == [None]

        wait_until(deleted, "the client served again", ignore=(BackendUnavailableError,), poll_s=0.05)
        assert peer.log.count("session MAC") >= 2, peer.log
    finally:
        relay.close()


def test_one_agent_at_two_addresses_is_refused(peers: PeerFactory, clients: Any) -> None:
    """Issue 45 N1: the client refuses an agent it already reached at another of its addresses
    (a relay, or one peer listed twice): its keys there miss, with the reason."""
    peer = peers()
    port = peer.address.rsplit(":", 1)[1]
    backend = clients([peer.address, f"localhost:{port}"], **FAST)
    keys = [key(i) for i in range(40)]
    backend.put_batch([(k, b"x") for k in keys])
    refused = [state.address for state in backend._peers if "answers at both" in state.last_error]
    assert len(refused) == 1  # whichever address answered second
    twice = [k for k in keys if backend.peer_for(k) == refused[0]]
    served = [k for k in keys if k not in twice]
    assert twice and backend.get_batch(twice) == [None] * len(twice)
    assert served and backend.get_batch(served) == [b"x"] * len(served)


def test_one_alloc_holds_the_peer_lock_for_bounded_time(peers: PeerFactory) -> None:
    """Issue 31 M4: an authenticated client fills a 16 MiB pool with 64-byte pages, deletes
    every other one and asks for a 1 MiB page. Finding room used to evict one page and rescan
    the free list, all under the peer's lock: 44.5 s for that one ALLOC while every other
    client waited. Now each message's work is bounded (what it cannot finish is refused), the
    room it made stays made, and a few ALLOCs later the page fits."""
    peer = peers(16 * MiB, extra_args=["--pool-bytes", str(16 * MiB)])
    attacker, bystander = _hello(peer.address), _hello(peer.address)
    keys = [key(i) for i in range(16 * MiB // 64)]
    for start in range(0, len(keys), p.MAX_KEYS):
        batch = keys[start : start + p.MAX_KEYS]
        reply = _ask(attacker, p.Alloc(batch, [64] * len(batch)))
        assert isinstance(reply, p.AllocReply)
        stored = [o is not None for o in reply.offsets]
        assert isinstance(_ask(attacker, p.Commit(reply.alloc_id, stored)), p.CommitReply)
    for start in range(0, len(keys), 2 * p.MAX_KEYS):
        assert isinstance(_ask(attacker, p.Delete(keys[start : start + 2 * p.MAX_KEYS : 2])), p.DeleteReply)
    answered: list[float] = []
    done = threading.Event()

    def lookups() -> None:
        while not done.is_set():
            t = time.monotonic()
            assert isinstance(_ask(bystander, p.Lookup([key(1)])), p.LookupReply)
            answered.append(time.monotonic() - t)

    watcher = threading.Thread(target=lookups)
    watcher.start()
    took: list[float] = []
    try:
        for _ in range(50):
            began = time.monotonic()
            reply = _ask(attacker, p.Alloc([key(1 << 30)], [MiB]))
            took.append(time.monotonic() - began)
            assert isinstance(reply, p.AllocReply)
            granted = reply.offsets[0] is not None
            _ask(attacker, p.Commit(reply.alloc_id, [granted]))
            if granted:
                break
    finally:
        done.set()
        watcher.join(timeout=60)
    assert granted, f"no room after {len(took)} ALLOCs"
    assert max(took) < 1.0, f"one 1-key ALLOC took {max(took):.1f} s"
    assert answered and max(answered) < 1.0, f"a LOOKUP waited {max(answered):.1f} s behind them"
    assert _ask(bystander, p.Lookup([key(1 << 30)])) == p.LookupReply([True])
