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


def listen_address_error(address: str) -> str:
    """Why `address` is not a gRPC listen address ("" when it is): unix:PATH, unix-abstract:NAME, or HOST:PORT with
    a port within 0..65535 (0: any free port) and an IPv6 host in brackets. gRPC itself takes a port out of range
    modulo 65536 (99999 listened on 34463) and an empty one as 443."""
    if address.startswith("unix:"):
        return "" if address[len("unix:"):].lstrip("/") else "unix: needs a path (unix:/run/promptcache/grpc.sock)"
    if address.startswith("unix-abstract:"):
        return "" if address[len("unix-abstract:"):] else "unix-abstract: needs a name"
    host, sep, port = address.rpartition(":")
    if not sep:
        return "it is neither HOST:PORT nor unix:PATH"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return f"an IPv6 host goes in brackets, as in [{host}]:{port}"
    return port_error(port)


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
    scheme = target.split(":", 1)[0]
    if scheme == "unix":
        return listen_address_error(target)
    if scheme in GRPC_SCHEMES and ":" in target:
        return ""
    host, _, port = target.rpartition(":")
    if not host:
        return "it is not HOST:PORT (the sidecar's gRPC port is 50051 by default)"
    return listen_address_error(target) or ("the port must not be 0" if int(port) == 0 else "")
