"""Authentication: who is calling. mTLS (tenant = the client certificate's common name) and bearer tokens read
from a mounted file or folder, reloaded when it changes.

The sidecar's `Guard` interceptor authenticates every call except the gRPC health service's Check and List
(probes carry no credentials and they reveal nothing; Watch, a stream that holds a worker thread, is guarded),
enforces the per-client call limit and the stream watchdog (promptcache.sidecar.limits), and attaches the
caller's `Identity` to the call context for the service (promptcache.sidecar.tenancy derives the tenant's key salt
from it).

Token file formats (docs/security.md):
  * a folder, as Kubernetes mounts a Secret: each file is a tenant, its name the tenant name, its content
    one or more tokens (one per line);
  * a file of lines `TENANT:TOKEN` (blank lines and lines starting with # are ignored).
"""
from __future__ import annotations

import hashlib
import logging
import ssl
import threading
import time
from pathlib import Path

import grpc

from promptcache.contract.wire import AUTHORIZATION
from promptcache.sidecar.identity import ANONYMOUS, TENANT_NAME, Identity, check_tenant_name  # noqa: F401

log = logging.getLogger("promptcache.sidecar.auth")

HEALTH_PREFIX = "/grpc.health.v1.Health/"
_IDENTITY_ATTR = "promptcache_identity"


def identity_of(context) -> Identity:
    """The identity the Guard attached to this call (ANONYMOUS when auth is off or no Guard ran)."""
    return getattr(context, _IDENTITY_ATTR, ANONYMOUS)


MAX_TOKEN_FILE_BYTES = 1 << 20  # per file; a token file is a few hundred bytes
MAX_TOKEN_FILES = 10_000  # tenants in a token folder


def _text(path: Path) -> str:
    """A token file's text: a regular file, read without blocking and bounded (ValueError naming it else)."""
    from promptcache.client.credentials import CredentialError, read_credential

    try:
        return read_credential(path, "--token-file", MAX_TOKEN_FILE_BYTES).decode("utf-8")
    except CredentialError as exc:
        raise ValueError(str(exc)) from None
    except UnicodeDecodeError:
        raise ValueError(f"--token-file {path}: not UTF-8 text") from None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class TokenStore:
    """Bearer tokens -> tenant, from a file or a folder; re-read when a file's (inode, size, mtime) changes.

    Only SHA-256 digests of the tokens are kept, and a presented token is looked up by its digest, so the
    time a lookup takes does not depend on how many leading characters of a real token it shares.

    One rule, fail closed (docs/security.md, "Token file semantics"): the tokens accepted are exactly those the
    file says now. Emptied, deleted, unreadable (a directory, a FIFO, over MAX_TOKEN_FILE_BYTES) or malformed:
    no token is accepted (every call UNAUTHENTICATED) until it is valid again; one log line per change says why
    and `reload_errors` counts it. At start the file must be valid (the start fails naming it). Reads are
    bounded and never block.
    """

    def __init__(self, path: str, reload_seconds: float = 1.0, clock=time.monotonic):
        self.path = Path(path)
        self.reload_seconds = reload_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._tokens: dict[bytes, str] = {}
        self._signature = None
        self._checked = float("-inf")
        self.reloads = 0
        self.reload_errors = 0
        tokens, self._signature = self._read()  # the first read must succeed: a bad path fails the start
        self._tokens = tokens
        self._checked = self.clock()

    def _files(self) -> list[Path]:
        if self.path.is_dir():
            entries = [p for p in self.path.iterdir() if not p.name.startswith(".")]
            if len(entries) > MAX_TOKEN_FILES:
                raise ValueError(f"token folder {self.path} holds more than {MAX_TOKEN_FILES} files")
            # Kubernetes Secret mounts hold the real files in ..data/ behind symlinks; skip dotted entries.
            return sorted(p for p in self.path.iterdir() if not p.name.startswith(".") and p.is_file())
        return [self.path]

    def _stat_signature(self):
        files = self._files()
        sig = []
        for p in files:
            st = p.stat()
            sig.append((p.name, st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(sig)

    def _read(self):
        if not self.path.exists():
            raise ValueError(f"token file {self.path} does not exist")
        signature = self._stat_signature()
        tokens: dict[bytes, str] = {}
        if self.path.is_dir():
            for p in self._files():
                tenant = check_tenant_name(p.name, str(p))
                for line in _text(p).splitlines():
                    if line.strip():
                        tokens[_digest(line.strip())] = tenant
        else:
            for n, line in enumerate(_text(self.path).splitlines(), 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                tenant, sep, token = line.partition(":")
                if not sep or not token.strip():
                    raise ValueError(f"{self.path}:{n}: expected TENANT:TOKEN")
                tokens[_digest(token.strip())] = check_tenant_name(tenant.strip(), f"{self.path}:{n}")
        if any(len(t) == 0 for t in tokens):
            raise ValueError(f"{self.path}: empty token")
        if not tokens:
            raise ValueError(f"{self.path} holds no token")
        return tokens, signature

    def maybe_reload(self) -> None:
        now = self.clock()
        if now - self._checked < self.reload_seconds:
            return
        with self._lock:
            if now - self._checked < self.reload_seconds:
                return
            self._checked = now
            current = None
            try:
                current = self._stat_signature()
                if current == self._signature:
                    return
                tokens, signature = self._read()
            except (OSError, ValueError) as exc:
                # Fail closed: no token is accepted until the file is valid again. Logged once per change of
                # the files (or of the error), not on every check.
                why = str(exc) if not isinstance(exc, OSError) else f"{self.path}: {exc.strerror or exc}"
                changed = (current, why) != self._signature
                self._signature = (current, why)
                self._tokens = {}
                if changed:
                    self.reload_errors += 1
                    log.error("bearer tokens unusable, every call is refused until the file is fixed: %s", why)
                return
            self._tokens, self._signature = tokens, signature
            self.reloads += 1
            log.info("reloaded bearer tokens", extra={"path": str(self.path), "tenants": len(set(tokens.values()))})

    def tenant(self, token: str) -> str | None:
        self.maybe_reload()
        return self._tokens.get(_digest(token))


class Authenticator:
    """Decides the identity of one call from its metadata and its TLS peer."""

    def __init__(self, tokens: TokenStore | None, mtls: bool):
        self.tokens = tokens
        self.mtls = mtls

    @property
    def enabled(self) -> bool:
        return self.tokens is not None or self.mtls

    def authenticate_call(self, context) -> Identity | None:
        """The identity of a gRPC call (its metadata and TLS peer); None when it has no valid credential."""
        if not self.enabled:
            return ANONYMOUS
        token = None
        for key, value in context.invocation_metadata() or ():
            if key == AUTHORIZATION:
                token = value
                break
        names = (context.auth_context() or {}).get("x509_common_name") or [] if token is None and self.mtls else []
        return self.identify(token, names[0].decode("utf-8", "replace") if names else None)

    def identify(self, authorization: str | None, certificate_name: str | None = None) -> Identity | None:
        """The caller's identity; None when auth is on and it has no valid credential.

        A bearer token (`authorization: Bearer ...`), when present, must be valid and names the tenant; without
        one, the verified client certificate's common name does (mTLS).
        """
        if not self.enabled:
            return ANONYMOUS
        if authorization is not None:
            if self.tokens is None:
                return None
            scheme, _, credential = authorization.partition(" ")
            if scheme.lower() != "bearer" or not credential.strip():
                return None
            tenant = self.tokens.tenant(credential.strip())
            return Identity(tenant, "token") if tenant is not None else None
        if self.mtls and certificate_name is not None and TENANT_NAME.fullmatch(certificate_name):
            return Identity(certificate_name, "mtls")
        return None


class CertificateFiles:
    """The server's TLS files, re-read when they change (cert-manager rotates the Secret in place): grpc asks
    `fetch` on every new handshake; it answers a new configuration when a file changed, else None."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str, reload_seconds: float = 1.0):
        self.files = {"--tls-cert-file": cert_file, "--tls-key-file": key_file}
        if client_ca_file:
            self.files["--tls-client-ca-file"] = client_ca_file
        self.reload_seconds = reload_seconds
        self._lock = threading.Lock()
        self._checked = time.monotonic()
        self.reloads = 0
        self._signature = self._stat()
        self.initial = self._configuration()

    def _stat(self):
        sig = []
        for path in self.files.values():
            try:
                st = Path(path).stat()
                sig.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                sig.append(None)
        return tuple(sig)

    def _configuration(self):
        from promptcache.client.credentials import read_credential

        # bounded, and only regular files (a FIFO or /dev/zero is refused); CredentialError is a ValueError
        data = {flag: read_credential(path, flag) for flag, path in self.files.items()}
        self._check_pem()
        return grpc.ssl_server_certificate_configuration(
            [(data["--tls-key-file"], data["--tls-cert-file"])], root_certificates=data.get("--tls-client-ca-file"))

    def _check_pem(self) -> None:
        """Refuse files gRPC could not use, naming the file: gRPC itself would only fail to bind the port."""
        cert, key = self.files["--tls-cert-file"], self.files["--tls-key-file"]
        for flag in ("--tls-cert-file", "--tls-client-ca-file"):
            if flag in self.files:
                try:
                    ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=self.files[flag])
                except (ssl.SSLError, OSError, ValueError) as exc:
                    raise ValueError(f"{flag} {self.files[flag]} holds no PEM certificate") from None
        try:
            # A callable password: an encrypted key fails here instead of prompting on the terminal.
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
        except (ssl.SSLError, OSError, ValueError) as exc:
            if "KEY_VALUES_MISMATCH" in str(exc):
                raise ValueError(f"--tls-key-file {key} is not the private key of --tls-cert-file {cert}") from None
            raise ValueError(f"--tls-key-file {key} holds no unencrypted PEM private key") from None

    def fetch(self):
        now = time.monotonic()
        if now - self._checked < self.reload_seconds:
            return None
        with self._lock:
            self._checked = now
            signature = self._stat()
            if signature == self._signature:
                return None
            self._signature = signature
            try:
                config = self._configuration()
            except ValueError as exc:
                log.error("cannot reload the TLS certificate, keeping the previous one: %s", exc)
                return None
            self.reloads += 1
            log.info("reloaded the TLS certificate", extra={"path": self.files["--tls-cert-file"]})
            return config


def server_credentials(cert_file: str, key_file: str, client_ca_file: str,
                       reload_seconds: float = 1.0) -> grpc.ServerCredentials:
    """TLS credentials, reloaded when the files change; with a client CA, client certificates signed by it are
    required (mTLS)."""
    files = CertificateFiles(cert_file, key_file, client_ca_file, reload_seconds)
    return grpc.dynamic_ssl_server_credentials(files.initial, files.fetch,
                                               require_client_authentication=bool(client_ca_file))


def attach_identity(context, identity: Identity) -> None:
    setattr(context, _IDENTITY_ATTR, identity)

