"""Addresses a user writes: what the sidecar listens on (gRPC, ZMQ) and what a client dials. gRPC takes a port out
of range modulo 65536 (99999 listened on, or dialled, 34463) and an empty one as 443, so these are checked here
first, with a message that names what is wrong ("" when nothing is)."""
from __future__ import annotations

# Name resolvers a gRPC target may start with (scheme:...); anything else is HOST:PORT.
GRPC_SCHEMES = ("dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock", "xds", "google-c2p")


def port_error(port: str, wildcard: bool = False) -> str:
    if wildcard and port == "*":
        return ""
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        return f"the port {port!r} is not a number within 0..65535"
    return ""


def _scheme(address: str) -> str:
    """The URI scheme `address` starts with, lower-cased (schemes are case-insensitive): one of gRPC's name
    resolvers, or any scheme followed by "//" (http://..., passthrough:///...). "" for HOST:PORT."""
    head, sep, rest = address.partition(":")
    if not sep or not head or not (head[0].isascii() and head[0].isalpha()):
        return ""
    if not all(c.isascii() and (c.isalnum() or c in "+-.") for c in head):
        return ""
    return head.lower() if head.lower() in GRPC_SCHEMES or rest.startswith("//") else ""


def host_port_error(address: str) -> str:
    """Why `address` is not HOST:PORT with a port within 0..65535 and an IPv6 host in brackets ("" when it is)."""
    if address.startswith("[") and "]:" not in address:
        return "a bracketed IPv6 host needs :PORT after it, as in [::1]:50051"
    host, sep, port = address.rpartition(":")
    if not sep:
        return "it is neither HOST:PORT nor unix:PATH"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return f"an IPv6 host goes in brackets, as in [{host}]:{port}"
    return port_error(port)


def listen_address_error(address: str) -> str:
    """Why `address` is not a gRPC listen address ("" when it is): unix:PATH, unix-abstract:NAME, or HOST:PORT with
    a port within 0..65535 (0: any free port), an IPv6 host in brackets, and a host (gRPC's Python server cannot
    listen on ":PORT" or "*:PORT": 0.0.0.0:PORT or [::]:PORT listens on every address). gRPC itself takes a port out
    of range modulo 65536 (99999 listened on 34463) and an empty one as 443."""
    scheme = _scheme(address)
    if scheme and not address.startswith(scheme):  # gRPC's server parses only lower-case schemes
        return f"write the scheme in lower case: {scheme}:{address.split(':', 1)[1]}"
    if scheme == "unix":
        path = address.split(":", 1)[1]
        return "" if path.lstrip("/") else "unix: needs a path (unix:/run/promptcache/grpc.sock)"
    if scheme == "unix-abstract":
        return "" if address.split(":", 1)[1] else "unix-abstract: needs a name"
    if scheme:
        return (f"{scheme}: is not an address to listen on: use HOST:PORT (0.0.0.0:50051, [::]:50051) or "
                "unix:PATH")
    error = host_port_error(address)
    if error:
        return error
    host = address.rpartition(":")[0]
    if host in ("", "*"):
        return (f"{address!r} names no host: use 0.0.0.0:PORT (every IPv4 address), [::]:PORT (every address) "
                "or 127.0.0.1:PORT")
    return ""


def zmq_endpoint_error(address: str) -> str:
    """Why `address` is not a ZMQ endpoint to bind ("" when it is): tcp://HOST:PORT (PORT 0..65535, or * or 0 for
    any free one) or ipc://PATH; no white space."""
    if any(c.isspace() for c in address):
        return "it contains white space"
    if address.startswith("ipc://"):
        return "" if len(address) > len("ipc://") else "ipc:// needs a path"
    if not address.startswith("tcp://"):
        return "it is neither tcp://HOST:PORT nor ipc://PATH"
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not sep or not host:
        return "tcp:// needs HOST:PORT"
    return port_error(port, wildcard=True)


def target_error(target: str) -> str:
    """Why `target` is not a gRPC target to dial ("" when it is): HOST:PORT (a port within 1..65535, an IPv6 host in
    brackets), unix:PATH, or a target with a gRPC name resolver's scheme (dns:///HOST:PORT, ...; left to gRPC)."""
    scheme = _scheme(target)
    if scheme in ("unix", "unix-abstract"):  # (a channel takes the scheme in any case, a server lower case only)
        return listen_address_error(scheme + target[len(scheme):])
    if scheme in GRPC_SCHEMES:
        return ""
    if scheme:
        return (f"unknown scheme {scheme}: use HOST:PORT, dns:///HOST:PORT, unix:PATH or another of gRPC's "
                f"({', '.join(GRPC_SCHEMES)})")
    host, _, port = target.rpartition(":")
    if not host:
        return "it is not HOST:PORT (the sidecar's gRPC port is 50051 by default)"
    return host_port_error(target) or ("the port must not be 0" if int(port) == 0 else "")
