"""Tenant isolation and authorization, attacked by a legitimate tenant or a caller with no credentials (an
adversarial audit). Real sidecars over loopback, real gRPC and bulk clients.

Content isolation (another tenant's chunks through Lookup, Get, Put, Delete, Purge, Stats, the bulk channel and
shared buffers) is covered by test_tenancy.py, test_shm_security.py and test_bulk.py; what is here are the ways
one caller could still take the sidecar away from the others."""
from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from support import CHUNK, SMALL
from promptcache.client import PromptCacheClient, errors
from promptcache.contract import bulkwire
from promptcache.contract.wire import model_to_proto
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.v1 import kvcache_pb2_grpc as pb_grpc
from test_auth import write_secret_dir

TENANTS = ("alice", "bob", "ops")


@pytest.fixture
def tokens(tmp_path):
    d = tmp_path / "tokens"
    write_secret_dir(d, {t: f"{t}-token" for t in TENANTS})
    return str(d)


def prefix(seed: int, chunks: int = 2) -> list[int]:
    return [seed * 100_000 + i for i in range(chunks * CHUNK)]


def served_within(client: PromptCacheClient, seconds: float) -> bool:
    """Whether a Lookup of this client is answered within `seconds`."""
    try:
        client.lookup(SMALL, prefix(1), timeout=seconds)
        return True
    except errors.DeadlineExceeded:
        return False


def test_health_watch_needs_credentials_so_no_one_without_them_holds_the_workers(sidecar_factory, tokens):
    """Health is exempt from authentication for probes, but Health/Watch is a stream that holds a gRPC worker
    thread until the client leaves, and the watchdog did not watch it: a caller with no credentials opened one per
    worker and every tenant's calls waited until their deadline, for as long as it liked. Now only Check (and
    List), which answer at once, are exempt; Watch needs credentials like every other method."""
    sidecar = sidecar_factory(token_file=tokens, workers=4)
    channel = grpc.insecure_channel(sidecar.address)  # no credentials at all
    health = health_pb2_grpc.HealthStub(channel)
    streams = [health.Watch(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(8)]
    try:
        codes = set()
        for s in streams:
            try:
                next(s)
                codes.add("answered")
            except grpc.RpcError as exc:
                codes.add(exc.code())
        assert codes == {grpc.StatusCode.UNAUTHENTICATED}
        # probes still need no credentials
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        with PromptCacheClient(sidecar.address, token="alice-token", retries=0) as alice:
            assert served_within(alice, 5)
    finally:
        for s in streams:
            s.cancel()
        channel.close()


def test_health_watch_streams_are_cut_by_the_stream_watchdog(sidecar_factory):
    """Without authentication too, a Watch stream is a stream like the others: idle past --stream-idle-seconds it
    is cut (DEADLINE_EXCEEDED) and its worker comes back. Before, Watch streams were never cut, so a handful held
    the server for good."""
    sidecar = sidecar_factory(workers=4, stream_idle_seconds=1.0)
    channel = grpc.insecure_channel(sidecar.address)
    health = health_pb2_grpc.HealthStub(channel)
    start = time.monotonic()
    streams = [health.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(8)]
    try:
        time.sleep(1.5)  # every worker is a Watch stream's by now
        with PromptCacheClient(sidecar.address, retries=0) as client:
            deadline = time.monotonic() + 10
            while not served_within(client, 2):
                assert time.monotonic() < deadline, "Watch streams still hold every worker"
        cut = 0
        for s in streams:
            with pytest.raises(grpc.RpcError) as info:
                list(s)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            cut += "--stream-idle-seconds" in info.value.details()  # the watchdog's, not the client's deadline
        assert cut == len(streams) and time.monotonic() - start < 20
    finally:
        for s in streams:
            s.cancel()
        channel.close()


def test_one_tenant_cannot_hold_every_grpc_worker_by_default(sidecar_factory, tokens):
    """Bob opens more Put streams than there are workers and sends only their headers; alice, another tenant,
    must still be served. She waited until --stream-idle-seconds cut bob's streams (30 s), and bob simply opened
    them again; now the last of the --workers are kept for tenants with none in flight (limits.WorkerShare)."""
    sidecar = sidecar_factory(token_file=tokens, workers=4)
    channel = grpc.insecure_channel(sidecar.address)
    stub = pb_grpc.KVCacheStub(channel)
    release = threading.Event()

    def stalled():
        yield pb.PutRequest(header=pb.PutHeader(model=model_to_proto(SMALL), tokens=prefix(2)))
        release.wait(30)

    calls = [stub.Put.future(stalled(), metadata=[("authorization", "Bearer bob-token")], timeout=30)
             for _ in range(8)]
    try:
        time.sleep(1.0)
        with PromptCacheClient(sidecar.address, token="alice-token", retries=0) as alice:
            assert served_within(alice, 3)
    finally:
        release.set()
        for c in calls:
            c.cancel()
        channel.close()


def test_one_tenant_cannot_take_every_large_request_slot(sidecar_factory, tokens, tmp_path):
    """Bob announces bulk frames of more than 64 KiB and never sends their bodies: each holds a large-request slot
    for --stream-idle-seconds, and he can open them again. Alice's large Lookup must still be served."""
    path = tmp_path / "bulk.sock"
    sidecar = sidecar_factory(token_file=tokens, bulk_address=f"unix:{path}", max_large_requests=4)
    held = []
    try:
        for _ in range(4):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(path))
            bulkwire.send(s, pb.BulkFrame(hello=pb.BulkHello(version=1, authorization="Bearer bob-token")))
            assert bulkwire.recv(s).status.code == 0
            s.sendall(struct.pack("<I", 100_000) + b"\x0a")  # a frame of 100,000 bytes; one byte of it
            held.append(s)
        time.sleep(0.5)
        with PromptCacheClient(sidecar.address, token="alice-token", retries=0) as alice:
            assert alice.lookup(SMALL, list(range(70_000))).cached_tokens == 0
    finally:
        for s in held:
            s.close()
