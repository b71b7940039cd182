"""Which listen addresses stay on this machine (plaintext is allowed there without --allow-insecure-remote)."""
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
