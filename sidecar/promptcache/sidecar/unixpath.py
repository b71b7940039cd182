"""The socket files the sidecar listens on (--grpc-address unix:PATH, --bulk-address unix:PATH). A path is taken
over only when it holds a socket nobody listens on (a killed run's leftover): never a file that is not a socket (it
was deleted, and replaced by the socket), and never a socket another process serves (gRPC's core unlinks it and
binds anew: the first sidecar then serves nobody, and its clients reach the second). The socket bound is removed at
stop only while it is still the same file."""
from __future__ import annotations

import errno
import os
import socket
import stat

PROBE_SECONDS = 1.0  # a live listener with a full backlog does not answer at once: it is still in use


def grpc_socket_path(address: str) -> str | None:
    """The file of a gRPC unix address (unix:PATH, unix:///ABS), None for any other (unix-abstract: has none)."""
    if address.startswith("unix://"):
        return address[len("unix://"):]
    if address.startswith("unix:"):
        return address[len("unix:"):]
    return None


def claim(path: str, flag: str) -> None:
    """Make `path` free to bind: absent, or a leftover socket (removed). OSError naming `flag` otherwise."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OSError(f"cannot listen on {flag} {path}: {exc.strerror or exc}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"cannot listen on {flag} {path}: it exists and is not a socket; it is not replaced (remove "
                      "it, or name another path)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_SECONDS)
    try:
        probe.connect(path)
    except ConnectionRefusedError:  # nobody listens: a leftover of a run that was killed
        os.unlink(path)
        return
    except OSError as exc:
        if exc.errno == errno.ENOENT:  # removed meanwhile
            return
        raise OSError(f"cannot listen on {flag} {path}: the socket is in use ({exc.strerror or exc})") from None
    finally:
        probe.close()
    raise OSError(f"cannot listen on {flag} {path}: the socket is in use by another process")


def identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the socket at `path`, None when there is none."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def release(path: str, bound: tuple[int, int] | None) -> None:
    """Remove the socket file this process bound, only if `path` still is that file."""
    if bound is not None and identity(path) == bound:
        try:
            os.unlink(path)
        except OSError:
            pass
