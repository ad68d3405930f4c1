"""Where a cache peer can be reached: the bind policy and the UCX data path's interface.

Trust model: one trust domain per peer. Any client holding the token can read and write every
page of the pool (NIXL READ/WRITE address the whole registered pool), so the token is the only
gate, and it only protects the control port; the NIXL/UCX data path needs the peer's agent
metadata, which HELLO hands out after the token check.

* :func:`check_bind`: a peer must have a token, unless the operator says ``--insecure``
  explicitly: off loopback anyone who reaches the port, on loopback every local user, could
  otherwise read and write every page.
* :func:`names_this_peer`: which dialed ``host:port`` a peer proves in the handshake
  (:mod:`.auth`): one of its ``--advertise`` addresses, or its own port at a host that resolves
  to the local address of the connection (the interface the client reached). Behind NAT or a
  port forward, ``--advertise`` the address clients dial.
* :func:`ucx_env`: UCX listens for the data path on every network interface by default
  (measured here: the control port on 127.0.0.1, UCX on 127.0.0.1 *and* the Ethernet address).
  ``UCX_NET_DEVICES`` set to the interface of the listen address confines it there (UCX's TCP
  transport binds the address of each device it may use). A wildcard listen address means every
  interface anyway; an operator's own ``UCX_NET_DEVICES`` is kept.

Linux only (interface addresses from ``SIOCGIFADDR`` and ``/proc/net/if_inet6``).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from pathlib import Path

__all__ = ["check_bind", "interface_of", "is_loopback", "is_wildcard", "names_this_peer", "ucx_env"]

_SIOCGIFADDR = 0x8915


def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        infos = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--listen: cannot resolve {host!r}: {exc}") from None
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address."""
    addresses = _addresses(host)
    return bool(addresses) and all(a.is_loopback for a in addresses)


def is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::") or any(a.is_unspecified for a in _addresses(host))


def check_bind(listen: str, host: str, *, has_token: bool, insecure: bool) -> None:
    """Raise ValueError (naming the options) without a token and without an explicit
    ``insecure``."""
    if has_token or insecure:
        return
    who = "every local user" if is_loopback(host) else "anyone who can reach it"
    raise ValueError(
        f"--listen {listen} without a token: {who} could read and write every page. Give a "
        "token with --token-file PATH (created if absent) or --token-env VAR, or pass --insecure "
        "to serve without one where every user is trusted"
    )


def _ipv4_interfaces() -> dict[str, str]:
    """IPv4 address -> interface name (primary address of each interface)."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                raw = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                out[socket.inet_ntoa(raw[20:24])] = name
    return out


def _ipv6_interfaces() -> dict[str, str]:
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            fields = line.split()
            if len(fields) == 6:
                out[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[5]
    return out


def interface_of(host: str) -> str | None:
    """The network interface that holds ``host``'s address (loopback: the loopback
    interface), or None if it is a wildcard or not found."""
    if is_wildcard(host):
        return None
    for address in _addresses(host):
        if address.is_loopback:
            address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
        table = _ipv4_interfaces() if address.version == 4 else _ipv6_interfaces()
        if str(address) in table:
            return table[str(address)]
    return None


def ucx_env(host: str) -> tuple[dict[str, str], str]:
    """``(environment for the NIXL agent, what it means for the log)``."""
    if os.environ.get("UCX_NET_DEVICES"):
        return {}, f"UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']} (set by the operator)"
    if is_wildcard(host):
        return {}, "UCX data path on every interface (wildcard --listen)"
    device = interface_of(host)
    if device is None:
        return {}, f"no interface found for {host}: UCX data path on every interface (set UCX_NET_DEVICES)"
    return {"UCX_NET_DEVICES": device}, f"UCX data path confined to {device}"


def _unmapped(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def names_this_peer(dialed: str, local: tuple[str, int], advertise: frozenset[str] = frozenset()) -> bool:
    """Whether a client that dialed ``dialed`` (``host:port``) meant the peer whose end of the
    connection is ``local`` (``getsockname()``): ``dialed`` is advertised, or its port is
    ``local``'s and its host resolves to ``local``'s address. Never raises (an unresolvable
    or malformed address: False)."""
    if dialed in advertise:
        return True
    host, sep, port = dialed.rpartition(":")
    if not sep or not port.isdigit() or int(port) != local[1]:
        return False
    try:
        want = _unmapped(local[0])
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
        return any(_unmapped(str(info[4][0])) == want for info in infos)
    except (OSError, ValueError, UnicodeError):
        return False
