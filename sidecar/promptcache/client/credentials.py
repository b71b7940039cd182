"""Client credentials for the sidecar's gRPC API: TLS channels and bearer tokens (re-read when their file
changes). Shared by the client library, the admin CLI and the tools; the server's side is
promptcache.sidecar.auth."""
from __future__ import annotations

import threading
from pathlib import Path

import grpc

from promptcache.contract.wire import AUTHORIZATION


class TokenSource:
    """A fixed token, or one read from a file and re-read when the file changes (rotation)."""

    def __init__(self, token: str | None, token_file: str | None):
        self._token = token
        self._file = Path(token_file) if token_file else None
        self._sig = None
        self._lock = threading.Lock()

    def get(self) -> str:
        if self._file is None:
            return self._token or ""
        st = self._file.stat()
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            if sig != self._sig:
                self._token, self._sig = self._file.read_text().strip(), sig
            return self._token


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

    def __init__(self, token: str | None = None, token_file: str | None = None):
        self.source = TokenSource(token, token_file)

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
    def pem(value):
        if value is None or isinstance(value, bytes):
            return value
        return Path(value).read_bytes()

    options = list(options or [])
    use_tls = tls if tls is not None else any(v is not None for v in (root_certificates, client_cert, client_key))
    if use_tls:
        creds = grpc.ssl_channel_credentials(root_certificates=pem(root_certificates),
                                             private_key=pem(client_key), certificate_chain=pem(client_cert))
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        channel = grpc.secure_channel(target, creds, options=options)
    else:
        channel = grpc.insecure_channel(target, options=options)
    if token is not None or token_file is not None:
        channel = grpc.intercept_channel(channel, BearerTokenInterceptor(token, token_file))
    return channel


