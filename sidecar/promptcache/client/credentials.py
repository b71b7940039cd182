"""Client credentials for the sidecar's gRPC API: TLS channels and bearer tokens (re-read when their file
changes). Shared by the client library, the admin CLI and the tools; the server's side is
promptcache.sidecar.auth."""
from __future__ import annotations

import errno
import os
import stat
import threading
import weakref
from pathlib import Path

import grpc

from promptcache.contract.wire import AUTHORIZATION

MAX_CREDENTIAL_BYTES = 1 << 20  # a token, a key or a CA bundle: far below this; /dev/zero is not read to the end


class CredentialError(ValueError):
    """A credential file cannot be used; the message is one line naming the flag (or argument) and the file."""


def read_credential(path: str | os.PathLike, flag: str, limit: int = MAX_CREDENTIAL_BYTES) -> bytes:
    """The bytes of a credential file, read without blocking (O_NONBLOCK: a FIFO does not hang) and bounded
    (`limit`): only a regular file is accepted. Raises CredentialError naming `flag` and the path."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise CredentialError(f"{flag} {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise CredentialError(f"{flag} {path}: {what}")
        chunks, got = [], 0
        while got <= limit:
            b = os.read(fd, min(1 << 16, limit + 1 - got))
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got > limit:
            raise CredentialError(f"{flag} {path}: larger than {limit} bytes, not a credential file")
        return b"".join(chunks)
    except OSError as exc:
        if exc.errno == errno.EISDIR:
            raise CredentialError(f"{flag} {path}: a directory") from None
        raise CredentialError(f"{flag} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def read_token(path: str | os.PathLike, flag: str = "token_file") -> str:
    """The bearer token in a token file (surrounding whitespace stripped), bounded; one line naming the file on
    any error, including an empty file or one that is not UTF-8 text."""
    raw = read_credential(path, flag)
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CredentialError(f"{flag} {path}: not UTF-8 text") from None
    if not token:
        raise CredentialError(f"{flag} {path}: holds no token (empty)")
    if any(c in token for c in "\r\n\0"):
        raise CredentialError(f"{flag} {path}: holds more than one line; put only the token in it")
    return token


class TokenSource:
    """A fixed token, or one read from a file and re-read when the file changes (rotation). A file that cannot
    be read raises CredentialError (one line naming the file): nothing is sent with a stale or empty token."""

    def __init__(self, token: str | None, token_file: str | None, flag: str = "token_file"):
        self._token = token
        self._file = Path(token_file) if token_file else None
        self._flag = flag
        self._sig = None
        self._lock = threading.Lock()
        _SOURCES.add(self)

    def get(self) -> str:
        if self._file is None:
            return self._token or ""
        try:
            st = self._file.stat()
        except OSError as exc:
            raise CredentialError(f"{self._flag} {self._file}: {exc.strerror or exc}") from None
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            if sig != self._sig:
                self._token, self._sig = read_token(self._file, self._flag), sig
            return self._token


_SOURCES: "weakref.WeakSet[TokenSource]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """New locks in a child just forked: a parent thread may have held one at the fork (re-reading the token file),
    and it is never released there."""
    for source in list(_SOURCES):
        source._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Details:
    def __init__(self, base, metadata):
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class BearerTokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer TOKEN` to every call; works on plaintext (loopback) and TLS channels."""

    def __init__(self, token: str | None = None, token_file: str | None = None, flag: str = "token_file"):
        self.source = TokenSource(token, token_file, flag)

    def _details(self, details):
        metadata = [m for m in (details.metadata or ()) if m[0] != AUTHORIZATION]
        metadata.append((AUTHORIZATION, f"Bearer {self.source.get()}"))
        return _Details(details, metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def client_channel(target: str, *, root_certificates: str | bytes | None = None,
                   client_cert: str | bytes | None = None, client_key: str | bytes | None = None,
                   tls: bool | None = None, server_name: str | None = None, token: str | None = None,
                   token_file: str | None = None, options: list | None = None) -> grpc.Channel:
    """A channel to the sidecar. Certificate arguments are PEM bytes or paths to PEM files. TLS is on when
    any certificate is given or tls=True (system roots then)."""
    def pem(value, flag):
        if value is None or isinstance(value, bytes):
            return value
        return read_credential(value, flag)

    from promptcache.contract.addresses import target_error

    problem = target_error(target)
    if problem:  # (gRPC would dial 99999 as 34463, an empty port as 443)
        raise ValueError(f"sidecar address {target!r}: {problem}")
    options = list(options or [])
    use_tls = tls if tls is not None else any(v is not None for v in (root_certificates, client_cert, client_key))
    if use_tls:
        creds = grpc.ssl_channel_credentials(root_certificates=pem(root_certificates, "tls_ca"),
                                             private_key=pem(client_key, "tls_key"),
                                             certificate_chain=pem(client_cert, "tls_cert"))
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        channel = grpc.secure_channel(target, creds, options=options)
    else:
        channel = grpc.insecure_channel(target, options=options)
    if token is not None or token_file is not None:
        channel = grpc.intercept_channel(channel, BearerTokenInterceptor(token, token_file))
    return channel


