"""Which listen addresses stay on this machine (plaintext is allowed there without --allow-insecure-remote), and
which callers are on it (an unauthenticated Export is served only to them)."""
from __future__ import annotations

import ipaddress


def is_local_address(address: str) -> bool:
    """A unix socket, localhost or a loopback IP (HOST:PORT, [V6]:PORT)."""
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_peer(peer: str) -> bool:
    """A gRPC peer (context.peer(): ipv4:HOST:PORT, ipv6:[HOST]:PORT, unix:PATH) on this machine: a unix socket or
    a loopback address (an IPv4-mapped one included)."""
    if peer.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("ipv4:", "ipv6:"):
        if peer.startswith(scheme):
            host = peer[len(scheme):].rsplit(":", 1)[0].strip("[]")
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                return False
            mapped = getattr(ip, "ipv4_mapped", None)
            return ip.is_loopback or (mapped is not None and mapped.is_loopback)
    return False
