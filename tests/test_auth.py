"""Authentication: bearer tokens from a mounted file (reloaded when it changes), mTLS with the tenant taken from
the client certificate, unauthenticated calls rejected, plaintext only on loopback unless explicitly allowed."""
from __future__ import annotations

import dataclasses
import os
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from support import CHUNK, SMALL, SidecarProcess, make_kv
from promptcache.client import PromptCacheClient, errors
from promptcache.client.credentials import client_channel
from promptcache.sidecar.auth import TokenStore
from promptcache.sidecar.config import Settings
from promptcache.sidecar.app import Sidecar
from test_auth_pki import make_pki

TOKENS = list(range(2 * CHUNK))


def write_secret_dir(path, tokens: dict[str, str]):
    """Like a mounted Kubernetes Secret: files are symlinks into a ..data folder swapped atomically."""
    path.mkdir(exist_ok=True)
    stamp = f"..{time.monotonic_ns()}"
    (path / stamp).mkdir()
    for tenant, token in tokens.items():
        (path / stamp / tenant).write_text(token + "\n")
    tmp = path / "..data_tmp"
    os.symlink(stamp, tmp)
    os.replace(tmp, path / "..data")
    for tenant in tokens:
        link = path / tenant
        if not link.is_symlink():
            os.symlink(f"..data/{tenant}", link)
    for stale in path.iterdir():
        if not stale.name.startswith(".") and stale.name not in tokens:
            stale.unlink()


@pytest.fixture
def token_dir(tmp_path):
    d = tmp_path / "tokens"
    write_secret_dir(d, {"alice": "alice-token-1", "bob": "bob-token-1"})
    return d


def test_calls_without_a_valid_token_are_unauthenticated(sidecar_factory, token_dir):
    sidecar = sidecar_factory(token_file=str(token_dir))
    for kwargs in ({}, {"token": "wrong"}, {"token": ""}):
        with PromptCacheClient(sidecar.address, retries=0, **kwargs) as c:
            with pytest.raises(errors.Unauthenticated):
                c.lookup(SMALL, TOKENS)
            with pytest.raises(errors.Unauthenticated):
                c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
            with pytest.raises(errors.Unauthenticated):
                c.get_blobs(SMALL, TOKENS)
            with pytest.raises(errors.Unauthenticated):
                c.stats()
    # A malformed authorization header is no credential either.
    with grpc.insecure_channel(sidecar.address) as ch:
        from promptcache.v1 import kvcache_pb2 as pb, kvcache_pb2_grpc as pb_grpc

        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.KVCacheStub(ch).Stats(pb.StatsRequest(), metadata=[("authorization", "Basic YWxpY2U=")],
                                          timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health answers without credentials (Kubernetes probes carry none); reflection does not.
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with PromptCacheClient(sidecar.address, token="alice-token-1") as c:
        assert c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS))).stored_chunks == 2
        assert c.lookup(SMALL, TOKENS).cached_tokens == 2 * CHUNK
    assert _count(sidecar, "UNAUTHENTICATED") >= 13


def _count(sidecar, code):
    return sum(s.value for m in sidecar.metrics.requests.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels.get("code") == code)


def test_tokens_are_reloaded_when_the_secret_changes(sidecar_factory, token_dir, tmp_path):
    sidecar = sidecar_factory(token_file=str(token_dir), token_reload_seconds=0.05)
    old = PromptCacheClient(sidecar.address, retries=0, token="alice-token-1")
    new = PromptCacheClient(sidecar.address, retries=0, token="alice-token-2")
    try:
        old.stats()
        with pytest.raises(errors.Unauthenticated):
            new.stats()
        write_secret_dir(token_dir, {"alice": "alice-token-2"})  # rotated; bob removed
        deadline = time.monotonic() + 10
        while True:
            try:
                new.stats()
                break
            except errors.Unauthenticated:
                assert time.monotonic() < deadline, "the rotated token was never accepted"
                time.sleep(0.05)
        with pytest.raises(errors.Unauthenticated):
            old.stats()
        with PromptCacheClient(sidecar.address, retries=0, token="bob-token-1") as bob, \
                pytest.raises(errors.Unauthenticated):
            bob.stats()
    finally:
        old.close()
        new.close()


def test_token_file_of_lines_and_a_client_token_file_that_rotates(tmp_path):
    path = tmp_path / "tokens.txt"
    path.write_text("# tenants\nalice: a-1\n\nbob:b-1\n")
    store = TokenStore(str(path), reload_seconds=0)
    assert (store.tenant("a-1"), store.tenant("b-1"), store.tenant("a-")) == ("alice", "bob", None)
    path.write_text("this line is malformed\n")
    store.maybe_reload()
    assert store.tenant("a-1") is None and store.reload_errors == 1  # fail closed: a bad file accepts nothing
    path.write_text("alice:a-2\n")
    os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    assert store.tenant("a-2") == "alice" and store.tenant("a-1") is None
    with pytest.raises(ValueError, match="does not exist"):
        TokenStore(str(tmp_path / "missing"))
    bad = tmp_path / "bad.txt"
    bad.write_text("not a tenant!:x\n")
    with pytest.raises(ValueError, match="tenant name"):
        TokenStore(str(bad))


def test_client_token_file_is_reread(sidecar_factory, token_dir, tmp_path):
    sidecar = sidecar_factory(token_file=str(token_dir), token_reload_seconds=0.05)
    mine = tmp_path / "my-token"
    mine.write_text("alice-token-1\n")
    with PromptCacheClient(sidecar.address, retries=0, token_file=str(mine)) as c:
        c.stats()
        mine.write_text("nope-nope\n")
        os.utime(mine, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
        with pytest.raises(errors.Unauthenticated):
            c.stats()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_mtls_tenant_from_client_certificate(sidecar_factory, pki):
    sidecar = sidecar_factory(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                              tls_client_ca_file=pki.ca_file)
    a_cert, a_key = pki.client("alice")
    b_cert, b_key = pki.client("bob")
    kv = make_kv(SMALL, len(TOKENS))
    with PromptCacheClient(sidecar.address, tls_ca=pki.ca_file, tls_cert=a_cert, tls_key=a_key) as alice, \
            PromptCacheClient(sidecar.address, tls_ca=pki.ca_file, tls_cert=b_cert, tls_key=b_key) as bob:
        assert alice.put(SMALL, TOKENS, kv).stored_chunks == 2
        assert alice.lookup(SMALL, TOKENS).cached_tokens == 2 * CHUNK
        assert bob.lookup(SMALL, TOKENS).cached_tokens == 0  # tenants come from the certificates
        cached, got = alice.get(SMALL, TOKENS)
        assert cached == 2 * CHUNK and all((g[0] == k[0]).all() for g, k in zip(got, kv))
    # No client certificate, a certificate from an untrusted CA, or plaintext: the handshake fails.
    r_cert, r_key = pki.client("alice", rogue=True)
    for kwargs in (dict(tls_ca=pki.ca_file), dict(tls_ca=pki.ca_file, tls_cert=r_cert, tls_key=r_key), {}):
        with PromptCacheClient(sidecar.address, retries=0, timeout=3, **kwargs) as c:
            with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
                c.lookup(SMALL, TOKENS)


def test_tls_with_tokens(sidecar_factory, pki, token_dir):
    sidecar = sidecar_factory(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                              token_file=str(token_dir))
    with PromptCacheClient(sidecar.address, tls_ca=pki.ca_file, token="bob-token-1") as bob:
        assert bob.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS))).stored_chunks == 2
    with PromptCacheClient(sidecar.address, tls_ca=pki.ca_file, retries=0) as anonymous:
        with pytest.raises(errors.Unauthenticated):
            anonymous.lookup(SMALL, TOKENS)
    # A client that does not trust the server's CA refuses to talk to it.
    with PromptCacheClient(sidecar.address, tls_ca=pki.rogue.pem, token="bob-token-1", retries=0,
                           timeout=3) as c, pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
        c.lookup(SMALL, TOKENS)


def test_plaintext_only_on_loopback_unless_allowed(pki):
    base = Settings(metrics_port=0, chunk_tokens=CHUNK, memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="--allow-insecure-remote"):
        Sidecar(dataclasses.replace(base, grpc_address="0.0.0.0:0"))
    with pytest.raises(ValueError, match="go together"):
        Sidecar(dataclasses.replace(base, grpc_address="127.0.0.1:0", tls_cert_file=pki.server_cert))
    with pytest.raises(ValueError, match="mTLS"):
        Sidecar(dataclasses.replace(base, grpc_address="127.0.0.1:0", tls_client_ca_file=pki.ca_file))
    with pytest.raises(ValueError, match="--tls-key-file /nonexistent/key.pem: No such file"):
        Sidecar(dataclasses.replace(base, grpc_address="127.0.0.1:0", tls_cert_file=pki.server_cert,
                                    tls_key_file="/nonexistent/key.pem"))
    # With TLS, a non-loopback address needs no extra flag (constructed, never started: no traffic).
    s = Sidecar(dataclasses.replace(base, grpc_address="0.0.0.0:0", tls_cert_file=pki.server_cert,
                                    tls_key_file=pki.server_key))
    s.stop(0)


@pytest.mark.slow  # sidecar processes; the tests above cover the same authentication in process
def test_cli_flags_and_environment(tmp_path, token_dir, pki):
    proc = SidecarProcess("--memory-bytes", "4Mi", "--chunk-tokens", str(CHUNK), "--tls-cert-file", pki.server_cert,
                          "--tls-key-file", pki.server_key,
                          env={"PROMPTCACHE_TOKEN_FILE": str(token_dir), "PROMPTCACHE_LOG_FORMAT": "text"})
    try:
        deadline = time.monotonic() + 60
        with client_channel(proc.address, root_certificates=pki.ca_file) as ch:
            while True:
                try:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                    break
                except grpc.RpcError:
                    assert proc.proc.poll() is None and time.monotonic() < deadline
                    time.sleep(0.2)
        with PromptCacheClient(proc.address, tls_ca=pki.ca_file, token="alice-token-1") as c:
            assert c.stats().chunk_tokens == CHUNK
        with PromptCacheClient(proc.address, tls_ca=pki.ca_file, retries=0) as c, \
                pytest.raises(errors.Unauthenticated):
            c.stats()
    finally:
        proc.stop()
    bad = SidecarProcess("--token-file", str(tmp_path / "missing"))
    assert bad.proc.wait(30) == 2
    assert "token file" in bad.proc.stdout.read()


def test_server_certificate_is_reloaded_when_rotated(sidecar_factory, tmp_path):
    from test_auth_pki import CA

    pki = make_pki(tmp_path / "pki")
    sidecar = sidecar_factory(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                              token_reload_seconds=0.05)
    new_ca = CA.create("rotated CA")
    with PromptCacheClient(sidecar.address, tls_ca=pki.ca_file, retries=0, timeout=3) as c:
        c.stats()
    cert, key = new_ca.issue("promptcache-sidecar", server=True)
    (tmp_path / "pki" / "server.key.new").write_bytes(key)
    (tmp_path / "pki" / "server.pem.new").write_bytes(cert)
    os.replace(tmp_path / "pki" / "server.key.new", pki.server_key)
    os.replace(tmp_path / "pki" / "server.pem.new", pki.server_cert)
    time.sleep(0.2)
    deadline = time.monotonic() + 10
    while True:  # new connections get the rotated certificate
        with PromptCacheClient(sidecar.address, tls_ca=new_ca.pem, retries=0, timeout=3) as c:
            try:
                c.stats()
                break
            except (errors.Unavailable, errors.DeadlineExceeded):
                assert time.monotonic() < deadline, "the rotated certificate was never served"
                time.sleep(0.1)
    with PromptCacheClient(sidecar.address, tls_ca=pki.ca_file, retries=0, timeout=3) as c, \
            pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
        c.stats()


@pytest.mark.parametrize("layout", ["file", "folder"])
def test_token_file_fails_closed_when_emptied_deleted_or_garbage(sidecar_factory, tmp_path, layout, caplog):
    """Issue 27 #7: an emptied token file revoked every tenant while a deleted or garbage one kept the old
    tokens. One rule now (docs/security.md, "Token file semantics"): the tokens accepted are exactly what the
    file says; emptied, deleted, unreadable or malformed, no token is accepted until it is valid again."""
    path = tmp_path / ("tokens.txt" if layout == "file" else "tokens")

    def valid():
        if layout == "file":
            path.write_text("alice:alice-token-1\n")
        else:
            write_secret_dir(path, {"alice": "alice-token-1"})

    def bump():
        t = time.time_ns() + 10**9 * (1 + bump.n)
        bump.n += 1
        for p in ([path] if layout == "file" else [path, path / "..data"]):
            if p.exists():
                os.utime(p, ns=(t, t), follow_symlinks=False)
    bump.n = 0

    def emptied():
        if layout == "file":
            path.write_text("")
        else:
            write_secret_dir(path, {"alice": ""})

    def deleted():
        if layout == "file":
            path.unlink()
        else:
            import shutil
            shutil.rmtree(path)

    def garbage():
        if layout == "file":
            path.write_text("no colon here\n")
        else:
            write_secret_dir(path, {"not a tenant!": "x"})

    valid()
    sidecar = sidecar_factory(token_file=str(path), token_reload_seconds=0.05)
    with PromptCacheClient(sidecar.address, retries=0, token="alice-token-1") as c:
        def accepted() -> bool:
            try:
                c.stats()
                return True
            except errors.Unauthenticated:
                return False

        def settle(want: bool, what: str):
            deadline = time.monotonic() + 10
            while accepted() != want:
                assert time.monotonic() < deadline, f"token file {what}: still {'refused' if want else 'accepted'}"
                time.sleep(0.05)

        assert accepted()
        for what, change in (("emptied", emptied), ("deleted", deleted), ("garbage", garbage)):
            change()
            bump()
            settle(False, what)
            time.sleep(0.3)  # and it stays refused (no later reload brings the old tokens back)
            assert not accepted(), what
            valid()
            bump()
            settle(True, f"restored after {what}")
    assert sidecar.authenticator.tokens.reload_errors >= 3


def test_a_tenant_name_with_a_trailing_newline_is_not_a_tenant_name():
    """`$` also matches before a final newline: "alice\\n" passed the tenant-name check (a certificate's common
    name, a configured tenant), a second tenant whose name prints as alice's. Whole-string match now."""
    from promptcache.sidecar.identity import check_tenant_name

    assert check_tenant_name("alice", "t") == "alice"
    for bad in ("alice\n", "alice\r\n", "\nalice"):
        with pytest.raises(ValueError, match="tenant name"):
            check_tenant_name(bad, "t")
    from promptcache.sidecar.auth import Authenticator

    mtls = Authenticator(None, mtls=True)
    assert mtls.identify(None, "alice").tenant == "alice"
    assert mtls.identify(None, "alice\n") is None
