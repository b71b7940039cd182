"""Clients that open streams and stall must not starve the others: per-client call limits, a stream idle
timeout that cancels a stalled Put (releasing its reservation, storing nothing) and a maximum call duration that
cancels a Get whose reader stopped reading (releasing its lease)."""
from __future__ import annotations

import statistics
import threading
import time

import grpc
import pytest

from support import CHUNK, SMALL, make_kv
from promptcache.client import PromptCacheClient
from promptcache.client.client import encode_chunk
from promptcache.contract.keys import ModelSpec
from promptcache.contract.layout import chunk_nbytes
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.v1 import kvcache_pb2_grpc as pb_grpc
from promptcache.contract.wire import model_to_proto

NBYTES = chunk_nbytes(SMALL, CHUNK)
SHAPE = [SMALL.num_layers, 2, SMALL.num_kv_heads, CHUNK, SMALL.head_dim]
BIG = ModelSpec("test/big", "rev-1", "float32", num_layers=8, num_kv_heads=8, head_dim=64)  # 512 KiB chunks
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # each channel its own TCP connection (own peer)


def eventually(check, timeout: float = 5.0) -> bool:
    """The server finishes a cancelled call's clean-up on its own thread, after the client has seen the
    status: poll for the server-side state instead of racing it (seen failing on a loaded 2-core machine)."""
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def stalled_put(stub, release: threading.Event, metadata=None, tokens=None):
    """Start a Put that sends a header, a chunk frame and half its bytes, then waits for `release`."""
    tokens = tokens or list(range(2 * CHUNK))
    blob = encode_chunk(SMALL, make_kv(SMALL, CHUNK), 0, CHUNK).numpy().tobytes()

    def frames():
        yield pb.PutRequest(header=pb.PutHeader(model=model_to_proto(SMALL), tokens=tokens))
        yield pb.PutRequest(chunk=pb.ChunkBegin(index=0, nbytes=NBYTES, shape=SHAPE, dtype=pb.DTYPE_FLOAT32))
        yield pb.PutRequest(data=blob[: NBYTES // 2])
        release.wait(60)

    return stub.Put.future(frames(), timeout=60, metadata=metadata)


def test_stalled_put_is_cancelled_and_releases_its_reservation(sidecar_factory):
    sidecar = sidecar_factory(stream_idle_seconds=0.5)
    release = threading.Event()
    try:
        with grpc.insecure_channel(sidecar.address) as ch:
            t0 = time.monotonic()
            fut = stalled_put(pb_grpc.KVCacheStub(ch), release)
            with pytest.raises(grpc.RpcError) as info:
                fut.result(timeout=10)
            elapsed = time.monotonic() - t0
    finally:
        release.set()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
    assert "--stream-idle-seconds" in info.value.details()
    assert 0.4 < elapsed < 3.0
    eventually(lambda: sidecar.tier.usage()["reserved"] == 0)
    assert sidecar.tier.usage() == {"entries": 0, "used": 0, "reserved": 0, "draining": 0,
                                    "budget": sidecar.tier.budget}


def test_stalled_clients_do_not_starve_others(sidecar_factory):
    """Twelve stalled Puts from one client (a connection) against a sidecar with 8 workers: at most 2 hold a
    worker (--max-calls-per-client), the rest are refused at once with RESOURCE_EXHAUSTED, and eight other
    clients keep being served the whole time, none waiting for a stalled stream; the stalled ones are cut after the
    idle limit."""
    sidecar = sidecar_factory(workers=8, max_calls_per_client=2, stream_idle_seconds=5)
    release = threading.Event()
    staller = grpc.insecure_channel(sidecar.address, options=OWN_CONNECTION)
    stub = pb_grpc.KVCacheStub(staller)
    try:
        futures = [stalled_put(stub, release) for _ in range(12)]
        time.sleep(0.3)
        refused = [f for f in futures if f.done()]
        assert len(refused) >= 10
        assert all(f.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED for f in refused)
        assert "--max-calls-per-client" in refused[0].exception().details()

        latencies, failures, rounds = [], [], [0] * 8

        def worker(seed):
            ch = grpc.insecure_channel(sidecar.address, options=OWN_CONNECTION)
            with PromptCacheClient(sidecar.address, channel=ch, retries=0, timeout=5) as c:
                tokens = [seed * 10_000 + i for i in range(2 * CHUNK)]
                kv = make_kv(SMALL, len(tokens), seed=seed)
                end = time.monotonic() + 2.0
                while time.monotonic() < end:
                    t0 = time.perf_counter()
                    try:
                        c.put(SMALL, tokens, kv)
                        assert c.lookup(SMALL, tokens).cached_tokens == 2 * CHUNK
                        c.get_blobs(SMALL, tokens)
                    except Exception as exc:  # noqa: BLE001
                        failures.append(exc)
                    latencies.append(time.perf_counter() - t0)
                    rounds[seed] += 1

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures, failures[:3]
        # Every client kept going, and none waited for a stalled stream to be cut (5 s): nobody was starved.
        assert min(rounds) >= 2 and max(latencies) < 4.0, (rounds, max(latencies), statistics.median(latencies))
        # The two admitted stalled streams are cancelled by the idle limit, not left holding workers forever.
        for f in futures:
            with pytest.raises(grpc.RpcError):
                f.result(timeout=10)
        assert sum(f.exception().code() == grpc.StatusCode.DEADLINE_EXCEEDED for f in futures) == 2
    finally:
        release.set()
        staller.close()
    assert eventually(lambda: sidecar.tier.usage()["reserved"] == 0), sidecar.tier.usage()


def test_per_tenant_limit_with_tokens(sidecar_factory, tmp_path):
    from test_auth import write_secret_dir

    d = tmp_path / "tokens"
    write_secret_dir(d, {"mallory": "m-token", "alice": "a-token"})
    sidecar = sidecar_factory(token_file=str(d), max_calls_per_client=1, stream_idle_seconds=2)
    release = threading.Event()
    try:
        # Separate connections do not help a tenant: the limit follows the credential.
        chans = [grpc.insecure_channel(sidecar.address, options=OWN_CONNECTION) for _ in range(3)]
        md = [("authorization", "Bearer m-token")]
        futures = [stalled_put(pb_grpc.KVCacheStub(ch), release, md) for ch in chans]
        time.sleep(0.3)
        assert sum(f.done() and f.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                   for f in futures) == 2
        with PromptCacheClient(sidecar.address, token="a-token", retries=0) as alice:
            tokens = list(range(2 * CHUNK))
            assert alice.put(SMALL, tokens, make_kv(SMALL, len(tokens))).stored_chunks == 2
    finally:
        release.set()
        for ch in chans:
            ch.close()


@pytest.mark.parametrize("limit", ["--stream-idle-seconds", "--max-call-seconds"])
def test_get_whose_reader_stalls_is_cancelled_and_releases_its_lease(sidecar_factory, limit):
    setting = {"--stream-idle-seconds": dict(stream_idle_seconds=1.5),
               "--max-call-seconds": dict(max_call_seconds=1.5, stream_idle_seconds=0)}[limit]
    sidecar = sidecar_factory(memory_bytes=64 << 20, **setting)
    chunks = 48  # 24 MiB: far more than the transport buffers for a reader that does not read
    tokens = list(range(chunks * CHUNK))
    with PromptCacheClient(sidecar.address, timeout=30) as c:
        blobs = {i: encode_chunk(BIG, make_kv(BIG, CHUNK, seed=i), 0, CHUNK) for i in range(chunks)}
        assert c.put_blobs(BIG, tokens, blobs).stored_chunks == chunks
        with grpc.insecure_channel(sidecar.address, options=OWN_CONNECTION) as ch:
            stream = pb_grpc.KVCacheStub(ch).Get(pb.GetRequest(model=model_to_proto(BIG), tokens=tokens),
                                                 timeout=60)
            next(stream)  # the first frame arrives; then the reader stops
            time.sleep(0.5)  # until the server blocks on flow control, mid-chunk, holding its lease
            # While the reader stalls, shrink below its leased chunk: Resize evicts everything, then waits until
            # the watchdog cancels the reader and its lease is let go.
            shrunk = c.resize(4096)
            assert shrunk.waited_milliseconds >= 500 and shrunk.committed_bytes <= 4096
            assert sidecar.tier.usage()["draining"] == 0
            with pytest.raises(grpc.RpcError) as info:
                for _ in stream:
                    pass
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert limit in info.value.details()
        assert eventually(lambda: sidecar.tier.usage()["draining"] == 0)
        assert c.lookup(SMALL, list(range(2 * CHUNK))).cached_tokens == 0  # still serving


def test_cancellations_are_counted(sidecar_factory):
    sidecar = sidecar_factory(stream_idle_seconds=0.3)
    release = threading.Event()
    try:
        with grpc.insecure_channel(sidecar.address) as ch, pytest.raises(grpc.RpcError):
            stalled_put(pb_grpc.KVCacheStub(ch), release).result(timeout=10)
    finally:
        release.set()
    from prometheus_client import generate_latest

    def text():
        return generate_latest(sidecar.metrics.registry).decode()

    assert eventually(lambda: 'promptcache_requests_total{code="DEADLINE_EXCEEDED",rpc="Put"} 1.0' in text()), text()
    assert 'promptcache_calls_cancelled_total{limit="idle",rpc="Put"} 1.0' in text()
