"""Resource limits against hostile or careless clients (issue 17, items 4, 5 and 8), each with the attack as it
was found, scaled down: real gRPC clients and raw sockets on loopback against a real sidecar.

* Slow Puts: streams that announce a chunk and trickle a byte now and then hold their reservations; the minimum
  rate cancels them, and one tenant may hold only part of the budget reserved.
* The bulk channel: connections that never send a hello cannot lock out a client with a token.
* Memory per request: requests of millions of tokens are refused before their bytes are read, and concurrent
  large ones are bounded, so the sidecar's RSS stays bounded.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import psutil
import pytest

from promptcache.contract import bulkwire
from promptcache.client import PromptCacheClient, errors
from promptcache.client.client import encode_chunk
from promptcache.contract.keys import ModelSpec
from promptcache.contract.layout import chunk_nbytes
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.v1 import kvcache_pb2_grpc as pb_grpc
from promptcache.contract.wire import model_to_proto
from support import CHUNK, SMALL, SidecarProcess, make_kv
from test_auth import write_secret_dir

MIB = 1 << 20
WIDE = ModelSpec("test/wide", "rev-1", "float32", num_layers=8, num_kv_heads=8, head_dim=128)  # 1 MiB chunks
WIDE_NBYTES = chunk_nbytes(WIDE, CHUNK)
WIDE_SHAPE = [WIDE.num_layers, 2, WIDE.num_kv_heads, CHUNK, WIDE.head_dim]
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # each channel its own connection (own peer)
assert WIDE_NBYTES == MIB


def eventually(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def trickling_put(address: str, seed: int, stop: threading.Event, metadata=None, every: float = 0.2):
    """A Put on its own connection that announces a 1 MiB chunk and then sends one byte every `every` seconds:
    each byte is progress, so the idle limit never fires. Returns (future, channel)."""
    channel = grpc.insecure_channel(address, options=OWN_CONNECTION)
    tokens = [seed * 1000 + i for i in range(CHUNK)]

    def frames():
        yield pb.PutRequest(header=pb.PutHeader(model=model_to_proto(WIDE), tokens=tokens))
        yield pb.PutRequest(chunk=pb.ChunkBegin(index=0, nbytes=WIDE_NBYTES, shape=WIDE_SHAPE,
                                                dtype=pb.DTYPE_FLOAT32))
        for _ in range(WIDE_NBYTES - 1):
            if stop.wait(every):
                return
            yield pb.PutRequest(data=b"\x00")

    return pb_grpc.KVCacheStub(channel).Put.future(frames(), timeout=60, metadata=metadata), channel


def honest_put(client: PromptCacheClient, seed: int, deadline: float) -> tuple[float, list[str]]:
    """Put one 1 MiB chunk, retrying RESOURCE_EXHAUSTED until `deadline`: (seconds until stored, refusals). A full
    cache's admission policy refuses a new prompt's first Put without an error (the default policy's chain-root
    doorkeeper, docs/eviction.md): that counts as a refusal too, and the next Put is admitted."""
    tokens = [900_000 + seed * 1000 + i for i in range(CHUNK)]
    blob = encode_chunk(WIDE, make_kv(WIDE, CHUNK, seed=seed), 0, CHUNK)
    t0 = time.monotonic()
    refusals = []
    while time.monotonic() < deadline:
        try:
            result = client.put_blobs(WIDE, tokens, {0: blob})
            if result.stored_chunks == 1:
                return time.monotonic() - t0, refusals
            assert result.rejected_chunks == 1, result
            refusals.append("refused by the admission policy")
        except errors.PromptCacheError as exc:
            refusals.append(str(exc))
            time.sleep(0.1)
    raise AssertionError(f"the honest Put was refused until the deadline: {refusals[-3:]}")


def test_reserved_bytes_allow_one_chunk_then_the_share():
    from promptcache.sidecar.limits import ReservedBytes

    held = ReservedBytes()
    assert held.hold("a", 10, limit=5)  # one chunk is always allowed, whatever its size
    assert not held.hold("a", 1, limit=5)
    assert held.hold("b", 3, limit=5) and held.hold("b", 2, limit=5) and not held.hold("b", 1, limit=5)
    held.release("a", 10)
    assert held.held("a") == 0 and held.hold("a", 4, limit=5) and held.held("a") == 4


def test_trickling_puts_are_cut_off_and_an_honest_writer_gets_in(sidecar_factory):
    """Four Puts from four connections that together reserve the whole budget and then send a byte every 0.2 s
    (the issue's attack, 16 MiB chunks of a 64 MiB budget, scaled to 1 MiB of 4 MiB): the minimum rate cancels
    them within about one window, their reservations are released, and an honest writer's Put succeeds."""
    sidecar = sidecar_factory(memory_bytes=4 * MIB, max_chunk_bytes=2 * MIB, stream_idle_seconds=30,
                              min_put_bytes_per_second=64 << 10, put_rate_window_seconds=1.0)
    stop = threading.Event()
    streams = [trickling_put(sidecar.address, seed, stop) for seed in range(4)]
    try:
        # The attack holds the whole budget.
        assert eventually(lambda: sidecar.tier.usage()["reserved"] == 4 * MIB), sidecar.tier.usage()
        with PromptCacheClient(sidecar.address, retries=0, timeout=10) as honest:
            took, refusals = honest_put(honest, seed=7, deadline=time.monotonic() + 8)
        print(f"honest Put stored after {took:.2f} s, {len(refusals)} refusals")
        assert any("no room" in r for r in refusals), refusals  # it was locked out at first ...
        assert took < 4.0, took  # ... for about one window, not for --max-call-seconds
        for future, _ in streams:
            with pytest.raises(grpc.RpcError) as info:
                future.result(timeout=5)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "--min-put-bytes-per-second" in info.value.details()
            assert "reservation released" in info.value.details()
    finally:
        stop.set()
        for _, channel in streams:
            channel.close()
    usage = sidecar.tier.usage()
    assert usage["reserved"] == 0 and usage["entries"] == 1 and usage["used"] == MIB, usage
    from support import metric

    assert metric(sidecar, 'promptcache_calls_cancelled_total{limit="rate",rpc="Put"}') == 4


@pytest.mark.timing
def test_a_put_sending_at_the_minimum_rate_is_not_cut(sidecar_factory):
    """The other side of the minimum: a Put that keeps sending above it completes, however long it takes."""
    sidecar = sidecar_factory(memory_bytes=4 * MIB, max_chunk_bytes=2 * MIB,
                              min_put_bytes_per_second=256 << 10, put_rate_window_seconds=0.5)
    blob = encode_chunk(WIDE, make_kv(WIDE, CHUNK, seed=1), 0, CHUNK).numpy().tobytes()
    tokens = list(range(CHUNK))

    def frames():  # 1 MiB at about 512 KiB/s: two seconds, four windows
        yield pb.PutRequest(header=pb.PutHeader(model=model_to_proto(WIDE), tokens=tokens))
        yield pb.PutRequest(chunk=pb.ChunkBegin(index=0, nbytes=WIDE_NBYTES, shape=WIDE_SHAPE,
                                                dtype=pb.DTYPE_FLOAT32))
        step = 64 << 10
        for off in range(0, WIDE_NBYTES, step):
            time.sleep(step / (512 << 10))
            yield pb.PutRequest(data=blob[off:off + step])

    with grpc.insecure_channel(sidecar.address) as ch:
        assert pb_grpc.KVCacheStub(ch).Put(frames(), timeout=30).stored_chunks == 1


def test_one_tenant_may_hold_only_part_of_the_budget_reserved(sidecar_factory, tmp_path):
    """With authentication the limit follows the tenant, whatever connections it opens: mallory's four trickling
    Puts (on four connections) may hold half the budget reserved (--max-put-reserved-fraction 0.5), the other
    two are refused at once, and alice's Put is stored at once, never locked out (no minimum rate here, so only
    the reservation cap is at work)."""
    d = tmp_path / "tokens"
    write_secret_dir(d, {"mallory": "m-token", "alice": "a-token"})
    sidecar = sidecar_factory(token_file=str(d), memory_bytes=4 * MIB, max_chunk_bytes=2 * MIB,
                              min_put_bytes_per_second=0, max_put_reserved_fraction=0.5)
    stop = threading.Event()
    md = [("authorization", "Bearer m-token")]
    streams = []
    try:
        streams = [trickling_put(sidecar.address, seed, stop, md) for seed in range(4)]
        assert eventually(lambda: sum(f.done() for f, _ in streams) == 2), [f.done() for f, _ in streams]
        refused = [f for f, _ in streams if f.done()]
        for f in refused:
            assert f.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-put-reserved-fraction" in f.exception().details()
        assert sidecar.tier.usage()["reserved"] == 2 * MIB
        with PromptCacheClient(sidecar.address, token="a-token", retries=0, timeout=10) as alice:
            took, refusals = honest_put(alice, seed=7, deadline=time.monotonic() + 5)
        assert not refusals and took < 2.0, (took, refusals)
    finally:
        stop.set()
        for _, channel in streams:
            channel.close()


# --- the bulk channel: connections that never authenticate --------------------------------------------------

HOLDER = r"""
import json, socket, struct, sys, time
path, n, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    socks.append(s)
print("connected", flush=True)
time.sleep(hold)
outcome = {}
for s in socks:
    s.setblocking(False)
    try:
        head = s.recv(4)
    except BlockingIOError:
        outcome["open"] = outcome.get("open", 0) + 1
        continue
    if not head:
        outcome["closed"] = outcome.get("closed", 0) + 1
        continue
    s.setblocking(True)
    body = b""
    while len(body) < struct.unpack("<I", head)[0]:
        body += s.recv(65536)
    sys.path.insert(0, ".")
    from promptcache.v1 import kvcache_pb2 as pb
    status = pb.BulkFrame.FromString(body).status
    key = "%d %s" % (status.code, status.message.split("(")[-1].split(")")[0])
    outcome[key] = outcome.get(key, 0) + 1
print(json.dumps(outcome), flush=True)
"""


def hold_connections(path: str, n: int, hold: float) -> subprocess.Popen:
    """Another process (another peer) that opens `n` bulk connections, never sends a hello, and after `hold`
    seconds prints what became of them."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, path, str(n), str(hold)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "connected"
    return proc


def outcome_of(proc: subprocess.Popen) -> dict[str, int]:
    out, _ = proc.communicate(timeout=30)
    return json.loads(out.strip().splitlines()[-1])


def raw_bulk(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return s


def bulk_get(s: socket.socket, request: pb.GetRequest) -> tuple[int, pb.BulkStatus]:
    bulkwire.send(s, pb.BulkFrame(get=request))
    chunks = 0
    while True:
        frame = bulkwire.recv(s)
        if frame.WhichOneof("frame") == "status":
            return chunks, frame.status
        bulkwire.recv_into(s, bytearray(frame.chunk.nbytes))
        chunks += 1


def test_idle_bulk_connections_cannot_lock_out_a_client_with_a_token(sidecar_factory, tmp_path):
    """The issue's attack: 64 unix-socket connections that never send a hello take every slot. Now alice, with
    her token, still connects and is served (the oldest connection still waiting for its hello makes room), and
    the idle ones are closed after --bulk-hello-seconds."""
    d = tmp_path / "tokens"
    write_secret_dir(d, {"alice": "a-token"})
    path = f"{tmp_path}/bulk.sock"
    sidecar = sidecar_factory(token_file=str(d), bulk_address=f"unix:{path}", bulk_max_connections=64,
                              bulk_max_connections_per_peer=64, bulk_hello_seconds=3)
    tokens = list(range(3 * CHUNK))
    with PromptCacheClient(sidecar.address, token="a-token") as c:
        c.put(SMALL, tokens, make_kv(SMALL, len(tokens)))
    attacker = hold_connections(path, 64, hold=5.0)
    try:
        assert eventually(lambda: len(sidecar.bulk[0]._connections) == 64)  # every slot taken
        alice = raw_bulk(path)
        bulkwire.send(alice, pb.BulkFrame(hello=pb.BulkHello(version=1, authorization="Bearer a-token")))
        assert bulkwire.recv(alice).status.code == 0, "alice was refused while the attacker held the slots"
        chunks, status = bulk_get(alice, pb.GetRequest(model=model_to_proto(SMALL), tokens=tokens))
        assert (chunks, status.code) == (3, 0)
        outcome = outcome_of(attacker)
    finally:
        attacker.kill()
    # One made room for alice; every other one was closed once its hello was late. None is left open.
    assert outcome == {"8 --bulk-max-connections": 1, "4 --bulk-hello-seconds": 63}, outcome
    assert eventually(lambda: len(sidecar.bulk[0]._connections) == 1)  # alice's
    chunks, status = bulk_get(alice, pb.GetRequest(model=model_to_proto(SMALL), tokens=tokens))
    assert (chunks, status.code) == (3, 0)  # a connection past its hello stays however long it idles
    alice.close()


def test_one_tenant_cannot_hold_every_bulk_connection(sidecar_factory, tmp_path):
    """Bob, with a valid token, greets as many connections as the channel takes: he gets all but the last eighth
    (one of 8 here), refused RESOURCE_EXHAUSTED naming the limit, and alice, another tenant, still gets one. Before,
    bob held all 8 and alice's connection was refused (the channel full), pushing her onto gRPC."""
    d = tmp_path / "tokens"
    write_secret_dir(d, {"alice": "a-token", "bob": "b-token"})
    path = f"{tmp_path}/bulk.sock"
    sidecar = sidecar_factory(token_file=str(d), bulk_address=f"unix:{path}", bulk_max_connections=8,
                              bulk_max_connections_per_peer=16)
    held, codes = [], []
    try:
        for _ in range(8):
            s = raw_bulk(path)
            held.append(s)
            bulkwire.send(s, pb.BulkFrame(hello=pb.BulkHello(version=1, authorization="Bearer b-token")))
            st = bulkwire.recv(s).status
            codes.append(st.code)
        assert codes == [0] * 7 + [grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
        assert "--bulk-max-connections" in st.message
        assert eventually(lambda: len(sidecar.bulk[0]._connections) == 7)
        alice = raw_bulk(path)
        held.append(alice)
        bulkwire.send(alice, pb.BulkFrame(hello=pb.BulkHello(version=1, authorization="Bearer a-token")))
        assert bulkwire.recv(alice).status.code == 0
    finally:
        for s in held:
            s.close()


def test_one_peer_holds_at_most_its_share_of_bulk_connections(sidecar_factory, tmp_path):
    path = f"{tmp_path}/bulk.sock"
    sidecar = sidecar_factory(bulk_address=f"unix:{path}", bulk_max_connections=64,
                              bulk_max_connections_per_peer=16, bulk_hello_seconds=30)
    attacker = hold_connections(path, 64, hold=0.5)
    try:
        outcome = outcome_of(attacker)
        assert outcome == {"open": 16, "8 --bulk-max-connections-per-peer": 48}, outcome
        # Another process is another peer: it connects and is served while the first one holds its 16.
        s = raw_bulk(path)
        bulkwire.send(s, pb.BulkFrame(hello=pb.BulkHello(version=1)))
        assert bulkwire.recv(s).status.code == 0
        s.close()
    finally:
        attacker.kill()


# --- memory per request -------------------------------------------------------------------------------------

def test_grpc_requests_over_the_token_limit_are_refused_naming_it(sidecar_factory):
    sidecar = sidecar_factory(max_request_tokens=1000)
    with grpc.insecure_channel(sidecar.address) as ch:
        stub = pb_grpc.KVCacheStub(ch)
        assert stub.Lookup(pb.LookupRequest(model=model_to_proto(SMALL), tokens=range(1000))).cached_tokens == 0
        for call in (lambda t: stub.Lookup(pb.LookupRequest(model=model_to_proto(SMALL), tokens=t)),
                     lambda t: list(stub.Get(pb.GetRequest(model=model_to_proto(SMALL), tokens=t))),
                     lambda t: stub.Delete(pb.DeleteRequest(model=model_to_proto(SMALL), tokens=t)),
                     lambda t: stub.Put(iter([pb.PutRequest(header=pb.PutHeader(model=model_to_proto(SMALL),
                                                                                tokens=t))]))):
            with pytest.raises(grpc.RpcError) as info:
                call(range(1001))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "1001 ids, more than the limit of 1000 (--max-request-tokens)" in info.value.details()


def test_a_large_bulk_frame_trickled_in_cannot_keep_its_slot(sidecar_factory, tmp_path):
    """With one large-request slot: a connection that announces a large get frame and trickles its body holds
    the slot only until --stream-idle-seconds has passed in all; meanwhile a large gRPC request is refused at
    once, naming --max-large-requests; afterwards it is served."""
    path = f"{tmp_path}/bulk.sock"
    sidecar = sidecar_factory(bulk_address=f"unix:{path}", max_large_requests=1, stream_idle_seconds=1.5)
    s = raw_bulk(path)
    bulkwire.send(s, pb.BulkFrame(hello=pb.BulkHello(version=1)))
    assert bulkwire.recv(s).status.code == 0
    frame = _encoded_get(100_000, seed=1)
    s.sendall(frame[:1000])
    big = pb.LookupRequest(model=model_to_proto(SMALL), tokens=range(100_000))
    with grpc.insecure_channel(sidecar.address) as ch:
        stub = pb_grpc.KVCacheStub(ch)
        assert eventually(lambda: sidecar.engine.large_requests.active == 1)
        with pytest.raises(grpc.RpcError) as info:
            stub.Lookup(big)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-large-requests" in info.value.details()
        t0 = time.monotonic()
        try:
            for i in range(1000, 1040):  # a byte every 0.1 s: never idle for a whole second
                s.sendall(frame[i:i + 1])
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert time.monotonic() - t0 < 3.5
        assert eventually(lambda: sidecar.engine.large_requests.active == 0)
        assert stub.Lookup(big).cached_tokens == 0
    s.close()


def _encoded_get(n_tokens: int, seed: int) -> bytes:
    """A bulk get frame of `n_tokens` token ids below 150,000 (3 bytes each, packed), as a vocabulary's are."""
    ids = np.random.default_rng(seed).integers(0, 150_000, n_tokens, dtype=np.uint32)
    return bulkwire.encode_get(pb.GetRequest(model=model_to_proto(SMALL), tokens=ids.tolist()))


def _send_get(path: str, frame: bytes) -> tuple[int, str]:
    """Send one pre-encoded get on a new connection; the answer's status (code, message). The sidecar may refuse
    before it has read the whole frame and close: what it said before closing is still read."""
    s = raw_bulk(path)
    s.settimeout(60)
    try:
        bulkwire.send(s, pb.BulkFrame(hello=pb.BulkHello(version=1)))
        assert bulkwire.recv(s).status.code == 0
        try:
            s.sendall(frame)
        except (BrokenPipeError, ConnectionResetError):
            pass
        while True:
            answer = bulkwire.recv(s)
            if answer.WhichOneof("frame") == "status":
                return answer.status.code, answer.status.message
            bulkwire.recv_into(s, bytearray(answer.chunk.nbytes))
    finally:
        s.close()


@pytest.mark.slow
def test_huge_requests_do_not_take_memory_beyond_a_bound(tmp_path):
    """The issue's attack: 16 concurrent bulk gets of 4M tokens each (then legal) took a 64 MiB-budget sidecar
    from 0.76 to 1.7 GB RSS and ran for minutes. Against `promptcache serve`: such a get is refused before its
    body is read (over --max-request-tokens), 16 gets at the limit are served or refused at once (at most
    --max-large-requests at a time), and the sidecar's RSS grows by less than 96 MiB through both rounds (it grew by 603 MiB before)."""
    path = f"{tmp_path}/bulk.sock"
    proc = SidecarProcess("--memory-bytes", "64Mi", "--chunk-tokens", "256", "--bulk-address", f"unix:{path}",
                          "--device", "cpu", "--log-level", "warning").wait_ready()
    try:
        sidecar = psutil.Process(proc.proc.pid)
        _send_get(path, _encoded_get(1024, seed=0))  # warm: the first get imports and allocates what it needs
        before = sidecar.memory_info().rss
        peak = [before]
        sampling = threading.Event()

        def sample():
            while not sampling.wait(0.02):
                peak[0] = max(peak[0], sidecar.memory_info().rss)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            rounds = {}
            for n_tokens in (1 << 22, 1 << 20):  # the attack; then requests exactly at the default limit
                frame = _encoded_get(n_tokens, seed=n_tokens)
                answers = [None] * 16
                t0 = time.monotonic()

                def one(i):
                    answers[i] = _send_get(path, frame)

                threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(60)
                rounds[n_tokens] = answers, time.monotonic() - t0
                del frame
        finally:
            sampling.set()
            sampler.join()
        grown = (peak[0] - before) / MIB
        print(f"RSS {before / MIB:.0f} MiB, peak {peak[0] / MIB:.0f} MiB (+{grown:.0f}); rounds took "
              f"{rounds[1 << 22][1]:.2f} s and {rounds[1 << 20][1]:.2f} s")
        assert grown < 96, f"RSS grew by {grown:.0f} MiB (from {before / MIB:.0f} MiB)"
        answers, took = rounds[1 << 22]
        assert {code for code, _ in answers} == {grpc.StatusCode.INVALID_ARGUMENT.value[0]}, answers[:2]
        assert all("--max-request-tokens" in message for _, message in answers)
        assert took < 10, took
        answers, took = rounds[1 << 20]
        # Served (nothing cached: an answer of no chunks, found at the first key) or refused at once.
        assert {code for code, _ in answers} <= {0, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}, answers
        assert all("--max-large-requests" in m for c, m in answers if c), answers
        assert took < 10, took
    finally:
        proc.stop()


def trickling_bulk_put(address: str, seed: int, stop: threading.Event, every: float = 0.2) -> socket.socket:
    """The slow-Put attack on the bulk channel: a put announcing a 1 MiB chunk, then a byte every `every` s."""
    sock = raw_bulk(address.removeprefix("unix:"))
    bulkwire.send(sock, pb.BulkFrame(hello=pb.BulkHello(version=1)))
    assert bulkwire.recv(sock).status.code == 0
    tokens = [seed * 1000 + i for i in range(CHUNK)]
    header = pb.PutHeader(model=model_to_proto(WIDE), tokens=tokens)
    bulkwire.send(sock, pb.BulkFrame(put=pb.BulkPut(header=header, chunks=1)))
    bulkwire.send(sock, pb.BulkFrame(chunk=pb.ChunkBegin(index=0, nbytes=WIDE_NBYTES, shape=WIDE_SHAPE,
                                                         dtype=pb.DTYPE_FLOAT32)))

    def trickle():
        try:
            while not stop.wait(every):
                sock.send(b"\x00")
        except OSError:
            pass  # cut off
    threading.Thread(target=trickle, daemon=True).start()
    return sock


def test_trickling_bulk_puts_are_cut_off_like_grpc_ones(sidecar_factory, tmp_path):
    """The same attack over the bulk channel's Put: the minimum rate applies there too, the reservations are
    released, an honest writer gets in, and the cut is counted as the watchdog's. (One process's bulk
    connections are one client for --max-put-reserved-fraction: here it may hold the whole budget, so only the
    rate limit can end the lock-out.)"""
    path = f"{tmp_path}/bulk.sock"
    sidecar = sidecar_factory(memory_bytes=2 * MIB, max_chunk_bytes=2 * MIB, stream_idle_seconds=30,
                              min_put_bytes_per_second=64 << 10, put_rate_window_seconds=1.0,
                              max_put_reserved_fraction=1.0, bulk_address=f"unix:{path}")
    stop = threading.Event()
    socks = [trickling_bulk_put(path, seed, stop) for seed in range(2)]
    try:
        assert eventually(lambda: sidecar.tier.usage()["reserved"] == 2 * MIB), sidecar.tier.usage()
        with PromptCacheClient(sidecar.address, retries=0, timeout=10) as honest:
            took, refusals = honest_put(honest, seed=7, deadline=time.monotonic() + 8)
        assert refusals and took < 4.0, (took, refusals[:2])
        assert eventually(lambda: sidecar.tier.usage()["reserved"] == 0)
    finally:
        stop.set()
        for s in socks:
            s.close()
    from support import metric

    assert metric(sidecar, 'promptcache_calls_cancelled_total{limit="rate",rpc="BulkPut"}') == 2
    assert metric(sidecar, 'promptcache_requests_total{code="DEADLINE_EXCEEDED",rpc="BulkPut"}') == 2


def test_the_last_large_request_slot_is_kept_for_a_client_that_holds_none():
    """--max-large-requests is shared by every client, so one that announces large requests and stalls them must
    not take all of it: a client holding slots cannot take the last free one; a client holding none can."""
    from promptcache.sidecar.limits import LargeRequests

    slots = LargeRequests(4)
    assert [slots.acquire("tenant:bob") for _ in range(4)] == [True, True, True, False]
    assert slots.acquire("tenant:alice") and slots.active == 4
    assert not slots.acquire("tenant:carol")  # all taken
    slots.release("tenant:alice")
    assert not slots.acquire("tenant:bob") and slots.acquire("tenant:carol")
    for _ in range(3):
        slots.release("tenant:bob")
    slots.release("tenant:carol")
    assert slots.active == 0 and [slots.acquire("tenant:bob") for _ in range(4)] == [True, True, True, False]
    one = LargeRequests(1)  # a single slot: whoever comes first takes it
    assert one.acquire("tenant:bob") and not one.acquire("tenant:alice")


def test_a_large_bulk_put_is_served_with_one_large_request_slot(sidecar_factory, tmp_path):
    """A bulk Put frame of more than 64Ki tokens takes a large-request slot before its body is read; the Put it
    carries runs in that slot. It took a second one, so with --max-large-requests 1 every large bulk Put was
    refused (RESOURCE_EXHAUSTED)."""
    path = f"{tmp_path}/bulk.sock"
    sidecar = sidecar_factory(bulk_address=f"unix:{path}", max_large_requests=1)
    tokens = list(range(70_000))
    blob = encode_chunk(SMALL, make_kv(SMALL, CHUNK, seed=3), 0, CHUNK)
    with PromptCacheClient(sidecar.address, bulk_address=f"unix:{path}", chunk_tokens=CHUNK, retries=0) as client:
        assert client.put_blobs(SMALL, tokens, {0: blob}).stored_chunks == 1
        assert client.lookup(SMALL, tokens).cached_tokens == CHUNK
    assert sidecar.engine.large_requests.active == 0


def test_the_last_workers_are_kept_for_clients_with_none_in_flight():
    from promptcache.sidecar.limits import WorkerShare

    share = WorkerShare(16)  # an eighth kept: 2
    assert [share.acquire("tenant:bob") for _ in range(15)] == [True] * 14 + [False]
    assert share.acquire("tenant:alice") and not share.acquire("tenant:alice")  # one, then the reserve holds
    assert share.acquire("tenant:carol") and share.busy == 16
    share.release("tenant:bob")
    assert not share.acquire("tenant:bob") and share.acquire("tenant:dave")
    lone = WorkerShare(1)
    assert lone.acquire("tenant:bob") and lone.busy == 1
    lone.release("tenant:bob")
    assert lone.busy == 0 and lone.acquire("tenant:alice")


def test_without_auth_each_process_is_its_own_bulk_client(sidecar_factory, tmp_path):
    """docs/bulk-channel.md: without authentication a client is a process (unix socket) for the last-eighth rule.
    One process holding 7 of 8 connections must not refuse another process's first one (every anonymous unix
    connection was counted as one client, named by the socket path)."""
    path = f"{tmp_path}/bulk.sock"
    sidecar_factory(bulk_address=f"unix:{path}", bulk_max_connections=8, bulk_max_connections_per_peer=16)
    held = []
    try:
        for _ in range(7):
            s = raw_bulk(path)
            held.append(s)
            bulkwire.send(s, pb.BulkFrame(hello=pb.BulkHello(version=1)))
            assert bulkwire.recv(s).status.code == 0
        child = (f"import socket\nfrom promptcache.contract import bulkwire\n"
                 f"from promptcache.v1 import kvcache_pb2 as pb\n"
                 f"s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect({path!r})\n"
                 f"bulkwire.send(s, pb.BulkFrame(hello=pb.BulkHello(version=1)))\n"
                 f"st = bulkwire.recv(s).status\nprint(st.code, st.message)\n")
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
        assert out.stdout.startswith("0 "), out.stdout + out.stderr
    finally:
        for s in held:
            s.close()


def test_without_auth_another_process_may_take_the_last_large_request_slot(sidecar_factory, tmp_path):
    """The last free --max-large-requests slot is kept for a client holding none; without authentication a bulk
    client is a process (docs/bulk-channel.md). Another process's large frame must not be refused because this one
    holds a slot (every anonymous unix connection counted as one client, named by the socket path)."""
    path = f"{tmp_path}/bulk.sock"
    sidecar = sidecar_factory(bulk_address=f"unix:{path}", max_large_requests=2, stream_idle_seconds=5)
    s = raw_bulk(path)
    try:
        bulkwire.send(s, pb.BulkFrame(hello=pb.BulkHello(version=1)))
        assert bulkwire.recv(s).status.code == 0
        s.sendall(_encoded_get(100_000, seed=1)[:1000])  # a large frame, its body stalled: holds a slot
        assert eventually(lambda: sidecar.engine.large_requests.active == 1)
        child = (f"import socket\nfrom promptcache.contract import bulkwire\n"
                 f"from promptcache.v1 import kvcache_pb2 as pb\n"
                 f"s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect({path!r})\n"
                 f"bulkwire.send(s, pb.BulkFrame(hello=pb.BulkHello(version=1)))\n"
                 f"assert bulkwire.recv(s).status.code == 0\n"
                 f"s.sendall({_encoded_get(100_000, seed=2)[:1000]!r})\n"
                 f"s.settimeout(1.0)\n"
                 f"try:\n    st = bulkwire.recv(s).status; print(st.code, st.message)\n"
                 f"except (TimeoutError, OSError):\n    print('held')\n")
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "held", out.stdout + out.stderr
    finally:
        s.close()


def test_anonymous_grpc_callers_over_a_unix_socket_share_no_slot_reserve(sidecar_factory, tmp_path):
    """Every anonymous gRPC caller over a unix socket has the peer "unix:", so the last-slot rule (kept for a client
    holding none) took the last --max-large-requests slot from all of them: 3 of 4 served at once. Without
    authentication over gRPC only the total applies."""
    from promptcache.sidecar.identity import ANONYMOUS, Caller

    sidecar = sidecar_factory(grpc_address=f"unix:{tmp_path}/g.sock", max_large_requests=4)
    caller = Caller(ANONYMOUS, "unix:")
    tokens = list(range(70_000))
    taken = [sidecar.engine.take_large(tokens, "Lookup", sidecar.engine.slot_client(caller)) for _ in range(4)]
    assert taken == [True] * 4 and sidecar.engine.large_requests.active == 4
    for _ in range(4):
        sidecar.engine.give_large(True, sidecar.engine.slot_client(caller))
    assert sidecar.engine.large_requests.active == 0
