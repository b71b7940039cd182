"""The cache engine on its own, with no transport: what a Put and a Get do, and that a PutSession gives back every
reservation it holds on any exit (memory tier, tenant quota, the client's share of the budget)."""
from __future__ import annotations

import pytest
import torch

from support import CHUNK, SMALL, make_kv
from promptcache.client.client import encode_chunk
from promptcache.contract.keys import ModelSpec
from promptcache.contract.layout import chunk_nbytes
from promptcache.contract.layout import values_finite as layout_values_finite
from promptcache.contract.wire import NAME_TO_DTYPE, model_to_proto
from promptcache.sidecar.config import Settings
from promptcache.sidecar.engine import CacheEngine
from promptcache.sidecar.errors import CacheError, DataLoss, InvalidRequest, NoCapacity, NotServed, PermissionDenied
from promptcache.sidecar.identity import Caller, Identity
from promptcache.sidecar.metrics import Metrics
from promptcache.sidecar.observer import TrafficObserver
from promptcache.sidecar.policies import make_policy
from promptcache.sidecar.store import ChunkCheck, MemoryTier, checksum
from promptcache.sidecar.tenancy import Tenancy
from promptcache.v1 import kvcache_pb2 as pb

ALICE = Caller(Identity("alice", "token"), peer="ipv4:127.0.0.1:1")
BOB = Caller(Identity("bob", "token"), peer="ipv4:127.0.0.1:2")


def engine(**overrides) -> CacheEngine:
    settings = Settings(chunk_tokens=CHUNK, memory_bytes=1 << 20, **overrides).validate()
    tier = MemoryTier(settings.memory_bytes, torch.device("cpu"), make_policy("lru", capacity=settings.memory_bytes),
                      settings.ttl_seconds)
    tenancy = Tenancy(enabled=True, tier=tier, quotas={"bob": chunk_nbytes(SMALL, CHUNK) - 1})
    tier.subscribe(tenancy)
    metrics = Metrics()
    tier.subscribe(metrics)
    return CacheEngine(settings, tier, metrics, tenancy, TrafficObserver(CHUNK))


def chunks(spec: ModelSpec, n: int) -> list[tuple[pb.ChunkBegin, bytes]]:
    kv = make_kv(spec, n * CHUNK)
    out = []
    for i in range(n):
        blob = encode_chunk(spec, kv, i * CHUNK, (i + 1) * CHUNK).numpy().tobytes()
        out.append((pb.ChunkBegin(index=i, nbytes=len(blob), shape=[spec.num_layers, 2, spec.num_kv_heads, CHUNK,
                                                                    spec.head_dim],
                                  dtype=NAME_TO_DTYPE[spec.kv_dtype], xxh3_64=checksum(blob)), blob))
    return out


def header(n_chunks: int) -> pb.PutHeader:
    return pb.PutHeader(model=model_to_proto(SMALL), tokens=list(range(n_chunks * CHUNK)))


def held(e: CacheEngine, caller: Caller) -> tuple[int, int, int]:
    """(memory-tier bytes reserved, the caller's quota bytes reserved, the client's share held)."""
    return (e.tier.usage()["reserved"], e.tenancy.usage(caller.tenant)["reserved"],
            e.reserved_by_client.held(caller.client))


def test_put_then_read_back_byte_exact_and_other_tenants_see_nothing():
    e = engine()
    sent = chunks(SMALL, 3)
    with e.put(ALICE, header(3)) as put:
        for begin, blob in sent:
            put.begin_chunk(begin)
            put.add_data(blob[:100])
            put.add_data(blob[100:])
        result = put.commit()
    assert (result.stored_chunks, result.stored_bytes) == (3, sum(len(b) for _, b in sent))
    request = pb.GetRequest(model=model_to_proto(SMALL), tokens=list(range(3 * CHUNK)))
    got = [bytes(view) for _, view in e.read_chunks(ALICE, request)]
    assert got == [blob for _, blob in sent]
    assert list(e.read_chunks(BOB, request)) == []  # isolated tenants: bob's keys are salted apart
    assert e.lookup(ALICE, model_to_proto(SMALL), list(range(3 * CHUNK))).cached_tokens == 3 * CHUNK
    assert held(e, ALICE) == (0, 0, 0)


def test_a_put_cut_mid_chunk_stores_nothing_of_it_and_releases_everything():
    e = engine()
    (begin0, blob0), (begin1, blob1) = chunks(SMALL, 2)
    with pytest.raises(InvalidRequest, match="chunk 1 ended after 10 of its"):
        with e.put(ALICE, header(2)) as put:
            put.begin_chunk(begin0)
            put.add_data(blob0)
            put.begin_chunk(begin1)
            put.add_data(blob1[:10])
            assert held(e, ALICE)[0] > 0 and held(e, ALICE)[2] == len(blob1)  # chunk 1 holds its reservation
            put.commit()
    assert held(e, ALICE) == (0, 0, 0)
    assert e.tier.usage()["entries"] == 1  # chunk 0 was complete and verified: it stays


def test_an_exception_inside_the_session_releases_the_reservation():
    e = engine()
    (begin0, blob0), = chunks(SMALL, 1)
    with pytest.raises(RuntimeError):
        with e.put(ALICE, header(1)) as put:
            put.begin_chunk(begin0)
            put.add_data(blob0[:64])
            raise RuntimeError("the transport broke")
    assert held(e, ALICE) == (0, 0, 0) and e.tier.usage()["entries"] == 0


@pytest.mark.parametrize("size", [None, 100, 7], ids=["whole", "whole-values", "split-values"])
def test_a_chunk_is_checked_as_its_bytes_are_copied_in_whatever_their_pieces(size, monkeypatch):
    """add_data checksums and scans each piece of a chunk as it copies it in (ChunkCheck), so nothing reads the
    chunk back; pieces that split a value (7 bytes of float32 values) leave the scan to the end, over the whole
    chunk. Either way a NaN (one split across two pieces, or the last value) and one changed byte are refused, and
    what is accepted is stored exactly."""
    import struct

    monkeypatch.setattr(ChunkCheck, "PIECE", 64)  # copy_in splits every piece it gets too
    (begin, blob), = chunks(SMALL, 1)
    assert SMALL.kv_dtype == "float32" and len(blob) > 3 * 64

    def put(data: bytes, xxh3: int):
        e = engine()
        with e.put(ALICE, header(1)) as session:
            session.begin_chunk(pb.ChunkBegin(index=0, nbytes=len(data), shape=begin.shape, dtype=begin.dtype,
                                              xxh3_64=xxh3))
            for at in range(0, len(data), size or len(data)):
                session.add_data(data[at:at + (size or len(data))])
            assert session.commit().stored_chunks == 1
        request = pb.GetRequest(model=model_to_proto(SMALL), tokens=list(range(CHUNK)))
        return [bytes(v) for _, v in e.read_chunks(ALICE, request)]

    assert put(blob, checksum(blob)) == [blob]
    for value in (1, len(blob) // 4 - 1):  # bytes 4-7 straddle the first 7-byte piece; the last value
        bad = bytearray(blob)
        bad[4 * value:4 * value + 4] = struct.pack("<f", float("nan"))
        with pytest.raises(InvalidRequest, match="chunk 0 has NaN or Inf"):
            put(bytes(bad), checksum(bytes(bad)))
    changed = bytearray(blob)
    changed[-5] ^= 1
    with pytest.raises(DataLoss, match="checksum"):
        put(bytes(changed), checksum(blob))


@pytest.mark.parametrize("client_writable", [True, False])
def test_bytes_the_client_can_still_write_are_checked_as_they_are_stored(client_writable):
    """A bulk Put through the client's memfd hands the session memory the client can still write. A client
    rewriting it while the sidecar copies (here: NaN everywhere right after each hash update) must not get one
    thing checked and another stored: with client_writable each piece is copied first and checked from the chunk's
    own memory, so the checksum and the finite flag are those of the stored bytes. The same race against the
    path for the sidecar's own buffers (False) shows what the flag guards against."""
    import numpy as np
    import xxhash

    src = np.zeros(3 * ChunkCheck.PIECE // 4, dtype=np.float32).view(np.uint8)  # finite: zeros
    dst = np.empty_like(src)
    check = ChunkCheck(dst, "float32")

    class RacingClient:  # the hash's update runs between the checks of a piece and the next read of the source
        inner = xxhash.xxh3_64()

        def update(self, data):
            self.inner.update(data)
            src.view(np.float32)[:] = np.nan

        def intdigest(self):
            return self.inner.intdigest()

    check._hash = RacingClient()
    check.copy_in(0, src, client_writable)
    value, finite = check.result()
    consistent = (value, finite) == (checksum(dst), layout_values_finite(dst, "float32"))
    assert consistent == client_writable


def test_refusals_are_the_projects_own_errors_with_their_status():
    e = engine(quantization="none")
    (begin0, blob0), = chunks(SMALL, 1)
    with pytest.raises(NoCapacity, match="exceeds the quota") as refused:  # bob's quota is under one chunk
        with e.put(BOB, header(1)) as put:
            put.begin_chunk(begin0)
    assert refused.value.status == "RESOURCE_EXHAUSTED"
    assert held(e, BOB) == (0, 0, 0)
    k8 = model_to_proto(SMALL)
    k8.quantization = "k8v8"
    with pytest.raises(NotServed) as refused:
        e.lookup(ALICE, k8, list(range(CHUNK)))
    assert refused.value.status == "FAILED_PRECONDITION"
    with pytest.raises(InvalidRequest, match="model is missing"):
        e.lookup(ALICE, None, [1])
    with pytest.raises(PermissionDenied):
        e.resize(ALICE, 1 << 20, 0.0)  # alice is no admin
    with pytest.raises(CacheError, match="tokens is empty"):
        e.delete(ALICE, model_to_proto(SMALL), [])


def test_a_put_checking_what_is_cached_is_not_a_request_the_eviction_policy_counts():
    """A Put asks whether each chunk (and its parent) is stored before taking its bytes: that is no reuse, and
    telling the policy so made a chunk written twice look hot (frequency) or recent (LRU)."""
    e = engine()
    requested = []
    inner = e.tier.policy.requested
    e.tier.policy.requested = lambda key: (requested.append(key), inner(key))[1]
    sent = chunks(SMALL, 2)
    for _ in range(2):  # the second Put finds both chunks stored and skips them
        with e.put(ALICE, header(2)) as put:
            for begin, blob in sent:
                put.begin_chunk(begin)
                put.add_data(blob)
            result = put.commit()
    assert (result.stored_chunks, result.skipped_chunks) == (0, 2)
    assert requested == []
    e.lookup(ALICE, model_to_proto(SMALL), list(range(2 * CHUNK)))
    assert len(requested) == 2  # a lookup is a request for each chunk it finds


def test_reads_are_told_to_read_listeners():
    """Lookups, Gets and each chunk a Get sends reach every ReadListener, as inserts and removals reach the
    store's listeners (metrics and tenancy's counters are two of them)."""
    from promptcache.sidecar.store import ReadListener

    class Recorder(ReadListener):
        def __init__(self):
            self.looked, self.sent = [], []

        def looked_up(self, rpc, owner, cached, total, by_tier):
            self.looked.append((rpc, owner, cached, total, dict(by_tier)))

        def served(self, owner, key, nbytes, tier):
            self.sent.append((owner, nbytes, tier))

    e, seen = engine(), Recorder()
    e.subscribe_reads(seen)
    sent = chunks(SMALL, 2)
    with e.put(ALICE, header(2)) as put:
        for begin, blob in sent:
            put.begin_chunk(begin)
            put.add_data(blob)
        put.commit()
    tokens = list(range(3 * CHUNK))
    assert e.lookup(ALICE, model_to_proto(SMALL), tokens).cached_tokens == 2 * CHUNK
    assert len(list(e.read_chunks(ALICE, pb.GetRequest(model=model_to_proto(SMALL), tokens=tokens)))) == 2
    assert seen.looked == [("lookup", "alice", 2 * CHUNK, 3 * CHUNK, {"device": 2 * CHUNK}),
                           ("get", "alice", 2 * CHUNK, 3 * CHUNK, {"device": 2 * CHUNK})]
    assert seen.sent == [("alice", len(sent[0][1]), "device")] * 2
    assert e.metrics.sent_bytes.labels("device")._value.get() == 2 * len(sent[0][1])
    assert (e.hit_tokens, e.missed_tokens) == (4 * CHUNK, 2 * CHUNK)


def _put_all(e: CacheEngine, sent) -> None:
    with e.put(ALICE, header(len(sent))) as put:
        for begin, blob in sent:
            put.begin_chunk(begin)
            put.add_data(blob)
        assert put.commit().stored_chunks == len(sent)


def test_chunks_left_in_held_stay_leased_until_released_even_when_evicted():
    """read_chunks(held=...): the bulk channel queues several chunks before sending them, so their leases must
    outlive the next chunk's read: an evicted chunk's memory stays accounted (draining) and unchanged until
    release_leases; without `held` each lease ends when the next chunk is asked for."""
    e = engine()
    sent = chunks(SMALL, 3)
    _put_all(e, sent)
    request = pb.GetRequest(model=model_to_proto(SMALL), tokens=list(range(3 * CHUNK)))
    queued, views = [], []
    reader = e.read_chunks(ALICE, request, held=queued)
    for _, view in reader:
        views.append(view)
    assert len(views) == 3 and len(queued) == 3 and all(entry.leases == 1 for entry in queued)
    assert e.delete(ALICE, model_to_proto(SMALL), list(range(3 * CHUNK))) == 3  # evicted while still queued
    assert e.tier.usage()["draining"] == sum(entry.accounted for entry in queued)
    other = chunks(SMALL, 3)  # other values, stored while the first ones are still queued
    with e.put(ALICE, pb.PutHeader(model=model_to_proto(SMALL), tokens=list(range(7, 7 + 3 * CHUNK)))) as put:
        for begin, blob in other:
            put.begin_chunk(begin)
            put.add_data(blob)
        assert put.commit().stored_chunks == 3
    assert [bytes(v) for v in views] == [blob for _, blob in sent]  # their memory was not handed out again
    e.delete(ALICE, model_to_proto(SMALL), list(range(7, 7 + 3 * CHUNK)))
    e.release_leases(queued)
    assert queued == [] and e.tier.usage() == {"entries": 0, "used": 0, "reserved": 0, "draining": 0,
                                                "budget": e.tier.budget}

    _put_all(e, sent)
    plain = e.read_chunks(ALICE, request)
    next(plain)
    first = next(iter(e.tier._entries.values()))
    next(plain)  # asking for the next chunk ends the first one's lease
    assert first.leases == 0
    plain.close()
    assert e.tier.usage()["draining"] == 0


def test_a_held_list_gets_the_chunk_yielded_last_when_the_reader_stops_early():
    e = engine()
    _put_all(e, chunks(SMALL, 3))
    queued = []
    reader = e.read_chunks(ALICE, pb.GetRequest(model=model_to_proto(SMALL), tokens=list(range(3 * CHUNK))),
                           held=queued)
    next(reader)
    assert queued == []  # the chunk being read is still read_chunks' own
    reader.close()  # the consumer stops (an error, a deadline): the chunk it was given may still be queued
    assert len(queued) == 1 and queued[0].leases == 1
    e.release_leases(queued)
    assert all(entry.leases == 0 for entry in e.tier._entries.values())


def test_an_entry_naming_another_fingerprint_than_its_key_gives_way_to_the_put_of_that_key():
    """A key is derived from its model's fingerprint, so an entry under it that names another fingerprint can only
    come from a forged or damaged record (a snapshot imported or warmed up, the disk tier): it must not block the
    prefix - before, every Put of that key was dropped (reported stored) and the rest of the prompt rejected."""
    e = engine()
    sent = chunks(SMALL, 3)

    def put_all():
        with e.put(ALICE, header(3)) as put:
            for begin, blob in sent:
                put.begin_chunk(begin)
                put.add_data(blob)
            return put.commit()

    assert put_all().stored_chunks == 3
    entries = list(e.tier._entries.values())
    fingerprint = entries[0].fingerprint
    e.tier.delete([x.key for x in entries[1:]], fingerprint, reason="delete")
    forged = entries[0]
    forged.fingerprint = bytes(32)  # what a forged snapshot record under this key carries
    result = put_all()
    assert (result.stored_chunks, result.skipped_chunks, result.rejected_chunks) == (3, 0, 0)
    assert forged.key not in e.tier._entries or e.tier._entries[forged.key] is not forged
    assert {x.fingerprint for x in e.tier._entries.values()} == {fingerprint} and len(e.tier._entries) == 3
