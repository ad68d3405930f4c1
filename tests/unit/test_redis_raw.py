"""The raw RESP reader of the redis backend against a scripted server: replies cut anywhere
between reads, values longer than their buffer, error replies and a dropped stream."""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Iterator

import pytest
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from hybrid_offload.backends.redis.raw import RawReader, raw_reader_for


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


class Scripted:
    """A one-connection-at-a-time server: per connection, reads until it has seen
    ``expect`` commands, then sends ``reply`` in pieces of ``piece`` bytes (or closes early)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sessions: queue.Queue[tuple[int, bytes, int, bool] | None] = queue.Queue()
        self.received: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def script(self, expect: int, reply: bytes, piece: int = 1 << 20, close: bool = False) -> None:
        self.sessions.put((expect, reply, piece, close))

    def _serve(self) -> None:
        conn = None
        while True:
            session = self.sessions.get()
            if session is None:
                return
            expect, reply, piece, close = session
            data = b""
            while data.count(b"*") < expect or not data.endswith(b"\r\n"):
                if conn is None:  # the first, or the client dropped the last one
                    try:
                        conn, _ = self.listener.accept()
                    except OSError:
                        return
                    data = b""
                chunk = conn.recv(1 << 16)
                if not chunk:
                    conn.close()
                    conn = None
                data += chunk
            self.received.append(data)
            for at in range(0, len(reply), piece):
                conn.sendall(reply[at : at + piece])
            if close:
                conn.close()
                conn = None

    def close(self) -> None:
        self.sessions.put(None)
        self.listener.close()


@pytest.fixture
def server() -> Iterator[Scripted]:
    srv = Scripted()
    yield srv
    srv.close()


@pytest.mark.parametrize("piece", [1, 3, 7, 64, 1 << 20])
def test_replies_cut_anywhere_land_in_their_buffers(server: Scripted, piece: int) -> None:
    values = [b"a" * 100, b"", b"xyz" * 50, b"q"]
    server.script(4, b"".join(bulk(v) for v in values), piece)
    reader = RawReader("127.0.0.1", server.port)
    bufs = [bytearray(200) for _ in values]
    got = reader.read_into(["k1", "k2", "k3", "k4"], [200] * 4, [memoryview(b) for b in bufs])
    assert got == [len(v) for v in values]
    for value, buf in zip(values, bufs, strict=True):
        assert bytes(buf[: len(value)]) == value
    assert b"GETRANGE" in server.received[0] and b"$2\r\nk3\r\n" in server.received[0]
    reader.close()


def test_a_longer_value_fills_its_buffer_and_the_stream_stays_in_step(server: Scripted) -> None:
    server.script(2, bulk(b"L" * 11) + bulk(b"ok"), 5)
    server.script(1, bulk(b"again"), 2)  # the same connection, reused
    reader = RawReader("127.0.0.1", server.port)
    bufs = [bytearray(10), bytearray(10)]
    assert reader.read_into(["a", "b"], [10, 10], [memoryview(b) for b in bufs]) == [11, 2]
    assert bytes(bufs[0]) == b"L" * 10 and bytes(bufs[1][:2]) == b"ok"
    assert reader.read_into(["c"], [10], [memoryview(bufs[0])]) == [5]
    assert bytes(bufs[0][:5]) == b"again"
    reader.close()


def test_an_error_reply_raises_and_the_connection_is_dropped(server: Scripted) -> None:
    server.script(2, bulk(b"x") + b"-WRONGTYPE Operation against a key\r\n")
    server.script(1, bulk(b"fresh"), close=True)
    reader = RawReader("127.0.0.1", server.port)
    buf = bytearray(8)
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        reader.read_into(["a", "b"], [8, 8], [memoryview(buf), memoryview(buf)])
    assert reader.read_into(["c"], [8], [memoryview(buf)]) == [5]  # a new connection
    reader.close()


def test_a_kept_connection_the_server_dropped_is_retried_once_on_a_new_one(server: Scripted) -> None:
    """A server restart closes kept connections: the call is sent again, not failed."""
    server.script(1, bulk(b"one"))
    server.script(1, b"", close=True)  # the kept connection: the server closes it unanswered
    server.script(1, bulk(b"two"))
    reader = RawReader("127.0.0.1", server.port)
    buf = bytearray(8)
    assert reader.read_into(["a"], [8], [memoryview(buf)]) == [3]
    assert reader.read_into(["b"], [8], [memoryview(buf)]) == [3]
    assert bytes(buf[:3]) == b"two"
    assert len(server.received) == 3 and b"$1\r\nb\r\n" in server.received[2]
    reader.close()


def test_a_new_connection_the_server_drops_is_not_retried(server: Scripted) -> None:
    server.script(1, bulk(b"one"))
    server.script(1, b"", close=True)
    server.script(1, b"", close=True)  # the retry's new connection is dropped too
    reader = RawReader("127.0.0.1", server.port)
    buf = bytearray(8)
    reader.read_into(["a"], [8], [memoryview(buf)])
    with pytest.raises(RedisConnectionError, match="closed"):
        reader.read_into(["b"], [8], [memoryview(buf)])
    assert len(server.received) == 3  # one retry, not more
    reader.close()


@pytest.mark.parametrize(
    ("reply", "close", "match"),
    [(b"$100\r\n" + b"z" * 40, True, "closed"), (b"+OK\r\n", False, "unexpected reply")],
    ids=["stream closed mid value", "garbage"],
)
def test_a_broken_stream_is_a_connection_error(
    server: Scripted, reply: bytes, close: bool, match: str
) -> None:
    server.script(1, reply, close=close)
    reader = RawReader("127.0.0.1", server.port)
    with pytest.raises(RedisConnectionError, match=match):
        reader.read_into(["a"], [100], [memoryview(bytearray(100))])
    reader.close()


def test_authentication_and_database_are_sent_first(server: Scripted) -> None:
    server.script(2, b"+OK\r\n+OK\r\n")
    server.script(1, bulk(b"v"))
    reader = RawReader("127.0.0.1", server.port, db=3, username="alice", password="pw")
    buf = bytearray(4)
    assert reader.read_into(["k"], [4], [memoryview(buf)]) == [1]
    assert (
        server.received[0]
        == b"*3\r\n$4\r\nAUTH\r\n$5\r\nalice\r\n$2\r\npw\r\n*2\r\n$6\r\nSELECT\r\n$1\r\n3\r\n"
    )
    reader.close()


def test_a_refused_password_is_an_authentication_error(server: Scripted) -> None:
    server.script(1, b"-WRONGPASS invalid username-password pair\r\n", close=True)
    reader = RawReader("127.0.0.1", server.port, password="nope")
    with pytest.raises(AuthenticationError, match="WRONGPASS"):
        reader.read_into(["k"], [4], [memoryview(bytearray(4))])
    reader.close()


def test_which_urls_get_a_raw_reader() -> None:
    options = {"connect_timeout_s": 1.0, "socket_timeout_s": 1.0, "max_connections": 2}
    assert raw_reader_for("redis://127.0.0.1:6380/2", None, options) is not None
    assert raw_reader_for("rediss://127.0.0.1:6380/0", None, options) is None  # TLS: redis-py
    assert raw_reader_for("redis+cluster://127.0.0.1:7000", None, options) is None
