"""The sidecar over real gRPC on loopback with the real client: round trips, prefixes, isolation, TTL, budget,
corruption, Resize, health and reflection."""
from __future__ import annotations

import dataclasses
import os
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from support import CHUNK, SMALL, FakeClock, make_kv, make_writable, metric, metrics_text
from promptcache.client import PromptCacheClient, errors
from promptcache.contract.layout import chunk_nbytes
from promptcache.sidecar.auth import ANONYMOUS

CHUNK_BYTES = chunk_nbytes(SMALL, CHUNK)  # 2 layers * 2 * 2 heads * 16 tokens * 8 dim * 4 bytes = 4096


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_put_lookup_get_is_bit_identical(client, dtype):
    spec = dataclasses.replace(SMALL, kv_dtype=dtype)
    tokens = list(range(100, 100 + 5 * CHUNK + 3))  # 5 whole chunks and a partial one
    kv = make_kv(spec, len(tokens), seed=1)
    put = client.put(spec, tokens, kv)
    assert (put.stored_chunks, put.skipped_chunks) == (5, 0)
    assert client.lookup(spec, tokens).cached_tokens == 5 * CHUNK
    cached, got = client.get(spec, tokens)
    assert cached == 5 * CHUNK
    for (k, v), (gk, gv) in zip(kv, got):
        assert gk.dtype == k.dtype and gk.shape == (1, SMALL.num_kv_heads, cached, SMALL.head_dim)
        # Bit-identical: compare the raw bytes, so even NaN payloads or -0.0 would have to survive.
        assert torch.equal(gk.contiguous().view(torch.uint8), k[:, :, :cached].contiguous().view(torch.uint8))
        assert torch.equal(gv.contiguous().view(torch.uint8), v[:, :, :cached].contiguous().view(torch.uint8))


def test_second_put_skips_cached_chunks(client):
    tokens = list(range(3 * CHUNK))
    kv = make_kv(SMALL, len(tokens))
    assert client.put(SMALL, tokens, kv).stored_chunks == 3
    again = client.put(SMALL, tokens, kv)
    assert (again.stored_chunks, again.skipped_chunks) == (0, 3)


def test_longest_prefix_reuses_whole_shared_chunks(client):
    tokens = list(range(4 * CHUNK))
    client.put(SMALL, tokens, make_kv(SMALL, len(tokens)))
    # Shares 2.5 chunks, then diverges: the first two chunks are reusable, nothing after.
    other = tokens[: 2 * CHUNK + CHUNK // 2] + [999_999] * (2 * CHUNK)
    result = client.lookup(SMALL, other)
    assert result.cached_tokens == 2 * CHUNK
    assert [c.index for c in result.chunks] == [0, 1] and all(c.tier == "device" for c in result.chunks)
    cached, kv = client.get(SMALL, other)
    assert cached == 2 * CHUNK and kv[0][0].shape[2] == 2 * CHUNK
    # A prompt that differs inside the first chunk reuses nothing.
    assert client.lookup(SMALL, [5] + tokens[1:]).cached_tokens == 0


def test_get_stops_at_first_missing_chunk(client):
    tokens = list(range(4 * CHUNK))
    client.put(SMALL, tokens, make_kv(SMALL, len(tokens)))
    assert client.delete(SMALL, tokens, start_chunk=2) == 2
    assert client.lookup(SMALL, tokens).cached_tokens == 2 * CHUNK
    assert len(client.get_blobs(SMALL, tokens, start_chunk=1)) == 1


@pytest.mark.parametrize("change", [dict(revision="rev-2"), dict(tenant_salt=b"tenant-b"), dict(model_id="x/y"),
                                    dict(quantization="k8v8")])
def test_chunks_are_never_returned_for_another_fingerprint(client, change):
    tokens = list(range(2 * CHUNK))
    client.put(SMALL, tokens, make_kv(SMALL, len(tokens)))
    other = dataclasses.replace(SMALL, **change)
    assert client.lookup(other, tokens).cached_tokens == 0
    assert client.get_blobs(other, tokens) == []
    assert client.lookup(SMALL, tokens).cached_tokens == 2 * CHUNK


def test_purge_removes_only_that_fingerprint(client):
    other = dataclasses.replace(SMALL, revision="rev-2")
    tokens = list(range(2 * CHUNK))
    client.put(SMALL, tokens, make_kv(SMALL, len(tokens)))
    client.put(other, tokens, make_kv(other, len(tokens)))
    assert client.purge(SMALL) == (2, 2 * CHUNK_BYTES)
    assert client.lookup(SMALL, tokens).cached_tokens == 0
    assert client.lookup(other, tokens).cached_tokens == 2 * CHUNK


def test_ttl_expiry(sidecar_factory):
    clock = FakeClock()
    sidecar = sidecar_factory(ttl_seconds=0.3, clock=clock)
    with PromptCacheClient(sidecar.address) as client:
        tokens = list(range(2 * CHUNK))
        client.put(SMALL, tokens, make_kv(SMALL, len(tokens)))
        clock.advance(0.29)
        assert client.lookup(SMALL, tokens).cached_tokens == 2 * CHUNK
        clock.advance(0.02)
        assert client.lookup(SMALL, tokens).cached_tokens == 0
        assert client.get_blobs(SMALL, tokens) == []
    deadline = time.monotonic() + 10  # the sweeper wakes every 0.075 s (real time) and frees what has expired
    while sidecar.tier.usage()["used"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sidecar.tier.usage()["used"] == 0  # the sweeper freed the bytes too
    assert metric(sidecar, 'promptcache_evictions_total{reason="ttl",tier="device"}') == 2


def test_capacity_eviction_never_exceeds_budget_under_concurrency(sidecar_factory):
    budget = 10 * CHUNK_BYTES + CHUNK_BYTES // 2  # room for 10 chunks
    sidecar = sidecar_factory(memory_bytes=budget)
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            u = sidecar.tier.usage()
            samples.append((u["used"] + u["reserved"] + u["draining"], sidecar.tier.measured_bytes()))
            time.sleep(0.001)

    failures = []

    def worker(seed):
        with PromptCacheClient(sidecar.address, timeout=20, retries=5) as c:
            for j in range(6):
                tokens = [seed * 10_000 + j * 100 + t for t in range(3 * CHUNK)]
                try:
                    c.put(SMALL, tokens, make_kv(SMALL, len(tokens), seed=seed))
                    c.get_blobs(SMALL, tokens)
                except errors.ResourceExhausted:
                    pass  # budget fully held by Puts and Gets in flight: refused, never overcommitted
                except errors.PromptCacheError as exc:
                    failures.append(exc)

    sampler = threading.Thread(target=sample)
    sampler.start()
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    sampler.join()
    assert not failures
    assert len(samples) > 10
    assert max(s[0] for s in samples) <= budget
    assert max(s[1] for s in samples) <= budget  # measured from torch's storages, not our counters
    assert sidecar.tier.usage()["entries"] <= 10
    assert metric(sidecar, 'promptcache_evictions_total{reason="capacity",tier="device"}') > 0


def test_lru_evicts_least_recently_used(sidecar_factory):
    sidecar = sidecar_factory(memory_bytes=3 * CHUNK_BYTES, eviction_policy="lru")
    with PromptCacheClient(sidecar.address) as c:
        prompts = [[p * 1000 + t for t in range(CHUNK)] for p in range(4)]
        for p in prompts[:3]:
            c.put(SMALL, p, make_kv(SMALL, CHUNK))
        c.get_blobs(SMALL, prompts[0])  # 0 is now most recent; 1 is the LRU
        c.put(SMALL, prompts[3], make_kv(SMALL, CHUNK))
        cached = [c.lookup(SMALL, p).cached_tokens for p in prompts]
    assert cached == [CHUNK, 0, CHUNK, CHUNK]


def test_corrupted_chunk_is_dropped_and_never_served(sidecar, client):
    tokens = list(range(3 * CHUNK))
    client.put(SMALL, tokens, make_kv(SMALL, len(tokens)))
    keys = [c.key for c in client.lookup(SMALL, tokens).chunks]
    entry = sidecar.tier._entries[keys[1]]  # flip one bit of chunk 1 in the device tier
    make_writable(entry)  # stored memory is read-only (tests/test_protected_memory.py): as if mprotect had failed
    entry.data[123] ^= 0x01
    blobs = client.get_blobs(SMALL, tokens)
    assert len(blobs) == 1  # chunk 0 served, corrupt chunk 1 ends the prefix, chunk 2 unreachable
    assert client.lookup(SMALL, tokens).cached_tokens == CHUNK
    assert metric(sidecar, 'promptcache_checksum_failures_total{tier="device"}') == 1
    assert metric(sidecar, 'promptcache_evictions_total{reason="checksum",tier="device"}') == 1


def test_resize_shrinks_by_evicting_and_grows_without_loss(sidecar_factory):
    sidecar = sidecar_factory(memory_bytes=8 * CHUNK_BYTES, eviction_policy="lru")
    with PromptCacheClient(sidecar.address) as c:
        prompts = [[p * 1000 + t for t in range(CHUNK)] for p in range(8)]
        for p in prompts:
            c.put(SMALL, p, make_kv(SMALL, CHUNK))
        grown = c.resize(16 * CHUNK_BYTES)
        assert grown.evicted_chunks == 0 and grown.previous_bytes == 8 * CHUNK_BYTES
        assert sum(c.lookup(SMALL, p).cached_tokens for p in prompts) == 8 * CHUNK
        shrunk = c.resize(3 * CHUNK_BYTES)
        assert shrunk.evicted_chunks == 5 and shrunk.bytes_used <= 3 * CHUNK_BYTES
        # The most recently used survive.
        assert [c.lookup(SMALL, p).cached_tokens for p in prompts] == [0] * 5 + [CHUNK] * 3
        assert c.stats().tiers[0].bytes_budget == 3 * CHUNK_BYTES


def test_unix_socket(sidecar_factory, tmp_path):
    sock = tmp_path / "pc.sock"
    sidecar = sidecar_factory(grpc_address=f"unix:{sock}")
    with PromptCacheClient(f"unix://{sock}") as c:
        tokens = list(range(CHUNK))
        c.put(SMALL, tokens, make_kv(SMALL, CHUNK))
        assert c.lookup(SMALL, tokens).cached_tokens == CHUNK
    assert sidecar.address.startswith("unix:")


def test_health_and_reflection(sidecar):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(sidecar.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "promptcache.v1.KVCache"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"promptcache.v1.KVCache", "grpc.health.v1.Health"} <= services
        methods = {m.name for m in db.FindFileContainingSymbol("promptcache.v1.KVCache").service[0].method}
        assert {"Lookup", "Put", "Get", "Delete", "Purge", "Stats", "Resize"} <= methods


def test_metrics_follow_prometheus_naming(sidecar, client):
    tokens = list(range(2 * CHUNK))
    client.put(SMALL, tokens, make_kv(SMALL, len(tokens)))
    client.get_blobs(SMALL, tokens + [1] * CHUNK)
    text = metrics_text(sidecar)
    for name in ("promptcache_lookups_total", "promptcache_hit_tokens_total", "promptcache_missed_tokens_total",
                 "promptcache_received_bytes_total", "promptcache_sent_bytes_total", "promptcache_entries",
                 "promptcache_stored_bytes", "promptcache_budget_bytes", "promptcache_evictions_total",
                 "promptcache_eviction_entry_age_seconds", "promptcache_request_duration_seconds",
                 "promptcache_requests_total", "promptcache_checksum_failures_total"):
        assert name in text, name
    assert metric(sidecar, 'promptcache_hit_tokens_total{rpc="get",tier="device"}') == 2 * CHUNK
    assert metric(sidecar, 'promptcache_missed_tokens_total{rpc="get"}') == CHUNK
    assert metric(sidecar, 'promptcache_sent_bytes_total{tier="device"}') == 2 * CHUNK_BYTES
    assert metric(sidecar, 'promptcache_entries{tier="device"}') == 2
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="Put"}') == 1


def test_client_maps_unreachable_sidecar_to_unavailable():
    from support import free_port

    with PromptCacheClient(f"127.0.0.1:{free_port()}", timeout=1, retries=1) as c:
        with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
            c.lookup(SMALL, list(range(CHUNK)))


def test_shared_memory_fast_path_round_trip(sidecar_factory, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    sidecar = sidecar_factory(grpc_address=f"unix:{tmp_path / 's.sock'}", shm_dir=str(shm))
    tokens = list(range(3 * CHUNK + 5))
    kv = make_kv(SMALL, len(tokens), seed=3)
    with PromptCacheClient(sidecar.address, shm_dir=str(shm)) as fast, \
            PromptCacheClient(sidecar.address) as streamed:
        assert fast.put(SMALL, tokens, kv).stored_chunks == 3
        cached, got = fast.get(SMALL, tokens)
        assert cached == 3 * CHUNK
        for (k, v), (gk, gv) in zip(kv, got):
            assert torch.equal(gk, k[:, :, :cached]) and torch.equal(gv, v[:, :, :cached])
        # Both transports see the same bytes.
        assert [b.tolist() for b in fast.get_blobs(SMALL, tokens)] == \
            [b.tolist() for b in streamed.get_blobs(SMALL, tokens)]
        # One reusable buffer for this client thread, created by the sidecar; its name left the folder at its
        # first use, so no other process can open it.
        assert len(fast._shm._all) == 1
        assert list(shm.iterdir()) == []
        assert sidecar.engine.buffers.held(ANONYMOUS) == (1, fast._shm._all[0].size)
    assert sidecar.engine.buffers.held(ANONYMOUS) == (0, 0)  # closed with the client


def test_shared_buffers_are_only_those_the_sidecar_created(sidecar_factory, tmp_path):
    """A name is never opened as a path: files in --shm-dir, symlinks, paths and unknown names are all just
    handles nobody was granted."""
    from promptcache.v1 import kvcache_pb2 as pb
    from promptcache.v1 import kvcache_pb2_grpc as pb_grpc
    from promptcache.contract.wire import model_to_proto

    shm = tmp_path / "shm"
    shm.mkdir()
    (tmp_path / "secret").write_bytes(b"x" * 10_000)
    (shm / "link").symlink_to(tmp_path / "secret")
    (shm / "plain").write_bytes(b"y" * 10_000)  # a client-made file, as before the sidecar created them
    sidecar = sidecar_factory(shm_dir=str(shm))
    plain = sidecar_factory()
    for address, name, code in ((sidecar.address, "../secret", grpc.StatusCode.NOT_FOUND),
                                (sidecar.address, "link", grpc.StatusCode.NOT_FOUND),
                                (sidecar.address, "plain", grpc.StatusCode.NOT_FOUND),
                                (sidecar.address, "missing", grpc.StatusCode.NOT_FOUND),
                                (plain.address, "anything", grpc.StatusCode.FAILED_PRECONDITION)):
        with grpc.insecure_channel(address) as ch:
            req = pb.GetRequest(model=model_to_proto(SMALL), tokens=list(range(CHUNK)),
                                shared_buffer=pb.SharedBuffer(name=name, length=4096))
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.KVCacheStub(ch).Get(req, timeout=5))
            assert info.value.code() == code
            assert (name in info.value.details()) if code == grpc.StatusCode.NOT_FOUND else \
                "disabled on this sidecar" in info.value.details()
    with grpc.insecure_channel(plain.address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.KVCacheStub(ch).OpenSharedBuffer(pb.OpenSharedBufferRequest(length=4096), timeout=5)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_truncated_shared_buffer_is_refused_not_a_crash(sidecar_factory, tmp_path):
    """The sidecar reads and writes client buffers with pread/pwrite: a client that truncates its file gets a
    clear error (a mapping would have killed the sidecar with SIGBUS), and the sidecar keeps serving."""
    import numpy as np
    import xxhash

    from promptcache.client.client import encode_chunk
    from promptcache.contract.layout import chunk_shape
    from promptcache.contract.shm import SharedBufferError
    from promptcache.v1 import kvcache_pb2 as pb
    from promptcache.v1 import kvcache_pb2_grpc as pb_grpc
    from promptcache.contract.wire import NAME_TO_DTYPE, model_to_proto

    shm = tmp_path / "shm"
    shm.mkdir()
    sidecar = sidecar_factory(shm_dir=str(shm))
    grant = sidecar.engine.buffers.open(ANONYMOUS, 8192)
    client_fd = os.open(shm / grant.file_name, os.O_RDWR)  # as the client opens it
    f = sidecar.engine.buffers.use(ANONYMOUS, grant.handle, 8192)
    os.ftruncate(client_fd, 100)  # what a misbehaving client can do at any moment
    os.close(client_fd)
    out = np.empty(4096, dtype=np.uint8)
    with pytest.raises(SharedBufferError, match="truncated"):
        f.read_into(4096, out)
    f.write(4096, np.full(4096, 7, dtype=np.uint8))  # grows the file again; nothing faults
    assert os.fstat(grant.fd).st_size == 8192
    f.close()

    kv = make_kv(SMALL, CHUNK)
    kv_blob = encode_chunk(SMALL, kv, 0, CHUNK).numpy()
    with grpc.insecure_channel(sidecar.address) as ch:
        stub = pb_grpc.KVCacheStub(ch)
        granted = stub.OpenSharedBuffer(pb.OpenSharedBufferRequest(length=2 * kv_blob.size), timeout=5)
        fd = os.open(shm / granted.file_name, os.O_RDWR)
        os.ftruncate(fd, kv_blob.size // 2)  # the header promises two chunks' room; the client cuts it short
        os.close(fd)
        frames = [pb.PutRequest(header=pb.PutHeader(model=model_to_proto(SMALL), tokens=list(range(CHUNK)),
                                                    shared_buffer=granted.handle)),
                  pb.PutRequest(chunk=pb.ChunkBegin(index=0, nbytes=kv_blob.size, shape=chunk_shape(SMALL, CHUNK),
                                                    dtype=NAME_TO_DTYPE[SMALL.kv_dtype],
                                                    xxh3_64=xxhash.xxh3_64_intdigest(kv_blob), buffer_offset=0))]
        with pytest.raises(grpc.RpcError) as info:
            stub.Put(iter(frames), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "truncated" in info.value.details()
    with PromptCacheClient(sidecar.address) as c:
        assert c.put(SMALL, list(range(CHUNK)), kv).stored_chunks == 1  # still serving; nothing partial kept
        assert c.lookup(SMALL, list(range(CHUNK))).cached_tokens == CHUNK


def test_pre_encoded_data_frames_are_plain_proto_on_the_wire(client, sidecar):
    """The server's fast data frames must parse as ordinary GetResponse messages for any other client."""
    from promptcache.contract import frames
    from promptcache.v1 import kvcache_pb2 as pb
    from promptcache.v1 import kvcache_pb2_grpc as pb_grpc
    from promptcache.contract.wire import model_to_proto

    payload = bytes(range(256)) * 1000
    encoded = frames.encode_data_frame(memoryview(payload))
    assert pb.GetResponse.FromString(encoded).data == payload
    assert bytes(frames.parse_get_response(encoded)) == payload
    begin = pb.GetResponse(chunk=pb.ChunkBegin(index=3, nbytes=7)).SerializeToString()
    assert frames.parse_get_response(begin).chunk.index == 3
    tokens = list(range(2 * CHUNK))
    kv = make_kv(SMALL, len(tokens), seed=9)
    client.put(SMALL, tokens, kv)
    with grpc.insecure_channel(sidecar.address) as ch:  # the generated stub, protobuf all the way
        msgs = list(pb_grpc.KVCacheStub(ch).Get(pb.GetRequest(model=model_to_proto(SMALL), tokens=tokens), timeout=5))
    data = b"".join(m.data for m in msgs if m.WhichOneof("frame") == "data")
    assert data == b"".join(b.numpy().tobytes() for b in client.get_blobs(SMALL, tokens))


@pytest.mark.parametrize("compression", [grpc.Compression.NoCompression, grpc.Compression.Gzip])
def test_a_third_party_client_puts_and_gets_with_the_generated_stubs(sidecar, compression):
    """What any gRPC client can do with the proto alone: a Put whose data frames split each chunk anywhere (and,
    with grpc-encoding gzip, compressed), then a Get whose bytes are those it sent, in any client's framing."""
    import xxhash

    from promptcache.client.client import encode_chunk
    from promptcache.contract.layout import chunk_shape
    from promptcache.contract.wire import NAME_TO_DTYPE, model_to_proto
    from promptcache.v1 import kvcache_pb2 as pb
    from promptcache.v1 import kvcache_pb2_grpc as pb_grpc

    tokens = list(range(500, 500 + 3 * CHUNK))
    kv = make_kv(SMALL, len(tokens), seed=int(compression) + 3)
    blobs = [encode_chunk(SMALL, kv, i * CHUNK, (i + 1) * CHUNK).numpy().tobytes() for i in range(3)]
    frames = [pb.PutRequest(header=pb.PutHeader(model=model_to_proto(SMALL), tokens=tokens))]
    for i, blob in enumerate(blobs):
        frames.append(pb.PutRequest(chunk=pb.ChunkBegin(index=i, nbytes=len(blob), shape=chunk_shape(SMALL, CHUNK),
                                                        dtype=NAME_TO_DTYPE[SMALL.kv_dtype],
                                                        xxh3_64=xxhash.xxh3_64_intdigest(blob))))
        cut = 1 + 997 * (i + 1) % (len(blob) - 1)
        frames += [pb.PutRequest(data=blob[:cut]), pb.PutRequest(data=blob[cut:])]
    with grpc.insecure_channel(sidecar.address, compression=compression) as ch:
        stub = pb_grpc.KVCacheStub(ch)
        put = stub.Put(iter(frames), timeout=10)
        assert (put.stored_chunks, put.stored_bytes) == (3, sum(map(len, blobs)))
        answer = list(stub.Get(pb.GetRequest(model=model_to_proto(SMALL), tokens=tokens), timeout=10))
    chunks = [m.chunk for m in answer if m.WhichOneof("frame") == "chunk"]
    assert [c.index for c in chunks] == [0, 1, 2] and [c.nbytes for c in chunks] == list(map(len, blobs))
    assert b"".join(m.data for m in answer if m.WhichOneof("frame") == "data") == b"".join(blobs)


def test_orphan_chunk_is_not_stored(client):
    """A chunk whose parent is cached nowhere can never be reached by a lookup: it is refused, not stored."""
    tokens = list(range(3 * CHUNK))
    result = client.put(SMALL, tokens, make_kv(SMALL, len(tokens)), start_chunk=1)
    assert (result.stored_chunks, result.rejected_chunks) == (0, 2)
    assert client.put(SMALL, tokens, make_kv(SMALL, len(tokens))).stored_chunks == 3


def test_a_full_cache_admits_a_new_prompt_on_its_second_put(sidecar_factory):
    """W-TinyLFU's chain-root doorkeeper (the default before issue #32) through a real sidecar: with the memory full,
    the first Put of a prompt no one asked for is refused (counted as an admission rejection; the cached chunks
    stay), the second is stored."""
    probe = sidecar_factory()  # the tier's accounting of one chunk (CUDA rounds it up to its allocation block)
    budget = 4 * probe.tier.accounted(chunk_nbytes(SMALL, CHUNK))
    sidecar = sidecar_factory(memory_bytes=budget, eviction_policy="wtinylfu")
    prompts = [list(range(i * CHUNK, (i + 1) * CHUNK)) for i in range(5)]
    with PromptCacheClient(sidecar.address) as c:
        for p in prompts[:4]:
            assert c.put(SMALL, p, make_kv(SMALL, CHUNK)).stored_chunks == 1
        first = c.put(SMALL, prompts[4], make_kv(SMALL, CHUNK))
        assert (first.stored_chunks, first.rejected_chunks) == (0, 1)
        assert all(c.lookup(SMALL, p).cached_tokens == CHUNK for p in prompts[:4])
        assert c.put(SMALL, prompts[4], make_kv(SMALL, CHUNK)).stored_chunks == 1
        assert c.lookup(SMALL, prompts[4]).cached_tokens == CHUNK
    assert metric(sidecar, 'promptcache_admission_rejections_total{tier="device"}') == 1


def test_default_policy_is_the_one_chosen_by_replay(sidecar):
    from promptcache.sidecar.policies import DEFAULT_POLICY

    assert sidecar.tier.policy.name == DEFAULT_POLICY == sidecar.settings.eviction_policy


def test_each_chunk_of_a_client_request_is_one_request_to_the_eviction_policy(sidecar_factory):
    """The policy's reference stream is one `requested` per chunk of a client request, as the trace replay feeds it
    (docs/eviction.md): a Lookup followed by the Get of the same prompt counts each chunk once, as a Get alone does;
    a Put's existence check counts nothing."""
    sidecar = sidecar_factory(eviction_policy="rate")
    policy = sidecar.tier.policy
    asked: list[bytes] = []
    real = policy.requested
    policy.requested = lambda key: (asked.append(key), real(key))[1]
    tokens = list(range(3 * CHUNK))
    with PromptCacheClient(sidecar.address) as c:
        c.put(SMALL, tokens, make_kv(SMALL, len(tokens)))
        assert asked == []
        keys = [ch.key for ch in c.lookup(SMALL, tokens).chunks]
        assert asked == keys
        assert len(c.get_blobs(SMALL, tokens)) == 3
        assert asked == keys  # the Get after the Lookup: not again
        assert len(c.get_blobs(SMALL, tokens)) == 3
        assert asked == keys + keys  # a Get on its own is a request
