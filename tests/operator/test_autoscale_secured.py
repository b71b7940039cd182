"""The autoscaler's Resize against a sidecar with TLS and bearer tokens or mTLS (real gRPC on loopback): the
operator's identity (a credentials folder as the chart mounts it) is verified, authenticated and must be an admin
tenant; without it, or with the wrong CA or a tenant that is not admin, Resize fails and nothing changes."""
from __future__ import annotations

import pytest

from promptcache.operator import autoscale, builders
from promptcache.operator.builders import OperatorDefaults
from promptcache.operator.model import PromptCacheSpec
from test_auth import write_secret_dir
from test_auth_pki import make_pki

SERVICE = "llama.inference.svc"   # the cache's Service name, what the autoscaler verifies the certificate for
OPERATOR = OperatorDefaults().operator_tenant


@pytest.fixture
def secured(sidecar_factory, tmp_path):
    """A sidecar serving TLS (certificate for the Service name), tokens for a workload and the operator, the
    operator an admin tenant (as builders.sidecar_env sets it), and mTLS off."""
    pki = make_pki(tmp_path / "pki")
    cert, key = pki.ca.issue("promptcache-sidecar", server=True, dns_names=(SERVICE,))
    (tmp_path / "server.pem").write_bytes(cert)
    (tmp_path / "server.key").write_bytes(key)
    write_secret_dir(tmp_path / "tokens", {"workload": "workload-token", OPERATOR: "operator-token"})
    sidecar = sidecar_factory(tls_cert_file=str(tmp_path / "server.pem"), tls_key_file=str(tmp_path / "server.key"),
                              token_file=str(tmp_path / "tokens"), admin_tenants=OPERATOR)
    return sidecar, pki


def credentials(directory, **files: bytes | str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name.replace("_", ".")).write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(directory)


def resize(sidecar, budget: int, creds: str | None, server_name: str = SERVICE) -> dict:
    return autoscale.grpc_resize(sidecar.address, budget, 5.0, tls=True, server_name=server_name,
                                 credentials_dir=creds)


def test_resize_with_the_operators_identity(secured, tmp_path):
    sidecar, pki = secured
    creds = credentials(tmp_path / "creds", token="operator-token\n", ca_crt=pki.ca.pem)
    r = resize(sidecar, 6 << 20, creds)
    assert r["memory_bytes"] == 6 << 20 and sidecar.tier.usage()["budget"] == 6 << 20


@pytest.mark.parametrize("case", ["no credentials", "no token", "wrong CA", "not an admin", "wrong server name"])
def test_resize_is_refused_without_the_right_identity(secured, tmp_path, case):
    sidecar, pki = secured
    files = {"token": "operator-token", "ca_crt": pki.ca.pem}
    server_name = SERVICE
    if case == "no token":
        del files["token"]
    elif case == "wrong CA":
        files["ca_crt"] = pki.rogue.pem
    elif case == "not an admin":
        files["token"] = "workload-token"
    elif case == "wrong server name":
        server_name = "other.inference.svc"
    creds = None if case == "no credentials" else credentials(tmp_path / "creds", **files)
    with pytest.raises(autoscale.ResizeError) as exc:
        resize(sidecar, 6 << 20, creds, server_name)
    want = {"no token": "UNAUTHENTICATED", "not an admin": "PERMISSION_DENIED"}.get(case, "UNAVAILABLE")
    assert want in str(exc.value)
    assert sidecar.tier.usage()["budget"] == 8 << 20  # unchanged


def test_resize_with_a_client_certificate(sidecar_factory, tmp_path):
    """mTLS: the operator's certificate's common name is its tenant."""
    pki = make_pki(tmp_path / "pki")
    cert, key = pki.ca.issue("promptcache-sidecar", server=True, dns_names=(SERVICE,))
    (tmp_path / "server.pem").write_bytes(cert)
    (tmp_path / "server.key").write_bytes(key)
    sidecar = sidecar_factory(tls_cert_file=str(tmp_path / "server.pem"), tls_key_file=str(tmp_path / "server.key"),
                              tls_client_ca_file=pki.ca_file, admin_tenants=OPERATOR)
    op_cert, op_key = pki.client(OPERATOR)
    creds = credentials(tmp_path / "creds", ca_crt=pki.ca.pem, tls_crt=op_cert, tls_key=op_key)
    assert resize(sidecar, 4 << 20, creds)["memory_bytes"] == 4 << 20
    other_cert, other_key = pki.client("some-tenant")
    creds = credentials(tmp_path / "other", ca_crt=pki.ca.pem, tls_crt=other_cert, tls_key=other_key)
    with pytest.raises(autoscale.ResizeError, match="PERMISSION_DENIED"):
        resize(sidecar, 6 << 20, creds)


def test_caches_that_authenticate_make_the_operator_an_admin_tenant():
    base = {"model": {"name": "m", "revision": "r"}, "memory": {"host": "4Gi"}, "autoscaling": {"enabled": True}}
    tokens = PromptCacheSpec.from_dict({**base, "security": {"tokens": {"secretName": "t"}}})
    assert builders.sidecar_env(tokens)["PROMPTCACHE_ADMIN_TENANTS"] == OPERATOR
    mtls = PromptCacheSpec.from_dict({**base, "security": {"tls": {"secretName": "c", "mutual": True}}})
    assert builders.sidecar_env(mtls, OperatorDefaults(operator_tenant="ops"))["PROMPTCACHE_ADMIN_TENANTS"] == "ops"
    for spec in (PromptCacheSpec.from_dict(base),   # no authentication: every caller may Resize
                 PromptCacheSpec.from_dict({**base, "security": {"tls": {"secretName": "c"}}}),  # TLS alone
                 PromptCacheSpec.from_dict({**base, "autoscaling": {"enabled": False},
                                            "security": {"tokens": {"secretName": "t"}}})):
        assert "PROMPTCACHE_ADMIN_TENANTS" not in builders.sidecar_env(spec)


def test_credentials_folder_from_the_chart_environment():
    env = {"PROMPTCACHE_OPERATOR_SIDECAR_CREDENTIALS_DIR": "/etc/promptcache-operator/sidecar-credentials"}
    assert autoscale.Config.from_env(env).credentials_dir == "/etc/promptcache-operator/sidecar-credentials"
    assert autoscale.Config.from_env({}).credentials_dir is None


def _recording_server():
    """A plaintext gRPC server on loopback answering Resize and recording each call's metadata."""
    from concurrent import futures

    import grpc
    from promptcache.v1 import kvcache_pb2 as pb
    seen: list[dict] = []

    def handle(req, ctx):
        seen.append(dict(ctx.invocation_metadata()))
        return pb.ResizeResponse(previous_bytes=1, memory_bytes=req.memory_bytes)
    handler = grpc.method_handlers_generic_handler("promptcache.v1.KVCache", {
        "Resize": grpc.unary_unary_rpc_method_handler(handle, request_deserializer=pb.ResizeRequest.FromString,
                                                      response_serializer=pb.ResizeResponse.SerializeToString)})
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    srv.add_generic_rpc_handlers((handler,))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    return srv, f"127.0.0.1:{port}", seen


@pytest.mark.parametrize("send", [True, False])
def test_the_token_is_never_sent_in_plaintext(tmp_path, send):
    """Whatever answers on a pod's port (a tenant's image: spec.image) never receives the operator's token over
    plaintext gRPC (audit: token leak)."""
    srv, target, seen = _recording_server()
    try:
        creds = credentials(tmp_path / "creds", token="OPERATOR-TOKEN\n")
        autoscale.grpc_resize(target, 1 << 30, 5.0, tls=False, server_name=SERVICE, credentials_dir=creds,
                              send_credentials=send)
    finally:
        srv.stop(0)
    assert len(seen) == 1 and "authorization" not in seen[0]


def test_resize_without_credentials_where_the_policy_says_so(secured, tmp_path):
    """send_credentials=False (credentials_policy): no token, so a sidecar that authenticates refuses it."""
    sidecar, pki = secured
    creds = credentials(tmp_path / "creds", token="operator-token", ca_crt=pki.ca.pem)
    with pytest.raises(autoscale.ResizeError, match="UNAUTHENTICATED"):
        autoscale.grpc_resize(sidecar.address, 1 << 30, 5.0, tls=True, server_name=SERVICE, credentials_dir=creds,
                              send_credentials=False)
